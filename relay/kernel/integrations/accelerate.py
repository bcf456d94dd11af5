"""Hugging Face Accelerate under the relay: your own loop, Accelerate's prepare/accumulate/backward, the relay's
sessions and exact resume.

    session = relay.open_session(total_steps=N)
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, optimizer, eval_dl, scheduler = accelerator.prepare(model, optimizer, eval_dl, scheduler)
    relay_acc = RelayAccelerate(accelerator, session)
    train_dl = relay_acc.train_dataloader(train_set, batch_size=32, collate_fn=collate)  # the effective batch
    relay_acc.restore()                        # the relay's newest valid checkpoint through accelerator.load_state
    for batch in train_dl:                     # micro-batches from the session's step, until it must stop
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step(); scheduler.step(); optimizer.zero_grad()
        relay_acc.step_done(loss)              # counts a step only when accelerator.sync_gradients
    session.close()

The state is Accelerate's own: `accelerator.save_state` writes the prepared models, optimizers, schedulers, the
GradScaler when there is one (fp16 on a GPU), the objects given to `register_for_checkpointing` and the
accelerator's step counter into a folder, and that folder's files are packed into the relay checkpoint (as
the HF callback packs `checkpoint-N`); a restore unpacks them and calls `accelerator.load_state`. The RNGs are
the relay's (every rank's), restored after Accelerate's.

The train loader is not `accelerator.prepare(DataLoader(...))`: Accelerate's DataLoaderShard fetches one batch
ahead, so a collate that draws random numbers (masking) would draw the next step's batch before a save and a
resumed session would draw it again; and its sharding cuts batches by process count, not by the relay's
effective batch. Here each optimizer step's samples are a pure function of the step (session.batch_sampler),
rank r takes the r-th slice, split into `gradient_accumulation_steps` micro-batches placed on
`accelerator.device`; the loader draws its seed from its own generator, never the global RNG.
"""
from __future__ import annotations

import contextlib
import logging
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from accelerate.utils import DistributedType, send_to_device

from relay.kernel.session.api import Session
from relay.shared.errors import InputError

# save_state writes these per process, and they need every rank inside the save; the relay's save runs on
# rank 0 alone, so several processes of them are refused (one process of each is saved like any other)
_ALL_RANKS_SAVE = {DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA}


# each save (insurance, final, and every step under verify-resume) would log every file it writes at INFO
_CHATTY = ("accelerate.accelerator", "accelerate.checkpointing")


@contextlib.contextmanager
def _quiet():
    levels = [(logging.getLogger(n), logging.getLogger(n).level) for n in _CHATTY]
    for logger, _ in levels:
        logger.setLevel(max(logging.WARNING, logger.level))
    try:
        yield
    finally:
        for logger, level in levels:
            logger.setLevel(level)


GRADIENTS = "relay-gradients"  # not a file: the gradients a loop holds between its micro-batches


class AccelerateState:
    """`accelerator.save_state`'s folder as registered state: its files' bytes (uint8 tensors, weights_only safe),
    keyed by their path in the folder (FSDP writes subfolders). With them, under GRADIENTS, the gradients the
    prepared models hold when the relay saves, if any: a loop that accumulates by hand (Accelerate's
    by_feature/checkpointing.py) counts each micro-batch as a relay step, so a session may end inside an
    optimizer step, and save_state keeps no gradients. Under accumulate() a step ends with zero_grad(): none."""

    def __init__(self, accelerator, workdir: Path, rank: int):
        self.accelerator = accelerator
        # per rank: under verify-resume every rank fingerprints its state each step, in the same workdir
        self.save_to = workdir / "accelerate-save" / f"rank-{rank}"
        self.restore_to = workdir / "accelerate-resume" / f"rank-{rank}"

    def state_dict(self) -> dict:
        shutil.rmtree(self.save_to, ignore_errors=True)
        config = self.accelerator.project_configuration
        iteration = config.iteration  # save_state counts its calls (automatic_checkpoint_naming): the relay's don't
        try:
            with _quiet():
                self.accelerator.save_state(str(self.save_to))
            config.iteration = iteration
            files = {f.relative_to(self.save_to).as_posix(): _as_tensor(f.read_bytes())
                     for f in sorted(self.save_to.rglob("*")) if f.is_file()}
            gradients = self._gradients()
            return {**files, GRADIENTS: gradients} if gradients else files
        finally:
            shutil.rmtree(self.save_to, ignore_errors=True)  # the relay's copy is the checkpoint

    def _parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        for i, model in enumerate(self.accelerator._models):
            for name, p in self.accelerator.unwrap_model(model).named_parameters():
                yield f"{i}.{name}", p

    def _gradients(self) -> dict:
        """The gradients held now, on the CPU (an all-zero one, as zero_grad(set_to_none=False) leaves it, adds
        nothing to the next backward that a missing one would not)."""
        return {name: p.grad.detach().to("cpu", copy=True) for name, p in self._parameters()
                if p.grad is not None and bool(p.grad.any())}

    def load_state_dict(self, files: dict) -> None:
        files = dict(files)
        gradients = files.pop(GRADIENTS, {})
        for name, p in self._parameters():
            saved = gradients.get(name)
            p.grad = None if saved is None else saved.to(p.device, p.dtype)
        shutil.rmtree(self.restore_to, ignore_errors=True)
        self.restore_to.mkdir(parents=True)
        for name, data in files.items():
            path = (self.restore_to / name).resolve()
            if not path.is_relative_to(self.restore_to.resolve()):
                raise InputError(f"accelerate state: file {name!r} lies outside its folder")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data.numpy().tobytes())
        try:
            with _quiet():
                self.accelerator.load_state(str(self.restore_to))
            self.accelerator.step = _saved_step(self.restore_to, self.accelerator.step)
        finally:
            shutil.rmtree(self.restore_to, ignore_errors=True)  # loaded: it would only count against the disk budget


