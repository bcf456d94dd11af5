"""A wedged session (docs/kaggle.md, "Platform traps the relay handles"): Kaggle still reports a session running
after its process ended, past its own session limit, while its GPU time is counted. Deleting its kernel is the
only lever. The emulator's `wedge` fault, the kernel delete, the relay's pure decision, and the relay noticing,
deleting (or waiting), telling and resuming.

No outcome here depends on the machine's speed: the emulator's wedge lasts a number of status calls after the
session limit, or until the kernel is deleted; where a limit must have passed, the test moves the version's start
back (the emulator's clock for it), and where the relay's deadline must have passed, it ends the session's timeout
(the emulator's and the one in its pushed plan) once the emulator has the session wedged and wakes the flow's wait
on it; it never sleeps for either.
"""
from __future__ import annotations

import json
import re
import time

import pytest

from kaggle_fixtures import USER, backend_for, isolated_env, make_emulator, push_script  # noqa: F401
from relay_fixtures import wait_for
from relay.emulator.faults import FaultPlan
from relay.orchestrator.kaggle.kernel_source import find_plan, find_run_id
from relay.orchestrator import chain, goodput, handoff
from relay.orchestrator.chain import Do, Observation
from relay.orchestrator.kaggle import KernelState, NotFound
from relay.shared.errors import InputError

KERNEL = f"{USER}/wedge-probe"
WRITE_AND_END = "open('out.txt', 'w').write('saved')\nprint('saved', flush=True)\n"
SLEEP = "import time\nopen('started.txt', 'w').write('yes')\ntime.sleep(120)\n"


def _until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _process_ended(emu, ref: str = KERNEL, number: int = 1) -> bool:
    with emu.store.lock:
        return bool((emu.store.kernel_version(ref, f"v{number}") or {}).get("wedged"))


def _limit_passed(emu, ref: str = KERNEL, number: int = 1) -> None:
    """The version's session limit is in the past: its start moved back (what the emulator measures the limit from)."""
    with emu.store.lock:
        version = emu.store.kernel_version(ref, f"v{number}")
        version["started"] -= version["timeout_s"] + 1


def _deadline_passed(emu, ref: str, number: int, grace_s: float) -> None:
    """A relay session's Kaggle limit and the relay's deadline are past, now: the timeout its push asked for ends
    now, in the emulator (the version's limit) and in the plan of its source (what the relay reads back with
    `kaggle kernels pull` and counts its deadline from with `grace_s`: handoff.running_deadline). Its push and
    start stay when they were, so the ledger's times are the real ones."""
    with emu.store.lock:
        version = emu.store.kernel_version(ref, f"v{number}")
        path = emu.store.kernel_dir(ref, number) / "source.py"
        source = path.read_text()
        plan, now = find_plan(source), time.time()
        plan["timeout_s"] = now - 0.5 - grace_s - float(plan["pushed_at"])
        moved = path.with_name("source.moved")  # replaced whole: a pull meanwhile reads the old text or the new
        moved.write_text(re.sub(r"^PLAN = .+$", lambda _: f"PLAN = {json.dumps(plan)!r}", source, count=1,
                                flags=re.M))
        moved.replace(path)
        version["timeout_s"] = now - 0.5 - version["started"]


# -- the emulator ------------------------------------------------------------------------------------------
def test_wedged_version_reads_running_past_its_limit_for_the_fault_calls_then_what_it_ended_with(make_emulator):
    emu = make_emulator(faults={"wedge": {"pushes": [1], "calls": 3}})
    backend = backend_for(emu)
    push_script(backend, KERNEL, WRITE_AND_END, gpu=False, timeout_s=3600)
    _until(lambda: _process_ended(emu), 60, "the process's end")
    # before the limit passed: RUNNING however often asked, no output served, nothing counted
    for _ in range(5):
        assert backend.kernel_status(KERNEL, 1).state is KernelState.RUNNING
    served = backend.client.run("output", lambda api: api.kernels_output(KERNEL, path=str(emu.store.root / "o")))[0]
    assert [name.rsplit("/", 1)[-1] for name in served] == ["wedge-probe.log"]  # the log alone, not out.txt
    _limit_passed(emu)
    assert [backend.kernel_status(KERNEL, 1).state for _ in range(4)] == [KernelState.RUNNING] * 3 + [
        KernelState.COMPLETE]
    version = emu.store.kernel_version(KERNEL, "v1")
    assert "wedged" not in version and version["exit_code"] == 0
    assert (emu.store.kernel_dir(KERNEL, 1) / "working" / "out.txt").read_text() == "saved"
    assert emu.faults.injected["wedge"] == 1 and emu.faults.injected["wedge_call"] == 3
    # the second push is not wedged (pushes: [1])
    push_script(backend, KERNEL, WRITE_AND_END, gpu=False, timeout_s=3600)
    _until(lambda: backend.kernel_status(KERNEL, 2).state.finished, 60, "version 2's end")
    assert backend.kernel_status(KERNEL, 2).state is KernelState.COMPLETE


