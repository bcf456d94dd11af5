"""Checkpoints: atomic save, fallback past a corrupt or incomplete newest, retention, disk budget, safe loading,
atomic export. Real files; corruption is done to the bytes on disk."""
from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

from conftest import load_toy_spec
from relay.kernel.run import run_session
from relay.kernel.session import checkpoint as ck

N = 50_000  # floats per checkpoint: ~200 kB state files


class Payload:  # an arbitrary class: pickle would import and build it; weights_only must refuse
    pass


writer = ck.CheckpointWriter()  # replaced for each test: a test's saves share one, as a session's do


@pytest.fixture(autouse=True)
def fresh_writer():
    global writer
    writer = ck.CheckpointWriter()
    yield
    writer.wait_for_deletions()


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(N, generator=g), "b": torch.zeros(3)}, "step": step,
            "rng": {"numpy": [1, 2, 3]}}


def best(step: int, value: float) -> dict:
    return {"run_id": "r", "best": {"metric": "mse", "value": value, "step": step}}


def save(root: Path, step: int, meta: dict | None = None, **kwargs) -> ck.Checkpoint:
    kwargs.setdefault("keep_last", 100)
    return writer.save(root, state(step), step=step, meta=meta or {"run_id": "r"}, **kwargs)


def names(root: Path) -> list[str]:
    writer.wait_for_deletions()  # retired checkpoints are deleted in the background
    return sorted(p.name for p in root.iterdir())


def latest_step(*roots: Path) -> int:
    found = ck.load_latest(*roots)
    assert found is not None
    checkpoint, loaded = found
    assert loaded["step"] == checkpoint.step
    assert torch.equal(loaded["model"]["w"], state(checkpoint.step)["model"]["w"])
    return checkpoint.step


# -- atomic save ------------------------------------------------------------------------------------
def test_save_writes_state_and_manifest_with_hashes(tmp_path):
    c = save(tmp_path, 7, {"run_id": "run-1", "code_version": "abc", "epoch": 0})
    assert c.path == tmp_path / "step-00000007" and names(c.path) == ["manifest.json", "state.pt"]
    manifest = json.loads((c.path / "manifest.json").read_text())
    info = manifest["files"]["state.pt"]
    assert info == {"bytes": (c.path / "state.pt").stat().st_size, "crc32": ck.file_digest(c.path / "state.pt", "crc32")}
    assert (manifest["format"], manifest["step"], manifest["run_id"], manifest["code_version"]) == (1, 7, "run-1", "abc")
    assert names(tmp_path) == ["step-00000007"]  # no temp folder left behind


def test_folder_without_manifest_is_ignored(tmp_path):
    save(tmp_path, 1)
    save(tmp_path, 2)
    (tmp_path / "step-00000002" / "manifest.json").unlink()  # as if killed before the manifest was written
    assert [c.step for c in ck.list_valid(tmp_path)] == [1]
    assert latest_step(tmp_path) == 1


def test_stale_tmp_folder_is_ignored_and_removed_at_next_save(tmp_path):
    save(tmp_path, 1)
    stale = tmp_path / ".tmp-step-00000002-99999"  # a save killed half-way (even with a manifest inside)
    shutil.copytree(tmp_path / "step-00000001", stale)
    assert [c.step for c in ck.list_valid(tmp_path)] == [1]
    save(tmp_path, 3)
    assert not stale.exists()
    assert names(tmp_path) == ["step-00000001", "step-00000003"]


def test_failed_save_leaves_no_folder_and_keeps_older(tmp_path):
    save(tmp_path, 1)
    with pytest.raises(Exception):
        writer.save(tmp_path, {"bad": lambda: 0}, step=2, meta={})  # torch.save cannot pickle this
    assert names(tmp_path) == ["step-00000001"]
    assert latest_step(tmp_path) == 1


def test_several_saves_at_one_step_are_ordered(tmp_path):
    """Folders a killed supersede left (.1 beside the plain name) still order by seq, newest first."""
    save(tmp_path, 5)
    shutil.copytree(tmp_path / "step-00000005", tmp_path / "step-00000005.2")
    shutil.copytree(tmp_path / "step-00000005", tmp_path / "step-00000005.1")
    assert [x.path.name for x in ck.list_valid(tmp_path)][0] == "step-00000005.2"