def _saved_step(folder: Path, current: int) -> int:
    """The accelerator's step counter as rank 0 saved it (load_state sets it from this process's own RNG file, and
    only rank 0's files are packed): what the uninterrupted run held there, whether the loop counts micro-batches
    with accumulate() or never enters it (Accelerate's by_feature/checkpointing.py accumulates by hand)."""
    states = folder / "random_states_0.pkl"
    if not states.is_file():
        return current
    # Accelerate's own pickle (numpy RNG states), written by save_state into the relay's verified checkpoint
    saved = torch.load(states, map_location="cpu", weights_only=False)
    return int(saved.get("step", current)) if isinstance(saved, dict) else current


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class RelayAccelerate:
    def __init__(self, accelerator, session: Session, model: Optional[torch.nn.Module] = None):
        if accelerator.num_processes != session.world_size:
            raise InputError(f"Accelerator: {accelerator.num_processes} processes but the session has"
                             f" {session.world_size}: open the session first, in every process the relay starts"
                             " (session.devices)")
        if session.world_size > 1 and accelerator.distributed_type in _ALL_RANKS_SAVE:
            raise InputError(f"Accelerator: {accelerator.distributed_type.value} with {session.world_size} processes"
                             " writes its state from every rank, and the relay saves from rank 0: use DDP"
                             " (the default) or one process")
        if session.world_size > 1 and not accelerator.split_batches:
            # AcceleratedScheduler steps num_processes times per optimizer step unless batches are split: the
            # relay's batch is the effective one whatever the process count, so the schedule must not depend on it
            raise InputError(f"Accelerator(dataloader_config.split_batches=False) with {session.world_size} processes"
                             " steps the scheduler once per process per optimizer step; pass"
                             " dataloader_config=DataLoaderConfiguration(split_batches=True)")
        self.accelerator, self.session = accelerator, session
        self.state = AccelerateState(accelerator, session.workdir, session.rank)
        session.register(accelerate=self.state)
        model = model if model is not None else next(iter(accelerator._models), None)
        if model is not None:  # weights_sha256 and export/ (save_pretrained for a transformers model)
            session.weights_model = accelerator.unwrap_model(model)
        self._losses: list = []
        self._schedule = None

    @property
    def accumulation(self) -> int:
        return int(self.accelerator.gradient_accumulation_steps)

    def restore(self) -> int:
        """Restore the session (Accelerate's state through load_state, its step counter as the uninterrupted run
        held it, then the relay's RNGs); the step."""
        return self.session.restore()  # accelerator.step too: rank 0's saved counter, on every rank

    def train_dataloader(self, dataset, batch_size: int, collate_fn: Optional[Callable] = None,
                         seed: Optional[int] = None, num_workers: int = 0, *, drop_last: bool = True,
                         per_epoch: bool = False, **loader_kwargs: Any) -> "StepLoader":
        """The run's micro-batches from the session's step on, on accelerator.device, ending when the session
        must stop. `batch_size` is the effective batch of one optimizer step (micro x accumulation x processes),
        kept when the number of processes changes; the micro-batch is what is left of it per process and step.
        `drop_last` and `per_epoch` as session.batch_sampler's: with per_epoch each iteration ends at the end of
        the epoch it started in, for a loop over epochs (Accelerate's by_feature/checkpointing.py)."""
        share = batch_size // self.session.world_size
        if batch_size % self.session.world_size or share % self.accumulation:
            raise InputError(f"RelayAccelerate.train_dataloader(batch_size={batch_size}): the effective batch must be"
                             f" divisible by gradient_accumulation_steps ({self.accumulation}) x"
                             f" {self.session.world_size} processes")
        left = len(dataset) % batch_size
        if not drop_last and 0 < left < self.accumulation * self.session.world_size:
            raise InputError(f"RelayAccelerate.train_dataloader(drop_last=False): an epoch's last step would hold"
                             f" {left} samples, fewer than gradient_accumulation_steps ({self.accumulation}) x"
                             f" {self.session.world_size} processes; keep drop_last=True or change batch_size")
        steps = self.session.batch_sampler(len(dataset), batch_size, seed, drop_last=drop_last,  # per rank, from
                                           per_epoch=per_epoch)                                # session.step on
        self._schedule = steps.schedule
        sampler = MicroBatches(steps, self.accumulation)
        seed = self.session.config.seed if seed is None else seed
        # the iterator's base seed from this generator: from the global RNG it would shift dropout after a resume
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_fn,
                                             num_workers=num_workers, generator=torch.Generator().manual_seed(seed),
                                             **loader_kwargs)
        return StepLoader(self, loader)

    def step_done(self, loss: Any = None, **metrics: float) -> bool:
        """After each micro-batch: a relay step is an optimizer step, counted when accelerator.sync_gradients
        (the loss logged is the mean of its micro-batches'). True when a step was counted."""
        if loss is not None:
            self._losses.append(loss.detach() if torch.is_tensor(loss) else loss)
        if not self.accelerator.sync_gradients:
            return False
        losses, self._losses = self._losses, []
        mean = sum(float(x) for x in losses) / len(losses) if losses else None
        self.session.step_done(loss=mean, **metrics)
        return True

    @property
    def epoch_end(self) -> bool:
        """True after the last optimizer step of an epoch of the train loader (an eval goes there)."""
        return bool(self._schedule is not None and self._schedule.is_epoch_end(self.session.step))


