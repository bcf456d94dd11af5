"""Status lag after a push: for a while Kaggle's "latest" status and output still answer the previous version
(docs/kaggle.md, "Platform traps the relay handles"). A relay reading them would harvest the previous run's
files, call them stale, and push the same session again while the first push is still queued: the same work
twice, on quota. The relay pins every observation to the version it pushed (versionLabel "v<N>").

The emulator's `status_lag` fault here lags by call count, not by seconds, so it bites on any machine: every
unpinned status/output call after a push answers the previous version. Orchestrator kills are triggered by
events (a new kernel version appeared, a checkpoint version was created), never by sleeps. This relay also mounts in Kaggle's nested layout
(`datasets/<owner>/<slug>`), so the kernel's mount search is exercised end to end.
"""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from relay.orchestrator.kaggle.types import KernelState

from relay_fixtures import STEPS_PER_SESSION, DatasetProcessing, wait_for  # noqa: E402

SESSIONS = 3
MAX_STEPS = SESSIONS * STEPS_PER_SESSION
LAG = {"calls": 10 ** 9}  # unpinned status/output never see the newest version
# the second SaveKernel call is refused the way Kaggle refuses (HTTP 200, versionNumber 0, an error)
# (GetKernel: counted, never failed, so the test can see an orchestrator's first observation)
FAULTS = {"seed": 11, "status_lag": LAG,
          "methods": {"SaveKernel": {"script": ["ok", "refused"]}, "GetKernel": {"rate": 0}}}


def test_relay_under_status_lag_pushes_each_session_once_through_orchestrator_kills(relay_env, both_flows, reference):
    emu = relay_env.start(faults=FAULTS, mount_layout="nested", dataset_processing_delay=3600)
    spec = relay_env.write_spec(**{"optim.max_steps": MAX_STEPS})
    processing = DatasetProcessing(emu)
    processing.held.add((relay_env.ckpt, 3))
    processing.start()
    reference.start(spec)
    backend = relay_env.backend()

    # 1. the orchestrator dies right after pushing session 2, while Kaggle's latest status still shows session
    #    1's final state; 2. a second one takes over and dies right after pushing session 3; 3. a third finishes
    for index, pushed in enumerate((2, 3), start=1):
        flow = relay_env.flow_process(log_name=f"flow-{index}.log")
        wait_for(lambda: len(relay_env.kernel_runs()) >= pushed or flow.poll() is not None, 300,
                 f"the push of session {pushed}")
        os.killpg(flow.pid, signal.SIGKILL)
        assert flow.wait() == -signal.SIGKILL, _log(relay_env, f"flow-{index}.log")
        # the lag is real: unpinned, Kaggle answers for the previous version, which has finished
        lagged = backend.kernel_status(relay_env.kernel)
        assert lagged.state is KernelState.COMPLETE, lagged
        assert relay_env.kernel_runs()[-1].run_id == f"toy-relay-s{pushed:03d}-a1"
    # 3. a third one dies mid-publish: the checkpoint dataset version of session 3 is created but Kaggle is
    #    slow to process it (it stays unconfirmed) when the orchestrator is killed
    third = relay_env.flow_process(log_name="flow-3.log")
    created = wait_for(lambda: (relay_env.ckpt_versions()[2:] or None) or third.poll() is not None, 300,
                       "the checkpoint version of session 3")
    os.killpg(third.pid, signal.SIGKILL)
    assert third.wait() == -signal.SIGKILL and created[0]["number"] == 3, _log(relay_env, "flow-3.log")

    # 4. a fourth one still sees session 2 as the published one and Kaggle's latest status still lags; it
    #    hands session 3 over again, finds the version already created, and finishes
    get_kernel_calls = emu.faults._counts["GetKernel"]
    last = relay_env.flow_process(log_name="flow-4.log")
    wait_for(lambda: emu.faults._counts["GetKernel"] > get_kernel_calls or last.poll() is not None, 120,
             "the fourth orchestrator's first observation")
    processing.held.clear()
    assert last.wait(300) == 0, _log(relay_env, "flow-4.log")
    processing.done.set()
    summary = json.loads(_log(relay_env, "flow-4.log").split("RELAY-SUMMARY ", 1)[1].splitlines()[0])
    assert summary["state"] == "done" and summary["step"] == MAX_STEPS

    # each session pushed exactly once (no retry attempt, no duplicate), every version ran to completion
    runs = relay_env.kernel_runs()
    assert [r.run_id for r in runs] == [f"toy-relay-s{i:03d}-a1" for i in range(1, SESSIONS + 1)], runs
    assert all(r.status == "COMPLETE" for r in runs), runs
    # no version was pushed while an earlier one could still run
    for earlier, later in zip(runs, runs[1:]):
        assert earlier.ended is not None and later.pushed >= earlier.ended, (earlier, later)
    assert emu.faults.injected["refused"] == 1 and emu.faults.injected["status_lag"] >= 2
    logs = "".join(_log(relay_env, f"flow-{i}.log", 10 ** 7) for i in (1, 2, 3, 4))
    assert "push refused (other): Notebook push failed" in logs
    assert "stale output" not in logs

    # each session handed over once, in the nested mount layout, ending with the uninterrupted run's weights
    published = [json.loads((emu.store.dataset_dir(relay_env.ckpt, v["number"]) / "progress.json").read_text())
                 for v in relay_env.ckpt_versions()]
    assert [p["run_id"] for p in published] == [r.run_id for r in runs]  # session 3 not published twice
    assert (emu.store.kernel_dir(relay_env.kernel, 2) / "input" / "datasets" / "alice" / "toy-relay-ckpt").is_dir()
    assert [s["step_start"] for s in published[-1]["sessions"]] == [0, STEPS_PER_SESSION, 2 * STEPS_PER_SESSION]
    assert summary["weights_sha256"] == published[-1]["weights_sha256"] == reference.weights(spec)


def _log(env, name: str, tail: int = 6000) -> str:
    path: Path = env.root / name
    return path.read_text()[-tail:] if path.exists() else "(no log)"