def test_delete_ends_a_wedged_and_a_running_session_whose_slot_and_gpu_time_kaggle_counts_for_a_while(make_emulator):
    # delete_lag: the deleted session holds its slot and is charged for 6 more of its owner's requests (kaggle-cli
    # #185, #937); one GPU session allowed, so the ghost alone refuses a push
    emu = make_emulator(max_gpu_sessions=1, faults={"wedge": {"pushes": [1]}, "delete_lag": {"calls": 6}})
    backend = backend_for(emu)
    push_script(backend, KERNEL, WRITE_AND_END, timeout_s=3600)
    _until(lambda: _process_ended(emu), 60, "the process's end")
    _limit_passed(emu)
    assert [backend.kernel_status(KERNEL, 1).state for _ in range(20)] == [KernelState.RUNNING] * 20
    assert emu.store.running_gpu_sessions(USER) == 1  # a wedged session keeps its slot

    assert backend.delete_kernel(KERNEL) is True
    assert backend.delete_kernel(KERNEL) is False  # gone already: a retried delete is no error (1)
    with pytest.raises(NotFound):
        backend.kernel_status(KERNEL, 1)  # (2)
    assert backend.current_run(KERNEL) is None  # (3)
    # the kernel is gone, its session is not: it holds the one slot, its GPU time runs on, nothing is charged yet
    assert emu.store.running_gpu_sessions(USER) == 1
    assert not [e for e in emu.store.data["quota"] if e["kernel"] == KERNEL]
    assert backend.quota().used_s > 0  # counted in flight, from the quota period's start (4)
    refused = push_script(backend, KERNEL, SLEEP, timeout_s=3600)  # (5)
    assert refused.error == "Maximum batch GPU session count of 1 reached." and not refused.version_number
    assert emu.faults.injected["delete_lag_refusal"] == 1
    assert backend.current_run(KERNEL) is None  # (6): the ghost's last request
    assert emu.store.running_gpu_sessions(USER) == 0
    charged = [e for e in emu.store.data["quota"] if e["kernel"] == KERNEL]
    assert len(charged) == 1 and charged[0]["kaggle_seconds"] > 3600  # the wedge's GPU time, to the ghost's end

    # pushed again under the same slug: a new kernel, version 1, none of the deleted one's output
    push_script(backend, KERNEL, SLEEP, timeout_s=3600)
    working = emu.store.kernel_dir(KERNEL, 1) / "working"
    _until(lambda: (working / "started.txt").is_file(), 60, "the new version 1's start")
    assert not (working / "out.txt").exists()
    assert backend.kernel_status(KERNEL, 1).state is KernelState.RUNNING
    # a running session's delete kills its process now (it would sleep 120 s); its GPU time is charged when the
    # ghost ends
    assert backend.delete_kernel(KERNEL) is True
    assert not emu.runner.threads[f"{KERNEL}/v1"].is_alive()
    for _ in range(6):
        assert backend.current_run(KERNEL) is None
    assert len([e for e in emu.store.data["quota"] if e["kernel"] == KERNEL]) == 2
    assert emu.store.running_gpu_sessions(USER) == 0
    assert [k["ref"] for k in emu.store.data["deleted_kernels"]] == [KERNEL, KERNEL]