class MicroBatches(torch.utils.data.Sampler):
    """Each optimizer step's indices (this rank's slice) as `accumulation` equal micro-batches."""

    def __init__(self, steps, accumulation: int):
        self.steps, self.accumulation = steps, accumulation

    def __iter__(self) -> Iterator[list[int]]:
        for idx in self.steps:
            micro = -(-len(idx) // self.accumulation)  # an epoch's smaller last step (drop_last=False): shorter
            for i in range(self.accumulation):       # micro-batches, the last the shortest
                yield idx[i * micro:(i + 1) * micro]

    def __len__(self) -> int:
        return len(self.steps) * self.accumulation


class StepLoader:
    """Iterating it yields the micro-batches of the remaining steps, on the accelerator's device, and ends at a
    step boundary where the session must stop (session.should_stop: budget, SIGTERM, step cap, done)."""

    def __init__(self, owner: RelayAccelerate, loader: torch.utils.data.DataLoader):
        self.owner, self.loader = owner, loader

    def __len__(self) -> int:
        """The micro-batches left in the run, or in the epoch with per_epoch (this session may stop sooner)."""
        session, steps = self.owner.session, self.loader.batch_sampler.steps
        return (steps._end(session.step) - session.step) * self.owner.accumulation

    def __iter__(self) -> Iterator[Any]:
        session, accumulation = self.owner.session, self.owner.accumulation
        device = self.owner.accelerator.device
        batches = iter(self.loader)  # here, after restore(): its sampler starts at the restored step
        done = 0
        step = session.step
        while True:
            if done % accumulation == 0:  # a step boundary
                if done and session.step != step + 1:
                    raise InputError(f"RelayAccelerate: {accumulation} micro-batches trained but the session counted"
                                     f" {session.step - step} steps: call relay_acc.step_done(loss) after each batch,"
                                     " inside accelerator.accumulate(model) when accumulating")
                step = session.step
                if session.should_stop():
                    return
            batch = next(batches, None)
            if batch is None:
                return
            yield send_to_device(batch, device)
            done += 1