def test_a_second_save_at_one_step_replaces_the_first(tmp_path):
    """The final save right after a best save at the same step: one folder per step, holding the newer state
    and the best record, and it does not take an older checkpoint's keep_last slot."""
    save(tmp_path, 3, keep_last=2)
    first = writer.save(tmp_path, state(7), step=7, meta={**best(7, 0.5), "reason": "best"}, keep_last=2,
                    keep_best_mode="max")
    newer = {**state(7), "stop_reason": "done"}
    c = writer.save(tmp_path, newer, step=7, meta={**best(7, 0.5), "reason": "done"}, keep_last=2,
                keep_best_mode="max")
    assert first.path == c.path == tmp_path / "step-00000007" and c.seq == 0 and c.metric == 0.5
    assert names(tmp_path) == ["step-00000003", "step-00000007"]
    found, loaded = ck.load_latest(tmp_path)
    assert found.manifest["reason"] == "done" and loaded["stop_reason"] == "done"
    c = writer.save(tmp_path, state(7), step=7, meta=best(7, 0.5), keep_last=2)  # a third time, while deleting
    assert names(tmp_path) == ["step-00000003", "step-00000007"] and c.path.name == "step-00000007"


def test_an_older_same_step_checkpoint_with_its_own_metric_is_kept(tmp_path):
    save(tmp_path, 7, best(7, 0.9))
    c = save(tmp_path, 7, best(2, 0.1))  # does not carry the metric of step 7's weights: not a substitute
    assert c.path.name == "step-00000007.1"
    assert names(tmp_path) == ["step-00000007", "step-00000007.1"]


# -- corrupt newest falls back ---------------------------------------------------------------------
def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def missing_manifest(path: Path) -> None:
    (path.parent / "manifest.json").unlink()


def missing_state(path: Path) -> None:
    path.unlink()


def garbage_manifest(path: Path) -> None:
    (path.parent / "manifest.json").write_bytes(os.urandom(200))


def manifest_of_wrong_shape(path: Path) -> None:  # valid JSON, damaged: a flipped bit in a key name
    m = path.parent / "manifest.json"
    m.write_text(m.read_text().replace('"files"', '"filez"'))


def manifest_files_not_a_mapping(path: Path) -> None:
    m = path.parent / "manifest.json"
    data = json.loads(m.read_text())
    data["files"] = "state.pt"
    m.write_text(json.dumps(data))


def manifest_without_sizes(path: Path) -> None:
    m = path.parent / "manifest.json"
    data = json.loads(m.read_text())
    data["files"]["state.pt"] = {}
    m.write_text(json.dumps(data))


def manifest_wrong_format(path: Path) -> None:
    m = path.parent / "manifest.json"
    data = json.loads(m.read_text())
    data["format"] = 99
    m.write_text(json.dumps(data))


@pytest.mark.parametrize("damage", [flip_byte, truncate, missing_manifest, missing_state, garbage_manifest,
                                    manifest_of_wrong_shape, manifest_files_not_a_mapping,
                                    manifest_without_sizes, manifest_wrong_format])
def test_corrupt_newest_falls_back_to_previous(tmp_path, damage, caplog):
    save(tmp_path, 1)
    save(tmp_path, 2)
    save(tmp_path, 3)
    damage(tmp_path / "step-00000003" / "state.pt")
    with caplog.at_level(logging.WARNING):
        assert latest_step(tmp_path) == 2
    if damage is flip_byte:  # same size: only the checksum tells; the loader says why it skipped it
        assert "crc32 does not match" in caplog.text


def test_sha256_digest_is_recorded_written_inline_and_checked(tmp_path):
    # the opt-in cryptographic digest (checkpoints.digest: sha256): same protocol, other checksum
    c = writer.save(tmp_path, {"w": torch.arange(1000.0)}, step=1, meta={}, digest="sha256")
    info = json.loads((c.path / "manifest.json").read_text())["files"]["state.pt"]
    assert set(info) == {"bytes", "sha256"} and info["sha256"] == ck.sha256_file(c.path / "state.pt")
    writer.save(tmp_path, {"w": torch.arange(1000.0) + 1}, step=2, meta={}, digest="sha256")
    flip_byte(tmp_path / "step-00000002" / "state.pt")
    assert [x.step for x in ck.list_valid(tmp_path, verify_hashes=True)] == [1]
    assert torch.equal(ck.load_latest(tmp_path)[1]["w"], torch.arange(1000.0))


