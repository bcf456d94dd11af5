"""The backend against the emulator with >= 20 % of calls failing (429, 500, connection reset, lost responses,
uploads cut mid-file): every operation ends right, no session is pushed twice, published datasets are complete."""
from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest

from kaggle_fixtures import TOY_SPEC_YAML, USER, backend_for, isolated_env, make_emulator  # noqa: F401
from relay.orchestrator.kaggle import KernelState, SessionKernel

def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_folder(root: Path, seed: int) -> Path:
    root.mkdir(parents=True)
    rnd = __import__("random").Random(seed)
    (root / "weights.bin").write_bytes(rnd.randbytes(300_000))
    (root / "progress.json").write_text('{"step": %d}' % seed)
    (root / "checkpoints" / "step-00000001").mkdir(parents=True)
    (root / "checkpoints" / "step-00000001" / "state.pt").write_bytes(rnd.randbytes(50_000))
    return root


def wait_finished(backend, kernel: str, timeout: float = 90) -> KernelState:
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = backend.kernel_status(kernel).state
        if state.finished:
            return state
        time.sleep(0.2)
    raise AssertionError(f"{kernel} did not finish in {timeout}s")


FAULTS = {"seed": 11, "methods": {"*": {"rate": 0.3}, "SaveKernel": {"script": ["lost", "500"], "rate": 0.3}},
          "upload_fail_midfile": 0.3}


def test_every_operation_ends_right_under_faults(make_emulator, tmp_path):
    emu = make_emulator(faults=FAULTS, dataset_processing_delay=0.3)
    backend = backend_for(emu, seed=3, attempts=14)

    first = make_folder(tmp_path / "v1", 1)
    result = backend.publish_folder(first, f"{USER}/relay-ckpt-test", "Relay checkpoint test", "session 1")
    assert (result.version, result.created, result.already_published) == (1, True, False)
    second = make_folder(tmp_path / "v2", 2)
    result2 = backend.publish_folder(second, f"{USER}/relay-ckpt-test", "Relay checkpoint test", "session 2")
    assert result2.version == 2
    again = backend.publish_folder(second, f"{USER}/relay-ckpt-test", "Relay checkpoint test", "session 2")
    assert again.already_published and again.version == 2
    assert len(emu.store.datasets[f"{USER}/relay-ckpt-test"]["versions"]) == 2

    for folder, version in ((first, 1), (second, 2)):  # complete and intact, byte for byte
        stored = emu.store.dataset_dir(f"{USER}/relay-ckpt-test", version)
        for name, meta in (result if version == 1 else result2).files.items():
            assert sha(stored / name) == meta["sha256"] == sha(folder / name)
    listed = {f.name: f.size for f in backend.list_dataset_files(f"{USER}/relay-ckpt-test")}
    assert listed["weights.bin"] == 300_000 and "checkpoints/step-00000001/state.pt" in listed

    session = SessionKernel(kernel=f"{USER}/toy-session", title="Toy session", spec_text=TOY_SPEC_YAML,
                            run_id="run-0001", enable_gpu=True)
    # No checkpoint_dataset: the folders above are not relay checkpoints, and a session told to resume from
    # one that is not valid refuses to start (tests/orchestrator/test_relay_corrupt_ckpt.py); this one starts fresh.
    pushed = backend.push_session(session)
    assert pushed.pushed and pushed.version == 1
    assert backend.push_session(session).already_pushed  # same run id: never a second push
    assert len(emu.store.kernels[f"{USER}/toy-session"]["versions"]) == 1

    assert wait_finished(backend, session.kernel) is KernelState.COMPLETE
    out = backend.download_output(session.kernel, tmp_path / "out", "run-0001")
    assert out.fresh and out.progress.status == "done"
    working = emu.store.kernel_dir(session.kernel, 1) / "working"
    for name in out.files:
        assert sha(out.directory / name) == sha(working / name)
    quota = backend.quota()
    assert quota.allowed_s == 30 * 3600 and quota.used_s > 0 and quota.refresh_time is not None

    injected = dict(emu.faults.injected)
    calls = sum(emu.faults._counts.values())
    print(f"faults injected {injected} over {calls} calls")
    assert sum(injected.values()) >= 0.2 * calls
    assert injected.get("lost", 0) >= 1 and injected.get("upload_midfile", 0) >= 1


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_publish_and_status_survive_other_seeds(make_emulator, tmp_path, seed):
    emu = make_emulator(faults={"seed": seed, "methods": {"*": {"rate": 0.35}}, "upload_fail_midfile": 0.4})
    backend = backend_for(emu, seed=seed, attempts=16)
    folder = make_folder(tmp_path / "f", seed)
    result = backend.publish_folder(folder, f"{USER}/seeded-{seed}-ckpt", "Seeded checkpoint", "")
    stored = emu.store.dataset_dir(f"{USER}/seeded-{seed}-ckpt", result.version)
    assert {n: sha(stored / n) for n in result.files} == {n: m["sha256"] for n, m in result.files.items()}
    assert result.version == 1 and len(emu.store.datasets[f"{USER}/seeded-{seed}-ckpt"]["versions"]) == 1
    second = backend.publish_folder(make_folder(tmp_path / "g", seed + 10), f"{USER}/seeded-{seed}-ckpt",
                                    "Seeded checkpoint", "")
    assert second.version == 2 and len(emu.store.datasets[f"{USER}/seeded-{seed}-ckpt"]["versions"]) == 2
