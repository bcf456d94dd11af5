"""Following a running session through Kaggle's log stream (the real client's kernels_logs_stream against the
emulator): live events while it runs, a dropped stream reconnected without counting anything twice, the
stored log after; and the early warnings read from the records."""
from __future__ import annotations

import json
import math

from kaggle_fixtures import USER, backend_for, make_emulator, isolated_env, push_script  # noqa: F401
from relay.orchestrator.live_progress import LiveSession, early_warnings
from relay.shared.progress_line import PREFIX

KERNEL = f"{USER}/live-test"
SCRIPT = '''
import json, os, time
print("relay: code abc run live-s001-a1", flush=True)
print(%r + json.dumps({"run_id": "live-s000-a1", "step": 0, "kind": "train"}), flush=True)  # a stale run's line
for step in range(1, 31):
    print(%r + json.dumps({"run_id": "live-s001-a1", "step": step, "kind": "train", "loss": 1.0 / step}), flush=True)
release = os.path.join(os.environ["KAGGLE_WORKING_DIR"], "release")
while not os.path.exists(release):  # ends when the test says so: the stream is live until then
    time.sleep(0.05)
''' % (PREFIX, PREFIX)


def test_a_dropped_live_stream_is_followed_to_the_end_with_each_record_once(make_emulator):
    emulator = make_emulator(faults={"stream_drop": {"after_events": 10}})
    backend = backend_for(emulator)
    push_script(backend, KERNEL, SCRIPT, gpu=False)
    live = LiveSession(backend, KERNEL, "live-s001-a1", sleep=lambda s: None).start()

    records = live.wait(120, until=lambda r: len(r) >= 30)
    assert [r["step"] for r in records] == list(range(1, 31))  # the stale run's line is not counted
    assert not live.ended  # still running: these came from the live stream
    assert live.reconnects >= 1 and emulator.faults.injected["stream_drop"] == 1

    version = emulator.store.kernels[KERNEL]["versions"][-1]["number"]
    (emulator.store.kernel_dir(KERNEL, version) / "working" / "release").write_text("")
    live.wait(120, until=lambda r: False)
    assert live.ended and [r["step"] for r in live.records] == list(range(1, 31))

    # once done, the stream is the stored log: a new follower reads the same records at once
    again = LiveSession(backend, KERNEL, "live-s001-a1").start()
    assert [r["step"] for r in again.wait(60)] == list(range(1, 31)) and again.ended and again.reconnects == 0


def test_early_warnings_name_a_blow_up_a_non_finite_loss_a_memory_back_off_and_a_slow_session():
    train = [{"kind": "train", "step": s, "loss": 1.0, "micro_batch": 8, "samples_per_s": 100.0} for s in range(1, 6)]
    assert early_warnings(train, slow_below=150) == []
    keys = dict(early_warnings(train + [{"kind": "train", "step": 6, "loss": 50.0, "micro_batch": 4}]))
    assert set(keys) == {"blowup", "oom"} and "50 at step 6" in keys["blowup"] and "8 -> 4" in keys["oom"]
    assert dict(early_warnings(train + [{"kind": "train", "step": 6, "loss": math.nan}]))["nonfinite"] \
        == "the loss is nan at step 6"
    assert "under half the 300 the plan assumed" in dict(early_warnings(train, slow_below=300))["slow"]
    assert json.dumps(early_warnings([]))  # plain data: goes into logs and notifications as is


def test_one_eta_a_step_capped_session_ends_at_its_cap_and_the_plan_keeps_its_real_start():
    """The issue's case: a session with ~12 h of budget left but a step cap 90 s away ends at its cap; the plan's
    running session starts when it really started, whenever the plan is made."""
    from datetime import datetime, timezone
    from types import SimpleNamespace

    from relay.orchestrator.live_progress import estimate, eta_text
    from relay.orchestrator.policy import plan_text
    from relay.shared import spec as spec_mod

    t0 = 1_800_000_000.0
    records = [{"kind": "train", "session": 2, "run_id": "r-s002-a1", "step_start": 150, "total_steps": 1000,
                "step": 150 + s, "time": t0 + s, "time_left_s": 43000.0 - s, "loss": 1.0} for s in range(1, 61)]
    eta = estimate(records, session_max_steps=150)
    assert (eta.session_end_step, eta.ends_by) == (300, "its step cap")
    assert eta.session_left_s == 90.0 and eta.run_left_s == 790.0 and eta.started_at == t0 + 1
    assert "session ends in ~1m30s at step 300 (its step cap" in eta_text(records, 150)
    assert estimate(records).ends_by == "the run's end" and estimate(records).session_end_step == 1000
    budgeted = [{**r, "time_left_s": 30.0} for r in records]  # a budget nearer than the cap: the budget ends it
    assert (estimate(budgeted, 150).session_end_step, estimate(budgeted, 150).ends_by) == (240, "its budget")

    spec = SimpleNamespace(kaggle=spec_mod.KaggleConfig(), session=spec_mod.SessionConfig(max_steps=150))
    started = datetime.fromtimestamp(t0 + 1, timezone.utc).strftime("%a %Y-%m-%d %H:%M")
    for later in (0, 600):  # the same running session, planned now and 10 minutes later
        now = datetime.fromtimestamp(t0 + 60 + later, timezone.utc)
        text = plan_text(spec, {"total_steps": 1000, "global_step": 150}, None, now, running=eta)
        assert text.startswith(f"running: session 2, started {started} UTC,") and "at step 300 (its step cap)" \
            in text, text
        assert "(no plan yet" not in text and "150 (300->450" in text, text


