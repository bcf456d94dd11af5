"""The goodput ledger (relay/orchestrator/goodput.py): where every GPU-second a relay was charged went. A unit test
on constructed records (a stretch trained again, a wedge), and a relay on the emulator whose ledger adds up to the
emulator's own quota ledger."""
from __future__ import annotations

import json

import pytest

from relay.orchestrator import goodput


def _records():
    sessions = [  # session 2 resumed at step 80, below session 1's recorded end (a corrupt version restored)
        {"index": 1, "run_id": "r-s001-a1", "started": 1100.0, "ended": 1700.0, "seconds": 600.0, "step_start": 0,
         "step_end": 100, "save_seconds": 10.0, "stop_reason": "steps"},
        {"index": 2, "run_id": "r-s002-a1", "started": 2050.0, "ended": 2350.0, "seconds": 300.0, "step_start": 80,
         "step_end": 180, "save_seconds": 0.0, "stop_reason": "steps"}]
    charges = [  # session 2 ended its process at 2360 and was wedged until the relay deleted it at 5960
        {"run_id": "r-s001-a1", "pushed_at": 1000.0, "process_end": 1710.0, "kaggle_end_seen": 1720.0},
        {"run_id": "r-s002-a1", "pushed_at": 2000.0, "process_end": 2360.0, "kaggle_end_seen": 5960.0, "wedged": True}]
    return sessions, charges


def test_a_redone_stretch_and_a_wedge_are_named_and_everything_adds_up():
    sessions, charges = _records()
    led = goodput.ledger(sessions, charges)
    one, two = (a.seconds for a in led.attempts)
    assert one["start-up"] == 100 and one["saving"] == 10 and one["final tail"] == 10 and one["shut-down"] == 10
    assert one["training redone"] == pytest.approx(590 * 20 / 100) and one["training kept"] == pytest.approx(472)
    assert two["wedged"] == 3600 and two["training kept"] == 300 and two["start-up"] == 50
    for attempt in led.attempts:
        assert sum(attempt.seconds.values()) == pytest.approx(attempt.charged_s)
    assert led.charged_s == 720 + 3960 and led.goodput == pytest.approx(772 / 4680)
    assert [c for c, _ in led.losses()] == ["wedged", "start-up", "training redone"]
    line = led.line()
    assert line.startswith("goodput 16%") and "wedged 1h00m" in line and "\n" not in line
    # a killed session (no end line, no clean stop): what it trained after its last save is trained again
    killed = [dict(sessions[0], stop_reason="running")]
    cut = goodput.ledger(killed, [{"run_id": "r-s001-a1", "pushed_at": 1000.0, "kaggle_end_seen": 1800.0}])
    assert cut.attempts[0].seconds["training redone"] == pytest.approx(100)  # 1700 -> 1800
    assert cut.attempts[0].seconds["final tail"] == 0


def test_the_charge_record_reads_the_log_and_is_carried_across_hand_overs():
    lines = [{"run_id": "r-s002-a1", "step": 150, "time": 2300.0},
             {"run_id": "r-s002-a1", "step": 180, "kind": "end", "time": 2360.0}]
    log = json.dumps([{"stream_name": "stdout", "time": 1.0, "data": "relay-progress " + json.dumps(r) + "\n"}
                      for r in lines])
    record = goodput.charge_record("r-s002-a1", log, {"run_id": "r-s002-a1", "pushed_at": 2000.0}, 2400.0)
    assert record == {"run_id": "r-s002-a1", "kaggle_end_seen": 2400.0, "wedged": False, "pushed_at": 2000.0,
                      "process_end": 2360.0, "last_step": 180}
    published = {"charges": [{"run_id": "r-s001-a1"}, {"run_id": "r-s002-a1", "stale": True}]}
    assert [c.get("stale") for c in goodput.with_charge(published, {}, record).to_dict()["charges"]] == [None, None]
    # killed: no `end` line; it trained until its newest line at least, and what it trained since its last save
    # (step 150, 2300 s by its clock) is redone by the next session
    killed_log = json.dumps([{"stream_name": "stdout", "time": 1.0, "data": "relay-progress " + json.dumps(
        {k: v for k, v in r.items() if k != "kind"}) + "\n"} for r in lines])
    killed = goodput.charge_record("r-s002-a1", killed_log, {"run_id": "r-s002-a1", "pushed_at": 2000.0}, None)
    assert killed["last_line"] == 2360.0 and "process_end" not in killed and "kaggle_end_seen" not in killed
    session = {"run_id": "r-s002-a1", "started": 2010.0, "ended": 2300.0, "step_start": 100, "step_end": 150,
               "stop_reason": "running"}
    assert goodput.ledger([session], [killed]).attempts[0].seconds["training redone"] == pytest.approx(60)