def test_without_the_delete_lag_a_delete_frees_the_slot_and_charges_at_once(make_emulator):
    emu = make_emulator(faults={"delete_lag": {"calls": 0}})
    backend = backend_for(emu)
    push_script(backend, KERNEL, SLEEP, timeout_s=3600)
    working = emu.store.kernel_dir(KERNEL, 1) / "working"
    _until(lambda: (working / "started.txt").is_file(), 60, "version 1's start")
    assert backend.delete_kernel(KERNEL) is True
    assert emu.store.running_gpu_sessions(USER) == 0 and len(emu.store.data["quota"]) == 1


@pytest.mark.parametrize("bad", [{"calls": -1}, {"pushes": [0]}, {"pushes": 2}, {"every": 1}, {"calls": "3"}])
def test_wedge_fault_rejects_bad_settings_in_one_line(bad):
    with pytest.raises(InputError, match=r"^faults: wedge: expected"):
        FaultPlan({"wedge": bad})


# -- the relay's decision (pure) ---------------------------------------------------------------------------
PUBLISHED = {"run_id": "r-s001-a1", "global_step": 150, "status": "paused"}


def _obs(state: str = "running", deadline=1000.0, at: float = 1001.0, run: str = "r-s002-a1") -> Observation:
    return Observation(PUBLISHED, run, state, kernel_version=2, deadline=deadline, observed_at=at)


def test_decide_a_session_running_past_its_deadline_is_wedged():
    action = chain.decide("r", _obs())
    assert (action.do, action.run_id, action.session, action.attempt) == (Do.WEDGED, "r-s002-a1", 2, 1)
    assert action.reason == "session 2 (r-s002-a1) is still reported running 1 s past its deadline: wedged"


@pytest.mark.parametrize("obs", [
    _obs(at=999.0),                 # before the deadline: running
    _obs(at=1000.0),                # at it
    _obs(deadline=None),            # a kernel pushed without a deadline in its plan
    _obs(state="queued"),           # Kaggle has not started it: its own clock has not begun
    _obs(state="complete"),         # ended, as it should
])
def test_decide_not_wedged(obs):
    assert chain.decide("r", obs).do is not Do.WEDGED


def test_after_wedge_retries_from_the_published_checkpoint_or_stops_after_the_retries():
    wedged = chain.decide("r", _obs())
    retry = chain.after_wedge("r", wedged, harvested=False, max_attempts=3)
    assert (retry.do, retry.run_id, retry.session, retry.attempt) == (Do.PUSH, "r-s002-a2", 2, 2)
    assert retry.failed == f"session 2 (r-s002-a1) failed: {wedged.reason}"
    last = chain.after_wedge("r", chain.decide("r", _obs(run="r-s002-a3")), harvested=False, max_attempts=3)
    assert last.do is Do.FAILED and "failed 3 times" in last.reason
    kept = chain.after_wedge("r", wedged, harvested=True, max_attempts=3)
    assert kept.do is Do.HANDED_OVER and not kept.failed
    # the spec's choice: delete (the default) or wait
    assert chain.on_wedged(wedged, "wait").do is Do.WAIT and "waiting for Kaggle" in chain.on_wedged(wedged, "wait").reason
    assert chain.on_wedged(wedged, "delete") is wedged


def test_after_a_wedged_run_was_deleted_every_later_look_decides_the_same_new_attempt():
    """Kaggle can refuse the retry's push for a while after the delete (kaggle-cli #185): the next look finds no
    kernel, and the deleted run id recorded on Kaggle (deleted_run) makes it the same retry, never the deleted id."""
    gone = Observation(PUBLISHED, None, None, deleted_run="r-s002-a1")
    action = chain.decide("r", gone)
    assert (action.do, action.run_id, action.attempt) == (Do.PUSH, "r-s002-a2", 2)
    assert action.reason == "r-s002-a1 was wedged and its kernel deleted"
    # the newest deleted attempt wins, whoever deleted it (a `relay stop --now` of the retry, then a wedge)
    both = Observation(PUBLISHED, None, None, ended_by_user="r-s002-a2", deleted_run="r-s002-a3")
    assert chain.decide("r", both).run_id == "r-s002-a4"
    assert chain.decide("r", Observation(PUBLISHED, None, None, ended_by_user="r-s002-a3",
                                         deleted_run="r-s002-a1")).run_id == "r-s002-a4"
    # an earlier session's deleted run, or a kernel pushed since, changes nothing
    assert chain.decide("r", Observation(PUBLISHED, None, None, deleted_run="r-s001-a1")).run_id == "r-s002-a1"
    assert chain.decide("r", _obs(state="complete", run="r-s002-a2")).do is Do.HARVEST


