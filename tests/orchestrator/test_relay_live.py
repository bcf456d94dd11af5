"""While a session runs, the Prefect UI shows it: the flow follows the session's log stream and keeps the run's
progress artifact (updated in place), the session table with a running row and the loss curve current. The
session is held at a step by the user's own script until the test has seen it (an event, not a sleep)."""
from __future__ import annotations

import json
import time

from byo_fixtures import tiny_session_script
from kaggle_fixtures import KERNEL_ENV

HOLD_AT = 15
SCRIPT = tiny_session_script(  # held until the test saw step HOLD_AT in Prefect: one step after it, where the
    # window of the log step HOLD_AT is judged and its line written (on CUDA its copy ran during that step)
    head="import os, time", lr=0.01, loss="model(torch.randn(8, 4)).pow(2).mean()", report_loss=True,
    after_step=f"while session.step == {HOLD_AT + 1} and not os.path.exists("
               "os.path.join(os.environ['KAGGLE_WORKING_DIR'], 'release')): time.sleep(0.05)")


def _artifact(key: str):
    from prefect.artifacts import Artifact

    return Artifact.get(key)


def test_the_running_session_shows_in_prefect_while_it_trains(relay_env, monkeypatch):

    relay_env.start(kernel_env={**KERNEL_ENV, "RELAY_PROGRESS_EVERY": "0"})
    flow, result = relay_env.flow_thread(monkeypatch, "live", SCRIPT, {
        "name": "live-relay", "optim": {"max_steps": 40, "log_every_steps": 5},
        "session": {"threads": 1, "max_steps": 20, "safety_margin": "0.5s"},
        "kaggle": {"session_timeout": "5m", "startup_overhead": "1s"}}, poll_seconds=0.3, live_seconds=0.5)

    deadline = time.monotonic() + 300  # a hang guard: the test proceeds on what it sees
    progress = table = None
    while time.monotonic() < deadline:
        progress, table = _artifact("live-relay-progress"), _artifact("live-relay-sessions")
        rows = (table.data if isinstance(table.data, list) else json.loads(table.data)) if table else [{}]
        if progress is not None and f"step {HOLD_AT} of 40" in (progress.description or "") \
                and rows[-1].get("steps") == HOLD_AT:  # the table is refreshed every 6 x live_seconds
            break
        time.sleep(0.2)
    assert progress is not None and f"step {HOLD_AT} of 40; session 1 (live-relay-s001-a1): {HOLD_AT} steps, running" \
        in progress.description, progress
    assert progress.data == 100.0 * HOLD_AT / 40
    assert rows[-1]["session"] == "1 (s001-a1)" and rows[-1]["ended"] == "running"
    assert rows[-1]["steps"] == HOLD_AT
    summary = _artifact("live-relay-summary")
    assert "session 1 running" in summary.data and "data:image/png;base64," in summary.data

    # `relay status NAME` shows the same running row, read from Kaggle's log stream
    from relay.orchestrator import status

    lines = []
    status.report("live-relay", relay_env.backend, relay_env.root / "status", emit=lines.append, follow_s=2)
    out = "\n".join(lines)
    assert "live-relay-s001-a1" in out and "running" in out and "kernel: alice/live-relay-session v1" in out, out
    # from the first session's progress lines (none handed over yet): its step and the run's total
    assert f"0 session(s) handed over, step 0/40; session 1 running at step {HOLD_AT}" in out, out
    assert "total_steps: unknown" not in out, out

    kernel = relay_env.kernel_runs()[-1]
    (relay_env.emu.store.kernel_dir(relay_env.kernel, kernel.version) / "working" / "release").write_text("")
    flow.join(300)
    assert result.get("state") == "done", result
