"""What a relay leaves in Prefect is bounded by its events, not by how long its sessions run: a session three times
longer than another (by its steps, and slowed per step so it also runs longer) makes the same number of task runs,
log lines and artifact versions, read from the Prefect API of the real server the flow ran against. And the
progress key's latest version is the newest state: the second session (after a hand-over wrote the progress)
is held at a step until the test reads that step there (an event, not a sleep)."""
from __future__ import annotations

import re
import time

import yaml

from kaggle_fixtures import KERNEL_ENV

NAME = "bounded-view"
# session 1 runs steps 0 -> 30 (its step cap), session 2 30 -> 40 (the run's end): a third as many steps. Session 2
# is held after its last step: a hold mid-session would rightly be reported as a slow session (an early warning)
HOLD_AT = 40
TEMPLATE = '''
import os, time, torch, relay
session = relay.open_session()
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
session.register(model=model, optimizer=opt)
session.restore()
x = torch.ones(8, 4)
for idx in session.batches(64, 8):
    loss = model(x).pow(2).mean()  # falls step by step: no early warning that one session has and the other not
    opt.zero_grad(); loss.backward(); opt.step()
    time.sleep(0.05)  # longer in wall time too; nothing below depends on it
    session.step_done(loss=loss.detach())
    if session.step == %d:  # held here until the test read this step in the progress key's latest version
        while not os.path.exists(os.path.join(os.environ["KAGGLE_WORKING_DIR"], "release")):
            time.sleep(0.05)
session.close()
'''
SCRIPT = TEMPLATE % HOLD_AT