# -- the relay, end to end -----------------------------------------------------------------------------------
# A 60 s budget: Kaggle's limit for a session is 62 s (kaggle_timeout_s: budget, startup_overhead, safety_margin),
# the relay's deadline 1 s (startup_overhead) later. Sessions end at session.max_steps (a start-up of ~4 CPU s and
# 150 toy steps: ~20 s on a machine loaded 5-fold) long before either; the wedge lasts until the relay deletes
# the kernel, or until the test lets it go. Once the emulator has session 2 wedged (its process ended, its status
# RUNNING), the test ends the session's timeout there (_deadline_passed) and wakes the flow's wait on it, in place
# of the ~45 s the relay would wait for its deadline: what the relay sees is the same, and when it sees it is an
# event, not the machine's speed. Both flows: the `relays` flow's wait ended with no session ended (at a
# deadline, by its clock) has its next round look at every running relay (flows/relays_sharing_quota.py). Two
# sessions: the wedged one is the last, so what the relay does after it (done again, or
# waited for) ends the relay.
WEDGED_SECOND = {"seed": 5, "wedge": {"pushes": [2]}}


def _relay_spec(relay_env, name: str, on_wedged: str):
    return relay_env.write_spec(**{"name": name, "optim.max_steps": 300, "session.budget": "60s",
                                   "kaggle.on_wedged": on_wedged})


def _second_session_past_its_deadline(relay_env, emu, flow) -> None:
    """Once the emulator has session 2 wedged, its deadline passed (_deadline_passed), and the flow's wait on it
    woken, as its deadline would (RelayEnv.wake_follow)."""
    wait_for(lambda: _process_ended(emu, relay_env.kernel, 2) or flow.poll() is not None, 300,
             "session 2's process to end (wedged)", interval=0.1)
    assert _process_ended(emu, relay_env.kernel, 2), _log(relay_env)
    _deadline_passed(emu, relay_env.kernel, 2, grace_s=1.0)  # the toy spec's kaggle.startup_overhead
    relay_env.wake_follow()


def _told(name: str) -> list:
    from prefect.variables import Variable

    return json.loads(Variable.get(f"relay-notified-{name}", default="[]"))


def _summary(log: str) -> dict:
    return json.loads(log.split("RELAY-SUMMARY ", 1)[1].splitlines()[0])


def test_a_wedged_session_is_deleted_told_and_redone_from_the_last_checkpoint(relay_env, both_flows, reference):
    # what was told is kept per relay name on the (shared) Prefect server
    _wedged_relay_is_deleted_and_redone(relay_env, reference, f"wedge-{both_flows}", "watch")


def test_ticks_notice_a_wedged_session_too(relay_env, reference):
    """A schedule's ticks (TICK_EVERY_S apart), none waiting: a tick that observes the wedge takes it."""
    _wedged_relay_is_deleted_and_redone(relay_env, reference, "wedge-ticks", "tick-loop", tick_every=TICK_EVERY_S)


# A schedule's ticks: each tick is a whole flow run (~0.6 CPU s of the flow process and the Prefect server), ~11
# at 3 s apart for this relay (a tick that observes the wedged session after its deadline moved takes it); 47 back to
# back (0.2 s apart) when the test waited out the real deadline. How often a schedule ticks changes when a tick sees
# the deadline passed, not what it does then.
TICK_EVERY_S = 3.0


