"""Where the data stands is a pure function of the optimizer step: derived, not saved (as nanoGPT derives its
learning rate), so there is nothing to restore or replay.

Epoch e visits a permutation seeded by (seed, e); optimizer step s takes the `effective_batch` indices at
position (s mod steps_per_epoch) of its epoch. The samples left over at an epoch's end (n mod the batch) are
dropped by default (a different few each epoch: nothing is lost for good); with drop_last=False they are the
epoch's last, smaller step, as a DataLoader's default drop_last=False gives them. Resuming at step s therefore
costs one permutation, not a replay of s batches (transformers #11284 spent 28 h skipping). The effective batch
(micro x accumulation) never changes, so an OOM back-off that halves the micro-batch keeps the same sample
order.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from relay.shared.errors import InputError


@dataclass(frozen=True)
class StepSchedule:
    n_samples: int
    effective_batch: int
    seed: int
    setting: str = field(default="optim.micro_batch x optim.grad_accum", compare=False)  # named in the error
    drop_last: bool = True  # the built-in recipes' rule, and the Session API's default (every relay so far)

    def __post_init__(self):
        if self.n_samples < self.effective_batch:
            raise InputError(  # a user-fixable setting: the CLI prints one line and exits 2
                f"{self.setting} ({self.effective_batch}) is larger than the"
                f" training set ({self.n_samples} samples)"
            )

    @functools.cached_property  # read every step: computed once (into __dict__, which a frozen dataclass allows)
    def steps_per_epoch(self) -> int:
        # The tail that does not fill an optimizer step is dropped (it differs each epoch: nothing is lost),
        # or is the epoch's last step (drop_last=False)
        whole, left = divmod(self.n_samples, self.effective_batch)
        return whole + (1 if left and not self.drop_last else 0)

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def step_in_epoch(self, step: int) -> int:
        """Steps done in the epoch that `step` (steps done so far) is in."""
        return step % self.steps_per_epoch

    def is_epoch_end(self, step: int) -> bool:
        """True after the last optimizer step of an epoch (`step` counts completed steps)."""
        return step > 0 and step % self.steps_per_epoch == 0

    def scaled(self, k: int, stage: str = "") -> "StepSchedule":
        """The schedule of a stage whose steps take k x the effective batch (Stage.batch_scale): the same
        samples and seed, so its order is a pure function of the step as well."""
        if k == 1:
            return self
        where = f"stage {stage}: " if stage else ""
        return StepSchedule(self.n_samples, self.effective_batch * k, self.seed,
                            setting=f"{where}{self.setting} x batch_scale {k}", drop_last=self.drop_last)

    def permutation(self, epoch: int) -> np.ndarray:
        return epoch_order(self.n_samples, self.seed, epoch)

    def indices(self, step: int) -> np.ndarray:
        """Step `step`'s sample indices, a fresh int64 array (the user's to keep or change: a view would let an
        in-place edit reorder the cached epoch). Not a list: torch reads a list index element by element, so a
        tensor indexed by this step's list cost a loop more than all the rest of the Session API's calls
        (bench/bench_byo.py's `api_cost`, 64 indices: 11.1 us a step with lists, 3.1 with arrays)."""
        epoch, position = divmod(step, self.steps_per_epoch)
        start = position * self.effective_batch
        return epoch_order(self.n_samples, self.seed, epoch)[start : start + self.effective_batch].copy()


@functools.lru_cache(maxsize=4)  # keyed by plain ints, hashed in C (a frozen dataclass's hash runs Python each step)
def epoch_order(n_samples: int, seed: int, epoch: int) -> np.ndarray:
    """Epoch `epoch`'s order: torch's randperm (the order every relay version drew), kept as numpy: a step's
    indices are a slice of it copied (StepSchedule.indices)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n_samples, generator=g).numpy()


def rank_indices(schedule: StepSchedule, step: int, rank: int = 0, world_size: int = 1) -> np.ndarray:
    """Rank `rank`'s equal slice of optimizer step `step`'s effective batch (all of it with one process); of an
    epoch's smaller last step (drop_last=False), slices that differ by one sample at most."""
    if world_size == 1:
        return schedule.indices(step)
    indices = schedule.indices(step)
    if len(indices) < schedule.effective_batch:
        return np.array_split(indices, world_size)[rank].copy()
    share = schedule.effective_batch // world_size
    return indices[rank * share : (rank + 1) * share]


class MicroBatchSampler(Sampler[list[int]]):
    """Yields the micro-batches of optimizer steps start_step, start_step+1, ..., end_step-1 (of this rank's
    slice of each step when several processes train together)."""

    def __init__(self, schedule: StepSchedule, start_step: int, end_step: int, micro_batch: int,
                 rank: int = 0, world_size: int = 1):
        if schedule.effective_batch % (micro_batch * world_size):
            raise ValueError(f"micro-batch {micro_batch} x {world_size} processes does not divide the effective batch")
        self.schedule, self.start, self.end, self.micro = schedule, start_step, end_step, micro_batch
        self.rank, self.world_size = rank, world_size

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start, self.end):
            idx = rank_indices(self.schedule, step, self.rank, self.world_size)
            for i in range(0, len(idx), self.micro):
                yield idx[i : i + self.micro].tolist()  # a DataLoader's batch_sampler gives lists

    def __len__(self) -> int:
        return (self.end - self.start) * (self.schedule.effective_batch // (self.micro * self.world_size))


class RunBatchSampler(Sampler[list[int]]):
    """session.batch_sampler: each iteration from the session's step on (to the run's end, or its epoch's), the
    steps' indices (this rank's slice); under verify-resume each step's as it is drawn goes to the trace."""

    def __init__(self, session, schedule: StepSchedule, per_epoch: bool = False):
        self.session, self.schedule, self.per_epoch = session, schedule, per_epoch

    def _end(self, start: int) -> int:
        """Where an iteration that starts at step `start` ends: the run's end, or its epoch's."""
        if not self.per_epoch:
            return self.session.total_steps
        return min(self.session.total_steps, (self.schedule.epoch_of(start) + 1) * self.schedule.steps_per_epoch)

    def __iter__(self) -> Iterator[list[int]]:
        trace = self.session._trace  # under verify-resume: each step's batch as it is drawn, after restore()
        if trace:
            trace.new_stream()
        start = self.session.step
        for step in range(start, self._end(start)):
            indices = rank_indices(self.schedule, step, self.session.rank, self.session.world_size)
            if trace:
                trace.drawn(indices)
            yield indices.tolist()

    def __len__(self) -> int:
        return self.schedule.steps_per_epoch if self.per_epoch else self.session.total_steps


class SessionLoader:
    """session.dataloader: iterating it yields its DataLoader's batches while the session may go on (asked before
    each fetch, so a loader that fetches ahead still ends at the step the session stops at); len, .dataset and
    the rest are the DataLoader's."""

    def __init__(self, session, loader: DataLoader):
        self.session, self.loader = session, loader

    def __iter__(self) -> Iterator:
        batches = iter(self.loader)
        while not self.session.should_stop():
            batch = next(batches, _END)
            if batch is _END:
                return
            yield batch

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str):
        return getattr(self.loader, name)