def test_on_the_emulator_the_ledger_adds_up_to_its_quota_ledger(relay_env, monkeypatch):
    emu = relay_env.start()
    # 3 sessions of 150 steps; Kaggle's limit 1 h, so a session that asked for the cap would be pushed with 3600 s
    relay_env.write_spec(**{"kaggle.session_timeout": "1h", "session.budget": None})
    summary = relay_env.run_flow(monkeypatch)
    assert summary["state"] == "done", summary
    progress = relay_env.published_progress()
    with emu.store.lock:
        versions = {v["number"]: v for v in emu.store.kernels[relay_env.kernel]["versions"]}
        charged = {e["version"]: (e["start"], e["end"], e["kaggle_seconds"]) for e in emu.store.data["quota"]
                   if e["kernel"] == relay_env.kernel}
    runs = {r.version: r.run_id for r in relay_env.kernel_runs()}
    # item 2 of issue 47: the first session asks for the cap it may need (2 h, here capped at 1 h); the later
    # ones for what their measured steps take, minutes
    timeouts = [versions[n]["timeout_s"] for n in sorted(versions)]
    assert timeouts[0] == 3600 and all(t < 900 for t in timeouts[1:]), timeouts
    # the relay's own observations: every handed-over attempt charged from its push to when it saw it end
    observed = goodput.from_progress(progress)
    assert [c["run_id"] for c in progress["charges"]] == [s["run_id"] for s in progress["sessions"]]
    ledger_s = sum(s for _, _, s in charged.values())
    assert observed.charged_s >= ledger_s - 1.0  # the push is before Kaggle's start, the sighting after its end
    # with the emulator's ledger as Kaggle's start and end, the categories add up to it, second for second
    exact = [dict(c, kaggle_start=charged[n][0], kaggle_end=charged[n][1])
             for n, run in runs.items() for c in progress["charges"] if c["run_id"] == run]
    led = goodput.ledger(progress["sessions"], exact)
    assert sum(led.totals.values()) == pytest.approx(ledger_s) == pytest.approx(led.charged_s)
    assert led.totals["training kept"] > 0 and led.totals["other"] < 0.05 * ledger_s, led.table()
    print(led.line())
    print(observed.line())


def test_a_failed_attempt_that_handed_nothing_over_is_carried_and_listed():
    """Attempt s002-a1 failed (nothing handed over) and s002-a2 failed too; s002-a3 hands over: its hand-over lists
    both, carried from push to push in the pushed plans, each charged from its push to its end as a loss."""
    first = goodput.failed_charge("r-s002-a1", "", {"run_id": "r-s002-a1", "pushed_at": 100.0}, 400.0,
                                  "killed\nlog tail")
    pending = goodput.failed_charges({"run_id": "r-s002-a1", "pushed_at": 100.0}, first)
    second = goodput.failed_charge("r-s002-a2", "", {"run_id": "r-s002-a2", "pushed_at": 500.0,
                                                     "charges": pending}, 600.0, "killed", wedged=True)
    pending = goodput.failed_charges({"run_id": "r-s002-a2", "pushed_at": 500.0, "charges": pending}, second)
    assert [c["run_id"] for c in pending] == ["r-s002-a1", "r-s002-a2"] and first["failed"] == "killed"
    plan = {"run_id": "r-s002-a3", "pushed_at": 700.0, "charges": pending}  # as the third push carries them
    published = {"charges": [{"run_id": "r-s001-a1", "pushed_at": 0.0, "process_end": 90.0}]}
    session = {"index": 2, "run_id": "r-s002-a3", "started": 710.0, "ended": 800.0, "seconds": 90.0,
               "step_start": 10, "step_end": 20, "stop_reason": "steps"}
    progress = goodput.with_charge(published, {"sessions": [session]}, goodput.charge_record(
        "r-s002-a3", "", plan, None), goodput.carried(plan, "r-s002-a3"))
    assert [c.run_id for c in progress.charges] == ["r-s001-a1", "r-s002-a1", "r-s002-a2", "r-s002-a3"]
    ledger = goodput.from_progress(progress)
    assert [a.run_id for a in ledger.attempts] == ["r-s002-a1", "r-s002-a2", "r-s002-a3"]
    # the wedged one showed no sign of life (no progress line): all of its time is the wedge's
    assert ledger.totals["failed attempt"] == 300.0 and ledger.totals["wedged"] == 100.0
    assert ledger.charged_s == 400.0 + 100.0
    assert "largest losses: failed attempt 5m, wedged 2m" in ledger.line()