def test_retired_checkpoint_stops_counting_at_once_and_is_gone_after_the_wait(tmp_path):
    for step in range(1, 4):
        save(tmp_path, step, keep_last=1)
        assert [c.step for c in ck.list_valid(tmp_path)] == [step]  # before any background deletion ends
    writer.wait_for_deletions()
    assert names(tmp_path) == ["step-00000003"]


def test_all_corrupt_means_no_checkpoint(tmp_path):
    save(tmp_path, 1)
    flip_byte(tmp_path / "step-00000001" / "state.pt")
    assert ck.load_latest(tmp_path) is None
    assert ck.load_latest(tmp_path / "nowhere") is None


def test_newest_across_roots_and_layouts(tmp_path):
    """A workdir (checkpoints/step-*), a mounted dataset of step-* folders, and a single checkpoint folder."""
    own, mounted, single = tmp_path / "work", tmp_path / "mounted", tmp_path / "single"
    save(own / "checkpoints", 4)
    save(mounted, 9)
    shutil.copytree(save(tmp_path / "x", 6).path, single)
    assert [len(ck.find_checkpoints(r)) for r in (own, mounted, single)] == [1, 1, 1]
    assert latest_step(own, single) == 6
    assert latest_step(own, mounted, single) == 9
    flip_byte(mounted / "step-00000009" / "state.pt")
    assert latest_step(own, mounted, single) == 6


# -- retention --------------------------------------------------------------------------------------
def test_retention_keeps_last_n(tmp_path):
    for step in range(1, 6):
        save(tmp_path, step, keep_last=2)
    assert names(tmp_path) == ["step-00000004", "step-00000005"]


def test_retention_keeps_the_checkpoint_of_the_best_step(tmp_path):
    """As a run writes them: every manifest carries the best-so-far record; only step 20's weights scored it."""
    evals = {10: 0.5, 20: 0.3, 30: 0.4, 40: 0.45, 50: 0.6}
    best_so_far = None
    for step, value in evals.items():
        if best_so_far is None or value < best_so_far[1]:
            best_so_far = (step, value)
        save(tmp_path, step, best(*best_so_far), keep_last=1, keep_best_mode="min")
    assert names(tmp_path) == ["step-00000020", "step-00000050"]
    # "max" mode keeps the highest instead
    other = tmp_path / "max"
    for step, value in [(1, 0.1), (2, 0.9), (3, 0.5)]:
        save(other, step, best(2 if step >= 2 else 1, 0.9 if step >= 2 else 0.1), keep_last=1, keep_best_mode="max")
    assert names(other) == ["step-00000002", "step-00000003"]


def test_retention_without_keep_best(tmp_path):
    for step, value in [(1, 0.1), (2, 0.9), (3, 0.8)]:
        save(tmp_path, step, best(1, 0.1), keep_last=1, keep_best_mode=None)
    assert names(tmp_path) == ["step-00000003"]


def test_prune_never_deletes_newest_valid_and_leaves_incomplete_alone(tmp_path):
    for step in (1, 2, 3):
        save(tmp_path, step)
    (tmp_path / "step-00000003" / "manifest.json").unlink()  # newest incomplete
    removed = writer.prune(tmp_path, keep_last=1)
    assert removed == [tmp_path / "step-00000001"]
    assert names(tmp_path) == ["step-00000002", "step-00000003"]
    assert latest_step(tmp_path) == 2


def test_failed_save_prunes_nothing(tmp_path):
    for step in (1, 2):
        save(tmp_path, step, keep_last=2)
    with pytest.raises(Exception):
        writer.save(tmp_path, {"bad": lambda: 0}, step=3, meta={}, keep_last=1)
    assert names(tmp_path) == ["step-00000001", "step-00000002"]