def _read_run(spec: str):
    """The flow run of `spec`, its task runs, logs and artifacts, from the Prefect server's API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter,
                                                FlowRunFilterId, LogFilter, LogFilterFlowRunId)

    with get_client(sync_client=True) as client:
        run = next(r for r in client.read_flow_runs() if r.parameters.get("spec") == spec)
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])), limit=200)
        found = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(
            any_=[run.id])))
    return run, tasks, logs, found


def test_a_three_times_longer_session_leaves_as_much_in_prefect_and_the_newest_progress_is_shown(
        relay_env, monkeypatch):
    from prefect.artifacts import Artifact

    relay_env.start(kernel_env={**KERNEL_ENV, "RELAY_PROGRESS_EVERY": "0"})  # a progress line every step
    flow, result = relay_env.flow_thread(monkeypatch, "bounded", SCRIPT, {
        "name": NAME, "optim": {"max_steps": 40, "log_every_steps": 1},
        "session": {"threads": 1, "max_steps": 30, "safety_margin": "0.5s"},
        "kaggle": {"session_timeout": "10m", "startup_overhead": "1s"}}, poll_seconds=0.2, live_seconds=0.2)
    spec = relay_env.spec

    deadline, seen = time.monotonic() + 300, None  # a hang guard: the test proceeds on what it reads
    while time.monotonic() < deadline and flow.is_alive():
        seen = Artifact.get(f"{NAME}-progress")
        if seen is not None and f"step {HOLD_AT} of 40; session 2 ({NAME}-s002-a1)" in (seen.description or ""):
            break
        time.sleep(0.2)
    assert seen is not None and f"step {HOLD_AT} of 40; session 2 ({NAME}-s002-a1): 10 steps, running" \
        in seen.description, seen
    assert seen.data == 100.0 * HOLD_AT / 40
    kernel = relay_env.kernel_runs()[-1]
    (relay_env.emu.store.kernel_dir(relay_env.kernel, kernel.version) / "working" / "release").write_text("")
    flow.join(300)
    assert result.get("state") == "done" and result.get("step") == 40, result

    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=30)  # the flow's logs reach the server in batches
    # task runs reach the server as events, recorded in the background: read until the last hand-over's is there
    # and every task run's start is (a busy SQLite server records a run before its Running state)
    deadline = time.monotonic() + 120  # a hang guard, not a speed bound
    while True:
        run, tasks, logs, found = _read_run(str(spec))
        if (sum(t.name.startswith("hand-over") and t.end_time is not None for t in tasks) >= 2
                and all(t.start_time is not None for t in tasks)) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    pushes = sorted((t for t in tasks if t.name.startswith("push-session")), key=lambda t: t.start_time)
    hand_overs = sorted((t for t in tasks if t.name.startswith("hand-over")), key=lambda t: t.start_time)
    assert len(pushes) == len(hand_overs) == 2, [t.name for t in tasks]
    windows = [(p.start_time, h.end_time) for p, h in zip(pushes, hand_overs)]  # push to hand-over, per session

    task_names = [[t.name for t in tasks if start <= t.start_time <= end] for start, end in windows]
    assert [len(n) for n in task_names] == [5, 5], task_names  # push, observe, follow, observe, hand-over
    assert [sum(n.startswith("follow ") for n in names) for names in task_names] == [1, 1], task_names
    lines = [[log.message for log in logs if start <= log.timestamp <= end] for start, end in windows]
    assert len(lines[0]) == len(lines[1]), "\n".join(f"session {i + 1}: {m[:80]}"
                                                  for i, ls in enumerate(lines) for m in ls)
    steps = [[m for m in session if " step " in m and " of 40" in m] for session in lines]
    assert len(steps[0]) == len(steps[1]) == 10, steps  # the first line within each tenth of the session
    assert not any("Finished in state" in m for m in steps[0] + steps[1])
    # one summary and one session table in the flow run, updated in place at each event (issue 47: a 4-session
    # run made 35 cards of them)
    versioned = sorted(a.key for a in found if a.key in (f"{NAME}-summary", f"{NAME}-sessions"))
    assert versioned == [f"{NAME}-sessions", f"{NAME}-summary"], versioned
    assert [a.key for a in found].count(f"{NAME}-progress") == 1  # one, updated in place through both sessions
    assert run.name == f"{NAME}: done at step 40" and {f"relay:{NAME}", "kaggle:alice"} <= set(run.tags), run
    summary = Artifact.get(f"{NAME}-summary").data
    assert f"on the local Kaggle emulator at {relay_env.emu.url}" in summary and f"`alice/{NAME}-model`" in summary
    final = Artifact.get(f"{NAME}-progress")
    assert "step 40 of 40" in final.description and final.data == 100.0


def test_ticks_that_find_a_session_as_it_was_add_nothing_and_share_one_progress_artifact(relay_env, monkeypatch):
    """A schedule ticks a relay every few minutes for days: each tick is a flow run of its own, and a tick that
    finds the running session where the last tick left it adds no log line, no summary or table version and no
    progress version (the progress artifact is the first tick's, updated in place)."""
    import flows.one_relay as one_relay
    import tasks.relay_host as relay_host
    from prefect.artifacts import Artifact

    name, hold_at = "ticked-view", 20  # one session of 40 steps, held at step 20 until the test lets it go
    relay_env.start(kernel_env={**KERNEL_ENV, "RELAY_PROGRESS_EVERY": "0"})
    code = relay_env.root / "ticked"
    code.mkdir()
    (code / "train.py").write_text(TEMPLATE % hold_at)
    spec = relay_env.spec = code / "spec.yaml"
    spec.write_text(yaml.safe_dump({"name": name, "code": {"folder": ".", "entry": "train.py"},
                                    "optim": {"max_steps": 40, "log_every_steps": 1},
                                    "session": {"threads": 1, "safety_margin": "0.5s"},
                                    "kaggle": {"session_timeout": "10m", "startup_overhead": "1s"}}))
    monkeypatch.setattr(relay_host, "make_backend", lambda credentials_block=None: relay_env.backend())

    def tick() -> dict:
        return one_relay.relay(spec=str(spec), mode="tick", poll_seconds=0.2, tick_follow_seconds=0.5,
                               state_dir=str(relay_env.root / "orch"), step_lock_wait_s=0)

    # The ticks go on until two in a row show the held session at the same step. The stream may keep its newest
    # line or two back while the session is silent (seen: step 19 of a hold at 20 for minutes under load); any
    # step from 17 to 20 is in the same tenth and quarter of the session, so what a later tick may yet read
    # adds no line or version either.
    deadline, states, shown = time.monotonic() + 300, [], []  # a hang guard
    while time.monotonic() < deadline:
        states.append(tick()["state"])
        seen = Artifact.get(f"{name}-progress")
        found = re.search(r"step (\d+) of 40", (seen.description or "") if seen is not None else "")
        shown.append(int(found.group(1)) if found else None)
        if shown[-1] is not None and shown[-1] >= hold_at - 3 and shown[-2:] == [shown[-1]] * 2:
            break
    assert shown and shown[-1] is not None and shown[-1] >= hold_at - 3 and shown[-2:] == [shown[-1]] * 2, \
        (states, shown)
    before = _left_by(name)
    for _ in range(3):  # three ticks that find the session held where the last one left it
        assert tick()["state"] == "running"
    assert _left_by(name) == before, (before, _left_by(name))

    (relay_env.emu.store.kernel_dir(relay_env.kernel, 1) / "working" / "release").write_text("")
    while time.monotonic() < deadline:
        summary = tick()
        if summary["state"] == "done":
            break
    assert summary["state"] == "done" and summary["step"] == 40, summary
    after = _left_by(name)
    assert after["progress"] == 1, after  # the first tick's, through every tick and the hand-over
    assert 1 <= after["step lines"] <= 10 and after["summary"] <= 4 + 1, after  # as a watch would: a tenth, a
    final = Artifact.get(f"{name}-progress")                                   # quarter, and the hand-over's
    assert "step 40 of 40" in final.description and final.data == 100.0


def _left_by(name: str) -> dict:
    """What the relay's flow runs left on the server: versions per artifact key, and the flow log's step lines."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterTags,
                                                LogFilter, LogFilterFlowRunId)
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=30)  # the flow's logs reach the server in batches
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(
            any_=[f"{name}-{what}" for what in ("progress", "summary", "sessions")])))
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"relay:{name}"])))
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[r.id for r in runs])),
                                limit=200)
    counts = {what: sum(a.key == f"{name}-{what}" for a in found) for what in ("progress", "summary", "sessions")}
    counts["step lines"] = sum(" step " in log.message and " of 40" in log.message for log in logs)
    return counts