def test_a_wedged_attempt_is_charged_to_wedged_from_its_last_sign_of_life():
    """A wedged attempt deleted without a harvest: lost training until its newest progress line, wedged after it
    until the relay's delete; a killed (not wedged) one is all failed attempt."""
    line = {"run_id": "r-s003-a1", "step": 40, "time": 130.0}
    log = json.dumps([{"stream_name": "stdout", "time": 1.0, "data": "relay-progress " + json.dumps(line) + "\n"}])
    plan = {"run_id": "r-s003-a1", "pushed_at": 100.0}
    wedged = goodput.ledger([], [goodput.failed_charge("r-s003-a1", log, plan, 200.0, "wedged", wedged=True)])
    seconds = wedged.attempts[0].seconds
    assert seconds["failed attempt"] == 30.0 and seconds["wedged"] == 70.0 and wedged.charged_s == 100.0
    killed = goodput.ledger([], [goodput.failed_charge("r-s003-a1", log, plan, 200.0, "killed")])
    assert killed.attempts[0].seconds["failed attempt"] == 100.0 and killed.attempts[0].seconds["wedged"] == 0


def test_saving_is_what_the_kernel_measured_not_its_cadence_times_one_save():
    """A session whose record carries its measured wait in saves (`saving_s`) is charged that as saving; one long
    save no longer multiplies into the whole clock (a record without it keeps the estimate)."""
    session = {"run_id": "r-s002-a1", "started": 10.0, "ended": 18.0, "seconds": 8.0, "step_start": 150,
               "step_end": 265, "save_seconds": 2.0, "stop_reason": "steps"}
    charge = {"run_id": "r-s002-a1", "pushed_at": 10.0, "process_end": 18.0, "kaggle_end_seen": 18.0}
    estimated = goodput.ledger([session], [charge], save_every_s=1.0).attempts[0].seconds
    assert estimated["saving"] == 8.0 and estimated["training kept"] == 0  # 2 s x 9 saves, capped at the clock
    measured = goodput.ledger([dict(session, saving_s=0.5, saves=8)], [charge], save_every_s=1.0).attempts[0].seconds
    assert measured["saving"] == 0.5 and measured["training kept"] == 7.5


def test_a_session_records_what_its_saves_made_training_wait(tmp_path):
    """The kernel measures the saving the ledger charges: each save's wait summed into its record (`saving_s`,
    `saves`); the checkpoint's copy counts the saves before it, progress.json's every save."""
    from conftest import toy_spec_dict
    from relay.kernel.run import run_session
    from relay.shared import spec as spec_mod

    spec = spec_mod.RunSpec.model_validate(toy_spec_dict(session={"max_steps": 10}))
    run_session(spec, tmp_path / "work")  # one session of 10 steps: its final save
    progress = run_session(spec, tmp_path / "work")  # the second session, resumed from the first's save
    record = progress["sessions"][-1]
    assert record["saves"] >= 1 and 0 < record["saving_s"] <= record["seconds"], record
    led = goodput.ledger([record]).attempts[0].seconds
    assert led["saving"] == record["saving_s"]