# -- disk budget ------------------------------------------------------------------------------------
def sized_run(root: Path) -> int:
    """Four checkpoints; the best (by its own eval) is step 2. Returns one checkpoint's size in bytes."""
    for step, meta in [(1, best(1, 0.5)), (2, best(2, 0.2)), (3, best(2, 0.2)), (4, best(2, 0.2))]:
        save(root, step, meta, keep_last=100, keep_best_mode="min")
    return ck.list_valid(root)[0].nbytes()


def test_disk_budget_prunes_oldest_first_sparing_best_and_newest(tmp_path):
    size = sized_run(tmp_path)
    save(tmp_path, 5, best(2, 0.2), disk_budget_bytes=int(3.5 * size), keep_best_mode="min")
    assert names(tmp_path) == ["step-00000002", "step-00000004", "step-00000005"]


def test_disk_budget_gives_up_the_best_before_the_newest(tmp_path):
    size = sized_run(tmp_path)
    save(tmp_path, 5, best(2, 0.2), disk_budget_bytes=int(2.5 * size), keep_best_mode="min")
    assert names(tmp_path) == ["step-00000004", "step-00000005"]
    assert latest_step(tmp_path) == 5


def test_disk_budget_too_small_for_newest_plus_new_raises_and_deletes_nothing(tmp_path):
    size = sized_run(tmp_path)
    before = names(tmp_path)
    with pytest.raises(ck.DiskBudgetError) as err:
        save(tmp_path, 5, best(2, 0.2), disk_budget_bytes=int(1.5 * size), keep_best_mode="min")
    message = str(err.value)
    assert message.startswith("checkpoints.disk_budget_gb: a new checkpoint (~") and message.endswith("; raise the budget")
    assert ck.size_text(size) in message and "0.00 GB" not in message  # a small checkpoint still shows its size
    assert "\n" not in message
    assert names(tmp_path) == before  # a save that cannot fit must not cost the fallbacks
    assert isinstance(err.value, ck.InputError)  # the CLI turns it into one line, exit 2


def test_disk_budget_with_room_deletes_nothing(tmp_path):
    size = sized_run(tmp_path)
    save(tmp_path, 5, best(2, 0.2), disk_budget_bytes=10 * size, keep_best_mode="min")
    assert len(names(tmp_path)) == 5


# -- safe loading -----------------------------------------------------------------------------------
def test_real_training_state_loads_with_weights_only(tmp_path):
    """Everything the Trainer saves (model, AdamW, scheduler, scaler, torch/numpy/python RNG, trainer state)
    is plain data and tensors: torch.load(weights_only=True) reads it without allowlisting anything."""
    spec = load_toy_spec(optim={"epochs": None, "max_steps": 6})
    progress = run_session(spec, tmp_path)
    assert progress["status"] == "done"
    loaded = torch.load(tmp_path / progress["checkpoint"] / "state.pt", weights_only=True)
    assert set(loaded) == {"objects", "relay", "rng"}  # the Session API's layout too
    assert set(loaded["objects"]) == {"model", "optimizer", "scheduler", "scaler"}
    assert set(loaded["rng"]) >= {"torch", "numpy", "python"}
    assert loaded["relay"]["global_step"] == 6
    assert ck.weights_sha256(loaded["objects"]["model"]) == progress["weights_sha256"]


def test_load_refuses_pickled_objects(tmp_path):
    c = save(tmp_path, 1)
    evil = tmp_path / "evil"
    shutil.copytree(c.path, evil)

    torch.save({"x": Payload()}, evil / "state.pt")
    manifest = json.loads((evil / "manifest.json").read_text())
    manifest["files"]["state.pt"] = {"bytes": (evil / "state.pt").stat().st_size,
                                     "crc32": ck.file_digest(evil / "state.pt", "crc32")}
    (evil / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ck.CheckpointError, match="cannot be loaded"):
        ck.load(ck.list_valid(evil)[0])


def test_weights_sha256_is_order_independent_and_bit_sensitive():
    a = {"x": torch.ones(3), "y": torch.zeros(2, 2)}
    b = {"y": torch.zeros(2, 2), "x": torch.ones(3)}
    assert ck.weights_sha256(a) == ck.weights_sha256(b)
    c = {"x": torch.ones(3), "y": torch.zeros(2, 2)}
    c["y"][1, 1] = -0.0  # a different bit pattern, equal value
    assert ck.weights_sha256(a) != ck.weights_sha256(c)