def _wedged_relay_is_deleted_and_redone(relay_env, reference, name: str, mode: str, tick_every: float = 0.2) -> None:
    # one GPU session allowed and the delete lag on (its default): the deleted session holds the slot for a while,
    # so the retry's first push is refused ("Maximum batch GPU session count of 1 reached.", kaggle-cli #185)
    emu = relay_env.start(faults=WEDGED_SECOND, max_gpu_sessions=1)
    spec = _relay_spec(relay_env, name, "delete")
    reference.start(spec)
    flow = relay_env.flow_process(mode=mode, tick_every=tick_every)
    _second_session_past_its_deadline(relay_env, emu, flow)
    assert flow.wait(600) == 0, _log(relay_env)
    log = _log(relay_env)
    summary = _summary(log)
    assert summary["state"] == "done" and summary["step"] == 300

    # session 2 was wedged (still RUNNING, its process ended): its kernel was deleted, its GPU time charged to the
    # delete; session 2 ran again, from session 1's checkpoint, on a new kernel under the same slug
    (deleted,) = emu.store.data["deleted_kernels"]
    assert [(v["number"], v["status"]) for v in deleted["versions"]] == [(1, "COMPLETE"), (2, "CANCEL_ACKNOWLEDGED")]
    gone = emu.store.root / "deleted" / relay_env.kernel / str(deleted["id"])
    pushed = [find_run_id((gone / f"v{n}" / "source.py").read_text()) for n in (1, 2)]
    pushed += [r.run_id for r in relay_env.kernel_runs()]
    assert pushed == [f"{name}-s001-a1", f"{name}-s002-a1", f"{name}-s002-a2"]  # none twice
    # the retry met the deleted session's slot, waited, and was pushed once when Kaggle accepted it
    assert emu.faults.injected["delete_lag_refusal"] >= 1 and "push refused (concurrency)" in log, log
    assert not emu.store.ghosts
    assert all(r.status == "COMPLETE" for r in relay_env.kernel_runs())
    charged = [e for e in emu.store.data["quota"] if e["kernel"] == relay_env.kernel]
    assert len(charged) == 3  # the wedge's GPU time stopped at its delete

    # said in one line in the flow log, and told once through the notifications
    lines = [line for line in log.splitlines() if "wedged; deleting its kernel" in line]
    assert len(lines) == 1 and f"session 2 ({name}-s002-a1) is still reported running" in lines[0], log
    assert "resuming from the last published checkpoint (step 150)" in lines[0]
    assert f"wedged-{name}-s002-a1" in _told(name) and f"failed-{name}-s002-a1" in _told(name)

    progress = relay_env.published_progress()
    assert [s["step_start"] for s in progress["sessions"]] == [0, 150]
    assert summary["weights_sha256"] == progress["weights_sha256"] == reference.weights(spec)
    # the wedged attempt handed nothing over, yet its GPU time is in the ledger (issue 47): recorded when the relay
    # deleted it, carried in the next push, listed at the next hand-over
    charges = {c["run_id"]: c for c in progress["charges"]}
    assert list(charges) == [f"{name}-s001-a1", f"{name}-s002-a1", f"{name}-s002-a2"], progress["charges"]
    failed = charges[f"{name}-s002-a1"]
    assert failed["wedged"] and "wedged" in failed["failed"] and failed["kaggle_end_seen"] > failed["pushed_at"]
    ledger = goodput.from_progress(progress)
    assert ledger.attempts[1].run_id == f"{name}-s002-a1" and ledger.totals["failed attempt"] > 0, ledger.table()


def test_on_wedged_wait_tells_and_waits_for_kaggle_and_relay_status_says_so(relay_env, reference):
    from relay.orchestrator import status

    emu = relay_env.start(faults=WEDGED_SECOND)
    name = "wedge-wait"
    spec = _relay_spec(relay_env, name, "wait")
    reference.start(spec)
    flow = relay_env.flow_process()
    _second_session_past_its_deadline(relay_env, emu, flow)
    wait_for(lambda: "kaggle.on_wedged: wait" in _log(relay_env) or flow.poll() is not None, 300,
             "the relay noticing the wedge")
    lines = []
    status.report(str(spec), relay_env.backend, out_dir=relay_env.root / "status", emit=lines.append)
    (nxt,) = [line for line in lines if line.startswith("next:")]
    assert nxt.startswith(f"next: wait {name}-s002-a1 (session 2 ({name}-s002-a1) is still reported running"), lines
    assert nxt.endswith("wedged; kaggle.on_wedged: wait: waiting for Kaggle to end it)"), lines
    assert "deleted_kernels" not in emu.store.data and relay_env.kernel_runs()[-1].status == "RUNNING"
    assert _told(name) == [f"wedged-{name}-s002-a1"]

    emu.faults.wedge["calls"] = 1  # Kaggle ends the wedge: one more status call answers RUNNING, then COMPLETE
    assert flow.wait(600) == 0, _log(relay_env)
    log = _log(relay_env)
    assert _summary(log)["state"] == "done"
    assert len([line for line in log.splitlines() if "kaggle.on_wedged: wait" in line and "WARNING" in line]) == 1
    runs = relay_env.kernel_runs()
    assert [r.run_id for r in runs] == [f"{name}-s00{i}-a1" for i in (1, 2)]  # nothing deleted or redone
    assert all(r.status == "COMPLETE" for r in runs)
    assert relay_env.published_progress()["weights_sha256"] == reference.weights(spec)


