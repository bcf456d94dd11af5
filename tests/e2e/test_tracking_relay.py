"""One TensorBoard log and one W&B run for a relay of many sessions (docs/tracking.md).

A toy relay of 300 steps in 100-step sessions (>= 3 sessions) on the emulator, tracking.tensorboard on and
tracking.wandb offline (WANDB_MODE=offline in the kernels: nothing reaches the network). Session 2 is SIGKILLed
inside a checkpoint save (the RELAY_TEST_STOP_MID_SAVE seam + tests/process_fixtures.MidSaveKiller: an event,
never a sleep), after it logged steps past its last committed checkpoint: those steps are trained, and logged,
again by session 3.
- TensorBoard: the log the orchestrator assembled, read back with TensorBoard's own EventAccumulator and raw
  event-file loader, has every logged step once, increasing, from the first log to the end, with the values of
  an uninterrupted `relay train` of the same spec, bit-equal (a resume inside a logging window included: the
  checkpoint carries the window's losses).
- W&B: what the orchestrator hands to `wandb sync` (a local stand-in records the call: no W&B server can be
  reached here, so the upload itself is NOT proven) is every session's offline run, all of one run id (the one
  in progress.json), their history rows (read with W&B's record protobuf) each step once after the cut, with
  the TensorBoard values; the API key comes from a Prefect Secret block into the sync's environment only and
  appears nowhere on the emulator (kernels, datasets, outputs).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")

from relay.orchestrator import tracking_handoff, wandb_file  # noqa: E402
from relay_fixtures import KERNEL_ENV  # noqa: E402
from process_fixtures import run_flow_with_a_kill_mid_save  # noqa: E402

PER_SESSION, TOTAL = 100, 300
KEY = "test-wandb-key-0123456789abcdef"


from tracking_fixtures import raw_steps, scalars  # noqa: E402


def test_relay_is_one_tensorboard_and_one_wandb_run_with_a_kill_after_a_periodic_save(
        relay_env, reference, monkeypatch, tmp_path):
    from prefect.blocks.system import Secret

    Secret(value=KEY).save("relay-wandb-test", overwrite=True)
    synced: list = []

    def stand_in(cmd, env):  # the W&B server cannot be reached: record the call, keep the files it names
        copies = []
        for run in (Path(a) for a in cmd if a.startswith("/") and Path(a).is_dir()):
            copies.append(tmp_path / "synced" / f"{len(synced)}-{run.name}")
            shutil.copytree(run, copies[-1])
        synced.append({"cmd": cmd, "key": env.get("WANDB_API_KEY"), "runs": copies})

    monkeypatch.setattr(tracking_handoff, "run_sync", stand_in)
    kill_at = PER_SESSION + PER_SESSION // 2  # the first save at step >= 150 in session 2: after its log at 150
    relay_env.start(kernel_env={**KERNEL_ENV, "RELAY_TEST_STOP_MID_SAVE": str(kill_at), "WANDB_MODE": "offline",
                                "WANDB_SILENT": "true"})
    spec = relay_env.write_spec(**{
        # a save at every step (save_every 1 ns: any step is longer): the kill's salvage is the step before the torn
        # save at 150, so the next session resumes inside a logging window (with a save every few steps it fell
        # on a multiple of 10 about one run in five)
        "optim.max_steps": TOTAL, "session.max_steps": PER_SESSION, "session.save_every": 1e-9,
        "tracking": {"tensorboard": True,
                     "wandb": {"project": "relay-test", "mode": "offline", "api_key_block": "relay-wandb-test"}}})
    reference.start(spec)
    summary, killer = run_flow_with_a_kill_mid_save(relay_env, monkeypatch)
    assert summary["state"] == "done" and summary["step"] == TOTAL, summary
    progress = relay_env.published_progress()
    assert len(progress["sessions"]) >= 3
    assert summary["weights_sha256"] == reference.weights(spec)

    # the killed session logged steps past the checkpoint it was salvaged at: they are trained again
    killed = relay_env.emu.store.kernel_dir(relay_env.kernel, killer.killed["version"]) / "working" / "relay"
    salvaged = next(s for s in progress["sessions"] if s["run_id"] == killer.killed["run_id"])["step_end"]
    assert max(raw_steps(killed / "tensorboard", "train/loss")) > salvaged

    # TensorBoard: the orchestrator's assembled log is one run, each step once, the uninterrupted run's values
    assembled = relay_env.root / "orchestrator" / relay_env.name / "tensorboard"
    ref_dir = next(w for _, w in reference.runs.values() if (w / "spec.yaml").read_bytes() == spec.read_bytes())
    got, want = scalars(assembled), scalars(ref_dir / "run" / "tensorboard")
    logged = list(range(10, TOTAL + 1, 10))
    assert [s for s, _ in got["train/loss"]] == logged == raw_steps(assembled, "train/loss")
    assert [s for s, _ in got["eval/loss"]] == [s for s, _ in want["eval/loss"]] == list(range(100, TOTAL + 1, 100))
    assert any(s["step_start"] % 10 for s in progress["sessions"])  # a resume inside a logging window: its
    for tag in ("train/loss", "train/lr", "eval/loss"):                 # mean is exact (the window is carried)
        assert got[tag] == want[tag], tag

    # W&B: one run id, each step once after the superseded rows are cut, the same values
    run_id = progress["tracking"]["wandb_run_id"]
    assert synced and all(c["key"] == KEY for c in synced)
    assert all(c["cmd"][c["cmd"].index("--id") + 1] == run_id for c in synced)
    files = [f for c in synced for run in c["runs"] for f in run.glob("run-*.wandb")]
    assert len(files) == len(progress["sessions"]) and {wandb_file.run_id(f) for f in files} == {run_id}
    rows = [(step, row) for f in files for step, row in wandb_file.history(f)]
    assert [s for s, r in rows if "train/loss" in r] == logged
    tb_loss = dict(got["train/loss"])
    assert all(abs(r["train/loss"] - tb_loss[s]) < 1e-6 for s, r in rows if "train/loss" in r)  # TB keeps float32

    # the key is nowhere on the emulator: kernels, datasets, outputs
    leaks = [p for p in relay_env.emu.store.root.rglob("*") if p.is_file() and KEY.encode() in p.read_bytes()]
    assert not leaks, leaks
