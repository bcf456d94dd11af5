"""The selective, streamed handoff on the emulator: it downloads only the newest valid checkpoint (per its
manifest), progress.json and metrics.jsonl; a checkpoint whose bytes fail the manifest is rejected while it
arrives and an older one is handed over instead; a short disk fails the tick with one line and nothing written;
and the relay still ends with the weights of an uninterrupted run."""
from __future__ import annotations

import json
import shutil
from collections import namedtuple

import pytest

from relay_fixtures import STEPS_PER_SESSION, wait_for  # noqa: E402

MAX_STEPS = 2 * STEPS_PER_SESSION


def _inject_corrupt_newer_checkpoint(emu, kernel: str, version: int) -> str:
    """Beside the kernel's real newest checkpoint, a "newer" one whose manifest is valid but whose state.pt
    has one flipped byte (same size): only a digest check while it arrives can tell. Deterministic, unlike
    relying on the session having saved twice."""
    root = emu.store.kernel_dir(kernel, version) / "working" / "relay" / "checkpoints"
    newest = max(p for p in root.iterdir() if p.name.startswith("step-"))
    fake = root / f"step-{STEPS_PER_SESSION + 1:08d}"
    shutil.copytree(newest, fake)
    manifest = json.loads((fake / "manifest.json").read_text())
    manifest["step"] = STEPS_PER_SESSION + 1
    (fake / "manifest.json").write_text(json.dumps(manifest))
    data = bytearray((fake / "state.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (fake / "state.pt").write_bytes(bytes(data))
    return fake.name


def test_selective_handoff_verifies_checks_disk_and_resumes_exactly(relay_env, reference, monkeypatch):
    from relay.orchestrator import chain, handoff
    from relay.orchestrator.kaggle import selective_output
    from relay.shared import spec as spec_mod

    relay_env.start()
    spec_path = relay_env.write_spec(**{"optim.max_steps": MAX_STEPS})
    reference.start(spec_path)
    assert relay_env.run_flow(monkeypatch, mode="tick")["state"] == "pushed"
    wait_for(lambda: relay_env.kernel_runs()[-1].status == "COMPLETE", 300, "session 1 to complete", 0.2)
    fake = _inject_corrupt_newer_checkpoint(relay_env.emu, relay_env.kernel, relay_env.kernel_runs()[-1].version)

    backend = relay_env.backend()
    spec = spec_mod.load(spec_path)
    names = chain.Names(backend.username, spec.name)
    local = relay_env.root / "orchestrator"
    obs = handoff.observe(backend, names, local)
    action = chain.decide(spec.name, obs)
    assert action.do is chain.Do.HARVEST

    # 1. a short disk (disk_usage monkeypatched: 10 MB free, less than the reserve alone): one line, no
    #    version, no scratch left; the flow's hand-over task is not retried (one disk check)
    checks = []
    Usage = namedtuple("Usage", "total used free")

    def short_disk(path):
        checks.append(path)
        return Usage(10 << 20, 0, 10 << 20)

    monkeypatch.setattr(selective_output, "disk_usage", short_disk)
    with pytest.raises(selective_output.DiskSpaceError) as short:
        relay_env.run_flow(monkeypatch, mode="tick")
    message = str(short.value)
    assert "\n" not in message and "needs" in message and "10.49 MB is free" in message, message
    assert len(checks) == 1, checks
    assert relay_env.ckpt_versions() == []
    assert not (local / "handoff").exists() or not any((local / "handoff").iterdir())
    monkeypatch.undo()

    # 2. enough disk: only the valid newest checkpoint's files come down; the corrupt "newer" one is rejected
    #    as it arrives (its bytes are fetched, then discarded) and nothing else of the output is read
    fetched = []
    real = selective_output.stream_verified

    def spy(client, url, target, *args, **kwargs):
        fetched.append(url.split("/v1/", 1)[1].split("?", 1)[0])
        return real(client, url, target, *args, **kwargs)

    monkeypatch.setattr(selective_output, "stream_verified", spy)
    result = handoff.hand_over(backend, spec, names, action, obs, local)
    monkeypatch.undo()
    assert result.ok and result.step == STEPS_PER_SESSION, result
    big = [f for f in fetched if f.endswith("state.pt")]
    assert big == [f"relay/checkpoints/{fake}/state.pt", f"relay/checkpoints/step-{STEPS_PER_SESSION:08d}/state.pt"], fetched
    assert not any("/cache/" in f or "/export/" in f for f in fetched), fetched
    assert not (local / "handoff" / action.run_id).exists()  # deleted once the version was confirmed
    published = relay_env.published_progress()
    assert published["global_step"] == STEPS_PER_SESSION and published["checkpoint"] == "."

    # 3. the relay goes on from there to the weights of an uninterrupted run
    watched = relay_env.run_flow(monkeypatch, mode="watch")
    assert watched["state"] == "done" and watched["step"] == MAX_STEPS, watched
    assert watched["weights_sha256"] == reference.weights(spec_path)
