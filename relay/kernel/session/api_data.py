"""The Session API's data half: the step-derived batches a loop takes (indices, a batch sampler, a DataLoader)
and the epoch they fall in. Every step's batch is a function of the step (session/data.py's StepSchedule), so a
resumed session draws the uninterrupted run's next batch. Mixed into session/api.py's Session, which holds the book
(`self.book.global_step`), the world and the schedule these read.
"""
from __future__ import annotations

from typing import Any, Iterator, Optional

import numpy as np
import torch

from relay.kernel.session import api_distributed, data


class SessionData:
    def batch_indices(self, n_samples: int, batch_size: int, seed: Optional[int] = None, *,
                      drop_last: bool = True) -> np.ndarray:
        """The sample indices of the current step, an int64 numpy array (it indexes a tensor, an array or a
        DataFrame directly; `.tolist()` for a list): epoch e is a permutation seeded by (seed, e), so any step's
        batch costs one permutation (O(1) in the step), never a replay of the batches before it. With several
        processes, `batch_size` is the effective batch and rank r gets the r-th equal slice of it. An epoch is
        n_samples // batch_size steps: the few samples left over are dropped (others each epoch); with
        `drop_last=False` they are the epoch's last, smaller step (ceil(n_samples / batch_size) steps, a
        DataLoader's len)."""
        s = self._schedule_for(n_samples, batch_size, seed, drop_last)
        indices = data.rank_indices(s, self.book.global_step, self.world.rank, self.world.size)
        if self._trace:
            self._trace.batch(indices, self.book.global_step)
        return indices

    def _schedule_for(self, n_samples: int, batch_size: int, seed: Optional[int],
                      drop_last: bool = True) -> data.StepSchedule:
        seed = self.config.seed if seed is None else seed
        s = self._schedule
        if (s is None or s.effective_batch != batch_size or s.n_samples != n_samples or s.seed != seed
                or s.drop_last != drop_last):
            api_distributed.rank_batch(self.world, batch_size)  # checked once per schedule, not every step
            self._schedule = s = data.StepSchedule(n_samples, batch_size, seed, setting="batch_size",
                                                   drop_last=drop_last)
        return s

    def batches(self, n_samples: int, batch_size: int, seed: Optional[int] = None, *, drop_last: bool = True,
                per_epoch: bool = False) -> Iterator[np.ndarray]:
        """The current step's indices, until should_stop(); call step_done() after each. `per_epoch`: until the
        end of the epoch the current step is in, too (an epoch loop's inner loop)."""
        first = True
        while not self.should_stop():
            if per_epoch and not first and self.epoch_end:
                return
            first = False
            yield self.batch_indices(n_samples, batch_size, seed, drop_last=drop_last)

    def batch_sampler(self, n_samples: int, batch_size: int, seed: Optional[int] = None, *,
                      drop_last: bool = True, per_epoch: bool = False) -> data.RunBatchSampler:
        """A DataLoader batch_sampler, in the same step-derived order as batches(): each iteration starts at the
        session's current step. Its length is the whole run, so a trainer that owns the loop (Lightning) and
        resumes mid-"epoch" counts the remaining batches right and never starts a second pass; with `per_epoch`,
        an iteration ends at the end of the epoch it started in (an epoch loop over a DataLoader) and its length
        is the epoch's."""
        return data.RunBatchSampler(self, self._schedule_for(n_samples, batch_size, seed, drop_last), per_epoch)

    def dataloader(self, dataset, batch_size: int, *, seed: Optional[int] = None, drop_last: bool = True,
                   per_epoch: bool = True, **loader_kwargs: Any) -> data.SessionLoader:
        """`DataLoader(dataset, batch_size=..., shuffle=True)` made resumable: its batches are batch_sampler()'s
        (an iteration is the rest of the current epoch; `per_epoch=False`: the rest of the run), it ends where
        the session must stop (should_stop(), asked before each step's batch is fetched), and its iterator seed
        comes from its own generator, not the global RNG (a resumed session makes an iterator where the
        uninterrupted run did not). `loader_kwargs` go to the DataLoader (collate_fn, num_workers, pin_memory)."""
        sampler = self.batch_sampler(len(dataset), batch_size, seed, drop_last=drop_last, per_epoch=per_epoch)
        seed = self.config.seed if seed is None else seed
        return data.SessionLoader(self, torch.utils.data.DataLoader(
            dataset, batch_sampler=sampler, generator=torch.Generator().manual_seed(seed), **loader_kwargs))

    @property
    def epoch(self) -> int:
        """The epoch the next step is in (0-based: steps done // steps per epoch) of the schedule batches() or
        batch_sampler() made (0 before there is one: make the sampler before reading it)."""
        return self._schedule.epoch_of(self.step) if self._schedule else 0

    @property
    def step_in_epoch(self) -> int:
        """Steps done in the current epoch (0 at an epoch's start): a loop's `enumerate` index within its epoch."""
        return self._schedule.step_in_epoch(self.step) if self._schedule else self.step

    @property
    def steps_per_epoch(self) -> Optional[int]:
        """Steps in an epoch of the schedule batches() or batch_sampler() made (None before there is one)."""
        return self._schedule.steps_per_epoch if self._schedule else None

    @property
    def epoch_end(self) -> bool:
        """True right after the last step of an epoch (step_done() counted it): where an epoch loop evaluates."""
        return bool(self._schedule is not None and self._schedule.is_epoch_end(self.step))