def _log(env, name: str = "flow.log") -> str:
    path = env.root / name
    return path.read_text() if path.exists() else "(no log)"


def test_a_session_queued_longer_than_the_grace_is_judged_by_its_own_lines():
    """The deadline counts from the push, plus startup_overhead for the queue; a session that waited longer in
    Kaggle's queue says in its lines when its clock started (a line's time + time left - its budget), and is
    wedged only past that start + the timeout it asked for + the grace. One that printed its end is done,
    whatever Kaggle reports; one with no timed line cannot say."""
    plan = {"budget": 3600.0, "timeout_s": 3700.0}
    started = 10_000.0  # queued 20 min after a push at 8_800
    lines = [{"kind": "train", "step": 5, "time": started + 600, "time_left_s": 3000.0}]
    assert handoff.deadline_from_lines(lines, plan, grace_s=120) == started + 3700 + 120
    assert handoff.deadline_from_lines(lines + [{"kind": "end", "step": 9, "time": started + 3590}], plan, 120) is None
    assert handoff.deadline_from_lines([{"kind": "train", "step": 5}], plan, 120) is None
    assert handoff.deadline_from_lines(lines, {"timeout_s": 3700.0}, 120) is None


def _queued_source(run_id: str, line: dict | None) -> str:
    """A relay-like kernel pushed 10 000 s ago (its plan says so) that asked Kaggle for 3700 s: past the deadline
    from its push. It prints `line` (a progress line, if any) and stays running."""
    plan = {"run_id": run_id, "pushed_at": time.time() - 10_000, "timeout_s": 3700.0, "budget": 3600.0}
    printed = "" if line is None else (
        f"line = {json.dumps(line)}\nline.update(time=time.time())\n"
        "print('relay-progress ' + json.dumps(line), flush=True)\n"
        "for i in range(20):\n    print('.' * 100, flush=True)  # the reader's 512-byte chunk full: the line is read at once\n")
    return (f"# relay-run-id: {run_id}\nPLAN = {json.dumps(plan)!r}\nimport json, time\n{printed}"
            "open('started.txt', 'w').write('yes')\ntime.sleep(120)\n")


@pytest.mark.parametrize("queued", [True, False], ids=["its-lines-say-it-started-late", "no-timed-line"])
def test_observe_judges_a_long_queued_session_by_its_lines_for_the_flow_status_and_stop_alike(make_emulator,
                                                                                               tmp_path, queued):
    """handoff.observe itself reads the lines (the flow, `relay status` and `relay stop --now` all observe): a
    session whose lines say its clock started late is running until that start + its timeout + the grace; one
    that cannot say is wedged at the deadline from its push."""
    emu = make_emulator()
    backend = backend_for(emu)
    names = chain.Names(USER, "queued")
    run_id = "queued-s001-a1"
    line = {"run_id": run_id, "kind": "train", "session": 1, "step": 5, "time_left_s": 3500.0}
    push_script(backend, names.kernel, _queued_source(run_id, line if queued else None), gpu=False, timeout_s=3700)
    try:
        working = emu.store.kernel_dir(names.kernel, 1) / "working"
        _until(lambda: (working / "started.txt").is_file(), 60, "the kernel's start")
        obs = handoff.observe(backend, names, tmp_path, grace_s=1.0)
        assert obs.kernel_state == "running" and obs.kernel_run == run_id
        action = chain.decide("queued", obs)
        if queued:  # started ~100 s before its line (3600 budget - 3500 left): wedged only an hour from now
            assert 3400 < obs.deadline - time.time() < 3700, obs.deadline - time.time()
            assert action.do is Do.WAIT, action
        else:
            assert obs.deadline < time.time() and action.do is Do.WEDGED, (obs, action)
    finally:
        backend.delete_kernel(names.kernel)