# -- export -----------------------------------------------------------------------------------------
def test_export_atomic_replaces_the_previous_export(tmp_path):
    out = tmp_path / "export"
    ck.export_atomic(out, lambda d: (d / "model.safetensors").write_text("v1"))
    ck.export_atomic(out, lambda d: (d / "config.json").write_text("{}"))
    assert names(out) == ["config.json"]
    assert names(tmp_path) == ["export"]


def test_export_atomic_keeps_the_old_export_when_writing_fails(tmp_path):
    out = tmp_path / "export"
    ck.export_atomic(out, lambda d: (d / "model.safetensors").write_text("v1"))

    def broken(d: Path) -> None:
        (d / "model.safetensors").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        ck.export_atomic(out, broken)
    assert (out / "model.safetensors").read_text() == "v1"
    assert names(tmp_path) == ["export"]  # no half-written export left beside it


def test_run_exports_weights_only_model(tmp_path):
    from safetensors.torch import load_file

    spec = load_toy_spec(optim={"epochs": None, "max_steps": 4})
    progress = run_session(spec, tmp_path)
    tensors = load_file(tmp_path / "export" / "model.safetensors")
    final = torch.load(tmp_path / progress["checkpoint"] / "state.pt", weights_only=True)["objects"]["model"]
    assert set(tensors) == set(final)
    assert all(torch.equal(tensors[k], final[k]) for k in final)


# -- the commit runs behind the training loop; the test seam that stops a save midway ------------------
def test_a_background_save_commits_the_state_as_it_was_and_the_previous_stays_newest_until_then(tmp_path, monkeypatch):
    first = writer.save(tmp_path, {"w": torch.zeros(6_000_000)}, step=1, meta={"run_id": "r"})
    gate, digest = threading.Event(), ck.file_digest


    def held_in_the_commit(*args, **kwargs):  # the commit thread waits for the gate; verification does not
        if threading.current_thread().name == "checkpoint-commit":
            assert gate.wait(120), "the gate was never opened"
        return digest(*args, **kwargs)

    monkeypatch.setattr(ck, "file_digest", held_in_the_commit)
    committed = []
    state = {"w": torch.ones(6_000_000)}
    pending = writer.start_save(tmp_path, state, step=2, meta={"run_id": "r"}, on_commit=committed.append)
    state["w"].add_(41)  # training goes on while the commit waits: the save holds the tensors as they were
    assert [c.step for c in ck.list_valid(tmp_path, verify_hashes=True)] == [1] and not committed
    gate.set()
    second = pending.result()
    assert committed == [second] and [c.step for c in ck.list_valid(tmp_path, verify_hashes=True)] == [2, 1]
    assert torch.equal(ck.load(second)["w"], torch.ones(6_000_000)) and first.step == 1
    assert second.manifest["files"]["state.pt"]["crc32"] == digest(second.path / "state.pt", "crc32")


def test_a_failed_background_commit_is_raised_and_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    writer.save(tmp_path, {"w": torch.zeros(10)}, step=1, meta={"run_id": "r"})

    def disk_gone(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ck.atomic, "fsync", disk_gone)
    writer.start_save(tmp_path, {"w": torch.ones(10)}, step=2, meta={"run_id": "r"})
    with pytest.raises(OSError, match="No space left"):
        writer.wait_pending()  # or the next start_save: a failed commit is never silent
    assert writer.wait_pending() is None  # raised once
    assert [c.step for c in ck.list_valid(tmp_path, verify_hashes=True)] == [1]
    assert not list(tmp_path.glob(".tmp-*"))


STOP_SCRIPT = """
import sys, torch
from pathlib import Path
from relay.kernel.session import checkpoint as ck
writer = ck.CheckpointWriter()
for step in (1, 2, 5):
    writer.save(Path(sys.argv[1]), {"w": torch.full((10,), float(step))}, step=step, meta={"run_id": "r"})
"""


