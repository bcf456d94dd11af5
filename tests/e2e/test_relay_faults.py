"""A relay under faults completes, pushes no session twice, publishes no checkpoint twice, and ends with the
weights of an uninterrupted run:

- >= 15 % of backend calls fail (the emulator's seeded injection: 429, 500, connection reset, response lost
  after the call was handled; uploads cut mid-file);
- one kernel is SIGKILLed in the middle of a checkpoint save (it stops itself inside the save at a set step,
  through the RELAY_TEST_STOP_MID_SAVE seam; the test checks the folder is still uncommitted and kills it:
  a torn save, for sure, whatever the machine's speed);
- the orchestrator (the flow, in a child process) is SIGKILLed twice: right after it pushed session 2, and
  mid-publish (the checkpoint dataset version it created is still processing, not yet confirmed READY).
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from byo_fixtures import EVERY_STEP  # noqa: E402
from process_fixtures import MidSaveKiller  # noqa: E402
from relay_fixtures import KERNEL_ENV, STEPS_PER_SESSION, wait_for  # noqa: E402

FAULT_RATE = 0.25
FAULTS = {"seed": 5, "methods": {"*": {"rate": FAULT_RATE}}, "upload_fail_midfile": 0.2}
MAX_STEPS = 3 * STEPS_PER_SESSION
STOP_MID_SAVE_AT = STEPS_PER_SESSION + 50  # inside session 2, after it committed saves of its own


def test_relay_completes_exactly_under_faults_kills_and_orchestrator_crashes(relay_env, both_flows, reference):
    emu = relay_env.start(faults=FAULTS, dataset_processing_delay=0.3,
                          kernel_env={**KERNEL_ENV, "RELAY_TEST_STOP_MID_SAVE": str(STOP_MID_SAVE_AT)})
    # a save at every step (save_every 1 ns, byo_fixtures.EVERY_STEP): session 2 commits saves below
    # STOP_MID_SAVE_AT however fast its steps run, so the kill is bound to a step, never to a timer
    spec = relay_env.write_spec(**{"optim.max_steps": MAX_STEPS, **EVERY_STEP})
    reference.start(spec)
    killer = MidSaveKiller(relay_env)
    killer.start()
    try:
        # 1. the orchestrator dies right after pushing session 2
        first = relay_env.flow_process(log_name="flow-1.log")
        wait_for(lambda: len(relay_env.kernel_runs()) >= 2 or first.poll() is not None, 300, "the push of session 2")
        os.killpg(first.pid, signal.SIGKILL)
        assert first.wait() == -signal.SIGKILL, _log(relay_env, "flow-1.log")
        assert relay_env.kernel_runs()[1].run_id == "toy-relay-s002-a1"

        # 2. a second orchestrator takes over; a session-2+ kernel is killed mid-save; the orchestrator
        #    salvages it and dies while the checkpoint dataset version it created is still processing
        second = relay_env.flow_process(log_name="flow-2.log")
        wait_for(lambda: killer.killed or killer.error or not killer.is_alive() or second.poll() is not None, 300,
                 "a kernel killed mid-save")
        assert killer.error is None and killer.killed, (killer.error, _log(relay_env, "flow-2.log"))
        versions_at_kill = len(relay_env.ckpt_versions())
        created = wait_for(lambda: (relay_env.ckpt_versions()[versions_at_kill:] or None)
                           or second.poll() is not None, 300, "the next checkpoint publication")
        with emu.store.lock:  # Kaggle is slow processing this version: it stays unconfirmed...
            version = emu.store.datasets[relay_env.ckpt]["versions"][versions_at_kill]
            version["ready_at"] = time.time() + 3600
        os.killpg(second.pid, signal.SIGKILL)  # ...when the orchestrator dies waiting for it
        assert second.wait() == -signal.SIGKILL, _log(relay_env, "flow-2.log")
        assert created[0]["number"] == versions_at_kill + 1

        # 3. a third orchestrator finishes the relay. Its first observation still shows the previous
        #    checkpoint as the published one (the new version is not READY), so it hands the same run over
        #    again: the publisher must find the version already created instead of making another one.
        get_kernel_calls = emu.faults._counts["GetKernel"]
        third = relay_env.flow_process(log_name="flow-3.log")
        wait_for(lambda: emu.faults._counts["GetKernel"] > get_kernel_calls or third.poll() is not None, 120,
                 "the third orchestrator's first observation")  # it reads the published progress first
        with emu.store.lock:
            version["ready_at"] = time.time()
            emu.store.save()
        assert third.wait(300) == 0, _log(relay_env, "flow-3.log")
        assert f"decide: salvage {killer.killed['run_id']}" in (relay_env.root / "flow-3.log").read_text()
    finally:
        killer.done.set()
        killer.join(5)

    log = _log(relay_env, "flow-3.log")
    summary = json.loads(log.split("RELAY-SUMMARY ", 1)[1].splitlines()[0])
    assert summary["state"] == "done" and summary["step"] == MAX_STEPS

    # the faults really happened: at least 15 % of all calls failed
    calls = sum(emu.faults._counts.values())
    failed = sum(emu.faults.injected.values())
    assert calls > 50 and failed / calls >= 0.15, (failed, calls, dict(emu.faults.injected))
    assert emu.faults.injected["lost"] > 0 and emu.faults.injected["upload_midfile"] > 0

    # the kill was mid-save: the torn folder is in the killed kernel's output, the relay salvaged or retried
    runs = relay_env.kernel_runs()
    killed = next(r for r in runs if r.version == killer.killed["version"])
    assert killed.status == "ERROR" and "-9" in killed.failure, killed
    working = emu.store.kernel_dir(relay_env.kernel, killed.version) / "working" / "relay" / "checkpoints"
    assert (working / killer.killed["torn"]).is_dir()

    # no session pushed twice: each run id is in exactly one kernel version; all but the killed one completed
    run_ids = [r.run_id for r in runs]
    assert len(set(run_ids)) == len(run_ids), run_ids
    assert all(r.status == "COMPLETE" for r in runs if r.version != killed.version), runs
    # no checkpoint published twice: each handed-over run is in exactly one checkpoint dataset version
    published = [json.loads((emu.store.dataset_dir(relay_env.ckpt, v["number"]) / "progress.json").read_text())
                 for v in relay_env.ckpt_versions()]
    published_runs = [p["run_id"] for p in published]
    assert len(set(published_runs)) == len(published_runs), published_runs
    assert [p["global_step"] for p in published] == sorted(p["global_step"] for p in published)
    assert published[-1]["status"] == "done" and published[-1]["run_id"] == run_ids[-1]

    # exact resume through all of it
    assert summary["weights_sha256"] == published[-1]["weights_sha256"] == reference.weights(spec)


def _log(env, name: str) -> str:
    path: Path = env.root / name
    return path.read_text()[-6000:] if path.exists() else "(no log)"