def test_the_flow_log_says_an_eval_at_its_own_step_once(monkeypatch):
    """Train lines are rate-bounded, evals always print: the newest train line (step 10) is older than the eval
    (step 32). The flow's log names the eval's step, and a tick reading the session's history again (each tick
    is a flow run of its own) does not log it again."""
    from types import SimpleNamespace

    import relay.orchestrator.session_view as session_view
    import tasks.live_view as live_view
    from relay.shared.progress_line import ProgressLines, parse

    lines = []
    progress = ProgressLines(1, 0, 120, every_s=1e9, write=lines.append, run_id="ev-s001-a1")
    for step in range(10, 41):
        progress({"kind": "train", "step": step, "loss": 1.0 / step})
        if step == 32:
            progress({"kind": "eval", "step": 32, "accuracy": 0.75})
    records = [parse(line) for line in lines]
    assert [(r["kind"], r["step"]) for r in records] == [("train", 10), ("eval", 32)]

    said = []
    monkeypatch.setattr(live_view, "get_run_logger", lambda: SimpleNamespace(
        info=lambda msg, *a: said.append(msg % a), warning=lambda msg, *a: said.append(msg % a)))
    monkeypatch.setattr(live_view.LiveView, "show_progress", lambda self, *a: None)
    monkeypatch.setattr(live_view.artifacts, "publish_running", lambda *a, **k: None)
    marks = live_view.TickMarks("ev")
    marks._kept = {}
    monkeypatch.setattr(marks, "keep", lambda **changes: marks._kept.update(changes))
    names = SimpleNamespace(name="ev", kernel="u/ev", owner="u")
    monkeypatch.setattr(session_view, "LiveSession", lambda backend, kernel, run_id: SimpleNamespace(
        start=lambda: SimpleNamespace(run_id=run_id, records=records, ended=False, silent_for=lambda: 0.0)))
    for tick in range(2):  # two ticks of one running session, each a view of its own reading it from its start
        view = live_view.LiveView(session_view.SessionView(None, names, None, session_max_steps=40), marks=marks)
        view.follow("ev-s001-a1")
        view.refresh(None, "running")
        view.refresh(None, "running")  # nothing new
    evals = [s for s in said if "eval" in s]
    assert len(evals) == 1, said
    assert evals[0].startswith("ev-s001-a1 step 32 of 120; eval accuracy 0.75"), evals


def test_a_session_whose_process_ended_while_kaggle_runs_it_is_named_waiting_not_training():
    """Issue 61: while a session Kaggle still runs has printed its `end` line (a wedge in the making), the progress
    card and the sessions table say its process ended and the relay waits for Kaggle, not an ETA of training."""
    from relay.orchestrator.live_progress import eta_text, running_row

    t0 = 1_800_000_000.0
    records = [{"kind": "train", "session": 3, "run_id": "r-s003-a1", "step_start": 100, "step": 100 + s,
                "time": t0 + s, "time_left_s": 600.0 - s, "loss": 1.0} for s in range(1, 21)]
    assert eta_text(records, 50).startswith("session ends in")
    ended = records + [{"kind": "end", "session": 3, "run_id": "r-s003-a1", "step_start": 100, "step": 120,
                        "stop_reason": "steps", "status": "paused", "time": t0 + 21}]
    text = eta_text(ended, 50)
    assert text.startswith("its process ended at step 120 (steps, ") and "waiting for Kaggle to end the session" in text
    assert running_row(ended, "running")["stop_reason"] == "process ended (steps); Kaggle: running"


def test_the_progress_text_names_a_wedge_while_the_relay_waits_for_its_deadline_and_after():
    """Its process ended, Kaggle still runs it: until its deadline the text says the relay waits until when, past
    it that it is wedged; a session Kaggle ended is said ended, and one past its deadline without an end line is
    wedged too (its lines stopped or it never finished in time)."""
    from relay.orchestrator.live_progress import eta_text

    lines = [{"kind": "train", "step": 410, "time": 1000.0, "step_start": 268},
             {"kind": "end", "step": 418, "time": 1010.0, "stop_reason": "steps"}]
    waiting = eta_text(lines, deadline=1100.0, kernel_state="running", now=1050.0)
    assert "its process ended at step 418" in waiting and "wedged if it still does at its deadline" in waiting
    past = eta_text(lines, deadline=1100.0, kernel_state="running", now=1101.0)
    assert "WEDGED: Kaggle still runs the session past its deadline" in past
    assert "Kaggle ended the session (complete)" in eta_text(lines, deadline=1100.0, kernel_state="complete", now=1101.0)
    silent = eta_text(lines[:1], deadline=1100.0, kernel_state="running", now=1101.0)
    assert silent.startswith("WEDGED") and "step 410" in silent
    assert "ETA" in eta_text(lines[:1], deadline=1100.0, kernel_state="running", now=1050.0)
