"""Where an epoch ends in the Session API (issue 58): session.epoch / step_in_epoch / epoch_end /
steps_per_epoch, the partial last batch (dropped by default, as every relay so far; drop_last=False keeps it as
the epoch's last, smaller step, a DataLoader's default), the same through batches(), batch_sampler(),
dataloader() and RelayAccelerate, per-epoch iteration for an epoch loop over a DataLoader, and the worked
conversion (examples/byo-epochs: a map-style Dataset with its collate) resuming exactly.

In-process sessions end on their step cap, never on time.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch


def test_an_epoch_drops_its_partial_batch_by_default_and_keeps_it_with_drop_last_false():
    from relay.kernel.session.data import StepSchedule, rank_indices

    dropped, kept = StepSchedule(100, 16, 0, drop_last=True), StepSchedule(100, 16, 0, drop_last=False)
    assert dropped.steps_per_epoch == 6 and kept.steps_per_epoch == 7  # 7 == len(DataLoader(100 samples, 16))
    for schedule in (dropped, kept):
        for epoch in range(2):
            steps = [schedule.indices(epoch * schedule.steps_per_epoch + s) for s in range(schedule.steps_per_epoch)]
            seen = np.concatenate(steps)
            assert len(seen) == len(set(seen.tolist()))  # each sample at most once an epoch
            assert len(seen) == (96 if schedule is dropped else 100)
    assert [len(kept.indices(s)) for s in range(7)] == [16] * 6 + [4]
    # the same order either way: keeping the tail only adds the epoch's last step
    assert all(np.array_equal(dropped.indices(s), kept.indices(s)) for s in range(6))
    # several processes: the smaller last step is split into slices that differ by one sample at most
    halves = [rank_indices(kept, 6, rank, 2) for rank in (0, 1)]
    assert [len(h) for h in halves] == [2, 2] and np.array_equal(np.concatenate(halves), kept.indices(6))
    parts = [rank_indices(StepSchedule(101, 16, 0, drop_last=False), 6, rank, 2) for rank in (0, 1)]
    assert [len(p) for p in parts] == [3, 2]


def _session(workdir: Path, total: int, max_steps=None):
    import relay

    return relay.open_session(total_steps=total, workdir=str(workdir), max_steps=max_steps, save_every=3600)


def test_epoch_end_step_in_epoch_and_per_epoch_batches(tmp_path):
    session = _session(tmp_path / "w", total=20)
    try:
        session.restore()
        seen = []  # (epoch, step_in_epoch) at each step's start; the steps where an epoch ended
        ends = []
        for _ in range(3):
            for idx in session.batches(100, 16, drop_last=False, per_epoch=True):
                seen.append((session.epoch, session.step_in_epoch, len(idx)))
                session.step_done()
                if session.epoch_end:
                    ends.append(session.step)
        assert session.steps_per_epoch == 7 and ends == [7, 14]
        assert seen[:8] == [(0, i, 16) for i in range(6)] + [(0, 6, 4), (1, 0, 16)]
        assert seen[-1] == (2, 5, 16) and len(seen) == 20  # the third pass ends with the run, not the epoch
        session.close()
    finally:
        session.clock.restore_signal_handlers()


def _epoch_loop(workdir: Path, max_steps=None) -> dict:
    """The conversion of examples/byo-epochs in process: an epoch loop over session.dataloader (a map-style
    dataset, its collate, drop_last=False), an eval at each epoch's end; what the session ends with."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "byo-epochs"))
    try:
        from train import Shapes, collate
    finally:
        sys.path.pop(0)
    train_set = Shapes(50, seed=0)  # 50 / 8: 7 steps an epoch, the last of 2 samples
    session = _session(workdir, total=3 * 7, max_steps=max_steps)
    evals = []
    try:
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(144, 8), torch.nn.Dropout(0.3),
                                    torch.nn.Linear(8, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        loader = session.dataloader(train_set, 8, drop_last=False, collate_fn=collate)
        session.register(model=model, optimizer=opt)
        start = session.restore()
        for epoch in range(session.epoch, 3):
            if session.should_stop():
                break
            for x, y in loader:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                session.step_done(loss=loss.detach())
            if not session.epoch_end:
                break
            evals.append((epoch, session.step, float(torch.rand(())) ))  # an eval that draws from the global RNG
        progress = session.close()
    finally:
        session.clock.restore_signal_handlers()
    return {"start": start, "progress": progress, "evals": evals,
            "model": {k: v.clone() for k, v in model.state_dict().items()}}


def test_an_epoch_loop_over_session_dataloader_split_anywhere_ends_as_one_run(tmp_path):
    """Cut inside the first epoch (4), on the second's end (14, where the eval then runs in the session that
    ends there) and inside the third (17): the evals and the weights are the uninterrupted run's."""
    straight = _epoch_loop(tmp_path / "straight")
    assert [(e, s) for e, s, _ in straight["evals"]] == [(0, 7), (1, 14), (2, 21)]
    split, evals = tmp_path / "split", []
    for cap in (4, 10, 3, None):  # sessions 0-4, 4-14, 14-17, 17-21
        out = _epoch_loop(split, max_steps=cap)
        evals += out["evals"]
    assert out["start"] == 17 and out["progress"]["status"] == "done"
    assert evals == straight["evals"]
    for name, value in straight["model"].items():
        assert torch.equal(value, out["model"][name]), name


def test_the_worked_conversion_verifies_identical_at_and_between_epoch_ends(relay_cli, tmp_path):
    from byo_fixtures import copy_example

    spec = copy_example("byo-epochs", tmp_path / "ex")
    out = relay_cli.run("verify-resume", str(spec), "--steps", "40", "--cut-at", "16,21",
                        "--workdir", str(tmp_path / "v"), timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert out.stdout.startswith("identical") and "(killed mid-save)" in out.stdout, out.stdout
