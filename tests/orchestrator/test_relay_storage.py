"""A relay's storage on Kaggle is bounded and said (docs/kaggle.md, "Where the emulator holds to Kaggle"): a private
account's datasets count every version against a quota, past it a create is answered with success and the dataset
then 404s (kaggle-cli #284). The relay keeps at most kaggle.checkpoint_versions checkpoint versions (the publish that
would keep one more deletes the older ones: delete_old_versions, Kaggle having no per-version delete). Real `kaggle`
client, real Prefect flow, sessions running `relay train`; the quota is set from the checkpoint's size, measured on
the reference run, never from time."""
from __future__ import annotations

import json

from relay_fixtures import STEPS_PER_SESSION, USER  # noqa: F401

SESSIONS = 4


def _newest_checkpoint_bytes(reference, spec) -> int:
    reference.weights(spec)  # the reference run has ended
    _, workdir = reference.runs[reference.start(spec)]
    folders = sorted((p for p in (workdir / "run" / "checkpoints").iterdir() if p.is_dir()), key=lambda p: p.name)
    return sum(f.stat().st_size for f in folders[-1].rglob("*") if f.is_file())


def test_a_relay_under_a_storage_quota_unbounded_growth_would_overflow_ends_exact_with_its_storage_bounded(
        relay_env, reference):
    relay_env.start()
    spec = relay_env.write_spec(**{"optim.max_steps": SESSIONS * STEPS_PER_SESSION, "kaggle.checkpoint_versions": 1})
    reference.start(spec)
    checkpoint = _newest_checkpoint_bytes(reference, spec)
    # kept: 1 version at rest, 2 while the next is made (the quota is checked before the old one goes), and the
    # final model; every version kept would need SESSIONS checkpoints: more than the quota
    quota = 3 * checkpoint
    relay_env.emu.config.private_storage_bytes = quota
    flow = relay_env.flow_process()
    assert flow.wait(600) == 0, (relay_env.root / "flow.log").read_text()[-4000:]
    log = (relay_env.root / "flow.log").read_text()
    summary = json.loads(log.split("RELAY-SUMMARY ", 1)[1].splitlines()[0])
    assert summary["state"] == "done" and summary["step"] == SESSIONS * STEPS_PER_SESSION, summary

    emu = relay_env.emu
    runs = relay_env.kernel_runs()
    assert [r.run_id for r in runs] == [f"toy-relay-s00{n}-a1" for n in range(1, SESSIONS + 1)]  # none pushed twice
    versions = relay_env.ckpt_versions()
    assert [v["number"] for v in versions] == [SESSIONS]  # the older versions were deleted as the newest was made
    published = [sum(size for _, size in v["files"]) for v in versions]
    assert SESSIONS * published[0] > quota  # unbounded growth would not have fit
    assert emu.store.private_bytes(USER) <= quota
    # what the relay stores, in its summary and its log: the stated bound (1 checkpoint version) and the final model
    stored = summary["stored"]
    assert stored["datasets"][relay_env.ckpt] == {"versions": 1, "bytes": published[0]}, stored
    assert stored["versions"] == 2 and stored["bytes"] <= quota, stored
    assert "stored on Kaggle: 2 dataset version(s)" in log and "checkpoint versions kept at most 1" in log
    # and `relay status` says the same
    from relay.orchestrator import status

    lines = []
    status.report(str(spec), relay_env.backend, out_dir=relay_env.root / "status", emit=lines.append)
    (said,) = [line for line in lines if line.startswith("stored on Kaggle:")]
    assert said.startswith("stored on Kaggle: 2 dataset version(s)") and f"{relay_env.ckpt} 1 version(s)" in said
    assert said.endswith("checkpoint versions kept at most 1"), said
    progress = relay_env.published_progress()
    assert summary["weights_sha256"] == progress["weights_sha256"] == reference.weights(spec)
