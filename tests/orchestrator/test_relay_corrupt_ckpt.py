"""A corrupt or partial checkpoint version (issue 20, part 2): storage fails after the handoff confirmed the
upload. The next session must refuse to start over at step 0, in one line; the relay then republishes the
newest version that still verifies and goes on, or stops naming the bad version when none does.

The damage is done to the emulator's stored files of a version the test holds unprocessed (not READY), so no
kernel can mount it before it is damaged: triggered by the version's creation, never by a sleep.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from relay_fixtures import (STEPS_PER_SESSION, DatasetProcessing, clean_env, wait_for, warm_python,  # noqa: E402
                            write_spec)

SESSIONS = 3
MAX_STEPS = SESSIONS * STEPS_PER_SESSION


def flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 16] = bytes(b ^ 0xFF for b in data[middle:middle + 16])
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _train(tmp_path: Path, spec: Path, workdir: Path, *extra: str) -> subprocess.CompletedProcess:
    python, env = warm_python(clean_env(HOME=str(tmp_path), TMPDIR=str(tmp_path)))
    return subprocess.run([python, "-m", "relay", "train", str(spec), "--workdir", str(workdir), *extra],
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("damage, why", [(flip_bytes, "state.pt crc32 mismatch"),
                                         (truncate, "bytes, its manifest says")])
def test_session_refuses_to_start_over_from_a_corrupt_mount(tmp_path, damage, why, spawns_processes):
    spec = write_spec(tmp_path / "spec", **{"optim.max_steps": 40, "session.max_steps": 20})
    first = _train(tmp_path, spec, tmp_path / "first")
    assert first.returncode == 0, first.stderr[-3000:]
    newest = sorted((tmp_path / "first" / "checkpoints").glob("step-*"))[-1]
    mount = tmp_path / "input" / "toy-relay-ckpt"
    shutil.copytree(newest, mount)
    damage(mount / "state.pt")

    second = _train(tmp_path, spec, tmp_path / "second", "--resume-from", str(mount))
    lines = (second.stdout + second.stderr).strip().splitlines()
    assert second.returncode == 2, second.stderr[-3000:]
    assert lines[-1].startswith(f"relay: error: the mounted checkpoint {mount} is corrupt: ") and why in lines[-1]
    assert not (tmp_path / "second").exists()  # no step-0 checkpoint, no workdir: it did not train


def _hold_and_damage(relay_env, processing, version: int, damage) -> None:
    """Wait for checkpoint version `version` (held unprocessed), damage its state.pt, then let Kaggle serve it."""
    wait_for(lambda: len(relay_env.ckpt_versions()) >= version, 300, f"checkpoint version {version}")
    damage(relay_env.emu.store.dataset_dir(relay_env.ckpt, version) / "state.pt")
    processing.held.discard((relay_env.ckpt, version))


# each flow recovers, each damage is recovered from (both damages are refused alike by the session, above)
@pytest.mark.parametrize("both_flows, damage", [("relay", flip_bytes), ("relays", truncate)],
                         indirect=["both_flows"])
def test_relay_recovers_from_a_bad_newest_checkpoint_version(relay_env, both_flows, reference, damage):
    emu = relay_env.start(dataset_processing_delay=3600)
    # the five checkpoint versions this relay publishes are all kept (kaggle.checkpoint_versions, default 4, would
    # delete the older ones at the fifth): the test reads each
    spec = relay_env.write_spec(**{"optim.max_steps": MAX_STEPS, "kaggle.checkpoint_versions": 5})
    reference.start(spec)
    processing = DatasetProcessing(emu)
    processing.held.add((relay_env.ckpt, 2))
    processing.start()
    flow = relay_env.flow_process()
    _hold_and_damage(relay_env, processing, 2, damage)
    assert flow.wait(600) == 0, _log(relay_env)
    processing.done.set()

    # one start-up lost (s003-a1 mounted the bad v2 and stopped at once); session 2, whose only copy was the
    # bad version, runs again from the restored v1; then the relay finishes
    runs = relay_env.kernel_runs()
    assert [r.run_id for r in runs] == ["toy-relay-s001-a1", "toy-relay-s002-a1", "toy-relay-s003-a1",
                                        "toy-relay-s002-a2", "toy-relay-s003-a1"], runs
    assert [r.status for r in runs].count("ERROR") == 1 and runs[2].status == "ERROR", runs
    log = _log(relay_env, 10 ** 7)
    assert f"checkpoint {relay_env.ckpt} v2 is corrupt" in log and "republished v1" in log, log[-4000:]
    published = [json.loads((emu.store.dataset_dir(relay_env.ckpt, v["number"]) / "progress.json").read_text())
                 for v in relay_env.ckpt_versions()]
    assert [p["global_step"] for p in published] == [150, 300, 150, 300, 450]
    assert published[2]["restored"]["bad_version"] == 2 and published[2]["restored"]["from_version"] == 1
    assert published[-1]["status"] == "done" and published[-1]["weights_sha256"] == reference.weights(spec)


def test_relay_stops_naming_the_version_when_none_verifies(relay_env):
    emu = relay_env.start(dataset_processing_delay=3600)
    relay_env.write_spec(**{"optim.max_steps": MAX_STEPS})
    processing = DatasetProcessing(emu)
    processing.held.add((relay_env.ckpt, 1))
    processing.start()
    flow = relay_env.flow_process()
    _hold_and_damage(relay_env, processing, 1, flip_bytes)
    assert flow.wait(600) != 0, _log(relay_env)
    processing.done.set()
    log = _log(relay_env, 10 ** 7)
    assert f"checkpoint {relay_env.ckpt} v1 is corrupt (the mounted checkpoint" in log, log[-4000:]
    assert "no earlier version verifies" in log and "Way out" in log
    assert [r.run_id for r in relay_env.kernel_runs()] == ["toy-relay-s001-a1", "toy-relay-s002-a1"]
    assert len(relay_env.ckpt_versions()) == 1  # nothing republished


def _log(env, tail: int = 6000) -> str:
    path = env.root / "flow.log"
    return path.read_text()[-tail:] if path.exists() else "(no log)"
