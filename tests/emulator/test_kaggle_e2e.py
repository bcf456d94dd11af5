"""The issue's "done when": a relay session kernel pushed by the backend to the emulator runs the tiny
price-model spec for one step-bounded session, its checkpoint comes back and is published as a new dataset
version, and the next kernel mounts it and resumes from it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from kaggle_fixtures import USER, backend_for, isolated_env, make_emulator, wait_state  # noqa: F401
from relay.kernel.recipes import price_data
from relay.orchestrator.kaggle import KernelState, SessionKernel

SPEC = Path(__file__).resolve().parents[2] / "examples" / "price-tiny.yaml"
KERNEL, CKPT = f"{USER}/price-tiny-relay", f"{USER}/price-tiny-ckpt"
STEPS_PER_SESSION = 40  # session.max_steps: the session ends at a step count, not a time, on any machine


def session_spec() -> str:
    spec = yaml.safe_load(SPEC.read_text())
    spec["session"]["max_steps"] = STEPS_PER_SESSION
    return yaml.safe_dump(spec, sort_keys=False)


def checkpoint_folder(output: Path, dest: Path) -> Path:
    """What the orchestrator publishes: progress.json and the newest checkpoint (not the feature cache)."""
    progress = json.loads((output / "progress.json").read_text())
    dest.mkdir(parents=True)
    shutil.copy2(output / "progress.json", dest / "progress.json")
    shutil.copytree(output / progress["checkpoint"], dest / progress["checkpoint"])
    return dest


def run_session(backend, tmp_path: Path, index: int, resume: bool) -> dict:
    session = SessionKernel(kernel=KERNEL, title="Price tiny relay", spec_text=session_spec(),
                            run_id=f"price-s{index}", data_dataset=f"{USER}/price-tiny-data",
                            checkpoint_dataset=CKPT if resume else None)
    pushed = backend.push_session(session)
    assert pushed.pushed and pushed.version == index and len(pushed.code_version) == 12
    status = wait_state(backend, KERNEL, 120)
    assert status.state is KernelState.COMPLETE, status.failure_message
    out = backend.download_output(KERNEL, tmp_path / f"out{index}", session.run_id)
    assert out.fresh, out.found_run_id
    marker = json.loads((out.directory / "relay-kernel.json").read_text())
    assert marker["code_version"] == pushed.code_version and marker["exit_code"] == 0
    assert out.progress.code_version == pushed.code_version  # the session ran the bundled code
    return out.progress


def test_price_tiny_session_checkpoint_roundtrip(make_emulator, tmp_path):
    emu = make_emulator(time_scale=100)  # a 12 h Kaggle session lasts 7 min here: only a hang guard
    backend = backend_for(emu)
    data = tmp_path / "price-data"
    price_data.main(["--out", str(data), "--train", "1200", "--test", "200"])
    backend.publish_folder(data, f"{USER}/price-tiny-data", "Price tiny data", "synthetic")

    first = run_session(backend, tmp_path, 1, resume=False)
    assert first.status == "paused" and first.stop_reason == "steps"
    assert first.global_step == STEPS_PER_SESSION
    published = backend.publish_folder(checkpoint_folder(tmp_path / "out1" / "relay", tmp_path / "pub1"),
                                       CKPT, "Price tiny checkpoint", "after session 1")
    assert published.version == 1 and published.created
    state = f"{first.checkpoint}/state.pt"
    assert state in {f.name for f in backend.list_dataset_files(CKPT)}

    second = run_session(backend, tmp_path, 2, resume=True)
    sessions = second.sessions
    assert [s.run_id for s in sessions] == ["price-s1", "price-s2"]
    assert sessions[1].step_start == first.global_step and second.global_step == 2 * STEPS_PER_SESSION
    pub2 = backend.publish_folder(checkpoint_folder(tmp_path / "out2" / "relay", tmp_path / "pub2"),
                                  CKPT, "Price tiny checkpoint", "after session 2")
    assert pub2.version == 2 and not pub2.created
    mounted = emu.store.kernel_dir(KERNEL, 2) / "input" / "price-tiny-ckpt" / state
    assert mounted.is_file()  # the second kernel mounted version 1 of the checkpoint dataset
