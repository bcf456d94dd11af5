"""Kaggle's 20 GB output cap counts everything the session leaves: the disk budget for checkpoints is what the
feature cache and the export leave of it. A save that would cross it prunes older checkpoints first (never the
newest valid one), or stops with one line that names the cache/export."""
from __future__ import annotations

import pytest
import torch

from relay.kernel.session import checkpoint

torch.set_num_threads(1)


def _state(seed: int) -> dict:
    return {"w": torch.randn(250_000, generator=torch.Generator().manual_seed(seed))}  # ~1 MB


def test_cache_and_export_share_the_budget(tmp_path):
    workdir = tmp_path / "relay"
    root = workdir / "checkpoints"
    writer = checkpoint.CheckpointWriter()
    (workdir / "cache").mkdir(parents=True)
    (workdir / "cache" / "features.bin").write_bytes(b"\0" * 1_200_000)
    first = writer.save(root, _state(1), step=1, meta={}, keep_last=5)
    second = writer.save(root, _state(2), step=2, meta={}, keep_last=5)
    size = first.nbytes()
    besides = checkpoint.bytes_besides(workdir, root)
    assert besides == 1_200_000  # the cache, not the checkpoints
    # room for three checkpoints without the cache, two with it: the oldest goes, the newest stays
    budget = 3 * size + size // 2
    third = writer.save(root, _state(3), step=3, meta={}, keep_last=5, disk_budget_bytes=budget,
                        besides_bytes=besides)
    kept = [c.step for c in checkpoint.list_valid(root)]
    assert kept == [3, 2] and not first.path.exists() and second.path.exists() and third.path.exists()
    # without counting the cache, the same budget would have kept all three
    writer.save(root, _state(4), step=4, meta={}, keep_last=5, disk_budget_bytes=budget)
    assert [c.step for c in checkpoint.list_valid(root)] == [4, 3, 2]


def test_an_export_that_leaves_no_room_stops_with_one_line(tmp_path):
    workdir = tmp_path / "relay"
    root = workdir / "checkpoints"
    writer = checkpoint.CheckpointWriter()
    newest = writer.save(root, _state(1), step=1, meta={}, keep_last=5)
    (workdir / "export").mkdir()
    (workdir / "export" / "model.bin").write_bytes(b"\0" * 2_000_000)
    besides = checkpoint.bytes_besides(workdir, root)
    with pytest.raises(checkpoint.DiskBudgetError) as err:
        writer.save(root, _state(2), step=2, meta={}, disk_budget_bytes=3 * newest.nbytes(), besides_bytes=besides)
    message = str(err.value)
    assert "\n" not in message and "cache/export" in message and "checkpoints.disk_budget_gb" in message
    assert [c.step for c in checkpoint.list_valid(root)] == [1]  # the newest valid one is never removed