def test_stop_mid_save_seam_leaves_a_torn_save_to_kill(tmp_path, spawns_processes):
    """RELAY_TEST_STOP_MID_SAVE=3: the process stops itself in its first save at step >= 3 (after saves
    below it), every file written, the folder not renamed; SIGKILL there leaves step 2 the latest."""
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "RELAY_TEST_STOP_MID_SAVE": "3", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-c", STOP_SCRIPT, str(tmp_path)], env=env)
    deadline = time.monotonic() + 120  # a hang guard
    stat = Path(f"/proc/{proc.pid}/stat")
    while stat.read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert proc.poll() is None and time.monotonic() < deadline, "the process did not stop in the save"
        time.sleep(0.01)
    torn = tmp_path / f".tmp-step-00000005-{proc.pid}"
    assert sorted(p.name for p in torn.iterdir()) == ["manifest.json", "state.pt"]
    assert not (tmp_path / "step-00000005").exists()
    proc.kill()
    assert proc.wait() == -signal.SIGKILL
    found = ck.load_latest(tmp_path)
    assert found[0].step == 2 and torch.equal(found[1]["w"], torch.full((10,), 2.0))


def test_with_keep_best_the_best_checkpoints_weights_are_exported_beside_the_final_ones(tmp_path):
    """export/ is the final model (its hash is weights_sha256); export/best/ holds the weights that scored the
    run's best metric: the model to ship when the last is not the best ("the best by validation F1" of seed 001,
    docs/recipes.md)."""
    from safetensors.torch import load_file

    spec = load_toy_spec(optim={"epochs": None, "max_steps": 6, "eval_every_steps": 1, "lr": 0.5},
                         checkpoints={"keep_best": True, "keep_last": 1})
    progress = run_session(spec, tmp_path)
    best = [c for c in ck.list_valid(tmp_path / "checkpoints") if c.step == progress["best"]["step"]]
    expected = torch.load(best[0].path / "state.pt", weights_only=True)["objects"]["model"]
    tensors = load_file(tmp_path / "export" / "best" / "model.safetensors")
    assert set(tensors) == set(expected) and all(torch.equal(tensors[k], expected[k]) for k in expected)
    final = load_file(tmp_path / "export" / "model.safetensors")
    assert ck.weights_sha256(final) == progress["weights_sha256"]
    # lr 0.5 makes the toy diverge after its first step: the best is not the final model
    assert progress["best"]["step"] < 6 and not all(torch.equal(final[k], expected[k]) for k in expected)


def test_a_background_saves_host_copy_is_exact_reused_and_keeps_tied_weights_one(tmp_path):
    """relay/kernel/session/host_copy.py: what a background save writes is the state as it was at start_save, bit
    for bit; the next save copies into the same buffers; two names of one tensor (tied weights) stay one tensor,
    as torch.save keeps them one storage (the file does not grow by a copy)."""
    from relay.kernel.session.host_copy import HostCopy

    shared = torch.randn(4, 3)
    state = {"model": {"embed.weight": shared, "head.weight": shared, "bias": torch.arange(3.0)},
             "optimizer": {"state": {0: {"step": torch.tensor(5.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
             "rng": {"python": (3, (1, 2, 3), None)}, "step": 7}
    copier = HostCopy()
    snap = copier.take(state)
    assert snap["model"]["embed.weight"] is snap["model"]["head.weight"]
    assert torch.equal(snap["model"]["bias"], state["model"]["bias"]) and snap["step"] == 7
    first = snap["model"]["bias"]
    state["model"]["bias"].add_(1)  # training goes on
    assert torch.equal(first, torch.arange(3.0))
    again = copier.take(state)
    assert again["model"]["bias"] is first and torch.equal(first, torch.arange(3.0) + 1)  # the same buffer, refilled
    assert again["rng"]["python"] == state["rng"]["python"] and isinstance(again["rng"]["python"], tuple)

    writer = ck.CheckpointWriter()
    pending = writer.start_save(tmp_path, state, step=1, meta={})
    state["model"]["bias"].mul_(0)  # changed before the background write ran
    saved = ck.load(pending.result())
    assert torch.equal(saved["model"]["bias"], torch.arange(3.0) + 1)
    assert saved["model"]["embed.weight"].data_ptr() == saved["model"]["head.weight"].data_ptr()