_END = object()


def make_loader(
    dataset: Dataset,
    batch_sampler: Sampler,
    collate: Callable,
    *,
    num_workers: int,
    pin_memory: bool,
    prefetch_factor: int,
    persistent_workers: bool,
    seed: int,
) -> DataLoader:
    # A dedicated generator: creating a loader iterator draws a base seed, and from the global RNG that
    # would shift dropout masks and break exact resume.
    extra = dict(prefetch_factor=prefetch_factor, persistent_workers=persistent_workers) if num_workers else {}
    return DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        collate_fn=collate,
        num_workers=num_workers,
        pin_memory=pin_memory,
        generator=torch.Generator().manual_seed(seed),
        **extra,
    )


def eval_loader(dataset: Dataset, collate: Callable, batch_size: int, num_workers: int,
                pin_memory: bool, seed: int) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=collate,
                      num_workers=num_workers, pin_memory=pin_memory,
                      generator=torch.Generator().manual_seed(seed))


def to_device(batch: dict, device: torch.device, non_blocking: bool) -> dict:
    return {k: v.to(device, non_blocking=non_blocking) if torch.is_tensor(v) else v for k, v in batch.items()}


def total_steps(schedule: StepSchedule, epochs: Optional[int], max_steps: Optional[int]) -> int:
    return max_steps if max_steps is not None else epochs * schedule.steps_per_epoch
