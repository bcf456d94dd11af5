"""The training loop of one session: optimizer steps until the clock says stop or the work is done.

Everything that changes during training is either in `TrainState` (saved as plain data) or derived from
`state.global_step` (data position, epoch, learning rate), so a checkpoint taken at any optimizer-step
boundary resumes bit-identically: the same model, optimizer, scheduler, scaler and RNG states, the same
next batch. Saves happen only at optimizer-step boundaries, so no half-accumulated gradient is ever lost.
"""
from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from relay.recipes.base import Recipe
from relay.session import data, memory
from relay.session.budget import SessionClock
from relay.spec import RunSpec

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    pass


@dataclass
class TrainState:
    """What the loop carries across sessions besides tensors. Plain data: JSON and weights_only safe."""

    global_step: int = 0
    micro_batch: int = 8  # may shrink after an OOM; carried to the next session
    grad_accum: int = 1
    precision: str = "fp32"  # resolved; falls back to fp32 after repeated non-finite losses
    nonfinite_streak: int = 0
    skipped_steps: int = 0
    best: Optional[dict] = None  # {"metric", "value", "step"}
    last_eval: dict = field(default_factory=dict)
    threads: int = 1
    sessions: list = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainState":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def resolve_precision(requested: str, device: torch.device) -> str:
    if device.type == "cuda":
        if requested == "auto":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return requested
    if requested == "fp16":
        log.warning("optim.precision: fp16 needs CUDA; training in fp32 on %s", device)
    # bf16 autocast runs on CPU (slowly, ~10x here), so it is honoured only when asked for by name.
    return "bf16" if requested == "bf16" else "fp32"


def rng_state(device: torch.device) -> dict:
    state = {
        "torch": torch.get_rng_state(),
        "python": _python_rng_to_plain(random.getstate()),
        "numpy": _numpy_rng_to_plain(np.random.get_state()),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _python_rng_to_plain(s: tuple) -> list:
    return [s[0], list(s[1]), s[2]]


def _numpy_rng_to_plain(s: tuple) -> list:
    # np.random.get_state() holds an ndarray, which torch.load(weights_only=True) refuses.
    return [s[0], torch.from_numpy(s[1].astype(np.int64)), int(s[2]), int(s[3]), float(s[4])]


def lr_lambda(schedule: str, warmup: int, total: int) -> Callable[[int], float]:
    """The learning-rate multiplier as a pure function of the optimizer step."""

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_optimizer(model: nn.Module, spec: RunSpec, device: torch.device) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    groups = [{"params": decay, "weight_decay": spec.optim.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    fused = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=spec.optim.lr, **fused)


class Trainer:
    def __init__(self, spec: RunSpec, recipe: Recipe, model: nn.Module, device: torch.device,
                 clock: SessionClock, state: TrainState, *, total_steps: int,
                 schedule: data.StepSchedule, log_metrics: Callable[[dict], None],
                 save: Callable[[str], None]):
        self.spec, self.recipe, self.model, self.device, self.clock = spec, recipe, model, device, clock
        self.state, self.total_steps, self.schedule = state, total_steps, schedule
        self.log_metrics, self._save = log_metrics, save
        self.optimizer = build_optimizer(model, spec, device)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(spec.optim.schedule, spec.optim.warmup_steps, total_steps))
        self.scaler = self._new_scaler()
        self.monitor = memory.MemoryMonitor(device)
        self.train_set = recipe.train_dataset()
        self._batches: Optional[Iterator] = None
        self._last_save = time.monotonic()
        self.session_samples = 0
        self.train_seconds = 0.0
        self._recent_losses: list[float] = []

    # -- state ----------------------------------------------------------------------------------
    def _new_scaler(self) -> torch.amp.GradScaler:
        enabled = self.state.precision == "fp16" and self.device.type == "cuda"
        return torch.amp.GradScaler(self.device.type, enabled=enabled)

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": rng_state(self.device),
            "trainer": asdict(self.state),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.model.load_state_dict(sd["model"])
        self.optimizer.load_state_dict(sd["optimizer"])  # optimizer before scheduler
        self.scheduler.load_state_dict(sd["scheduler"])
        self.scaler = self._new_scaler()
        if sd["scaler"]:
            self.scaler.load_state_dict(sd["scaler"])
        set_rng_state(sd["rng"], self.device)

    # -- the loop -------------------------------------------------------------------------------
    def preflight(self) -> dict:
        """One forward/backward at the working micro-batch before training, so an OOM shows (and is backed
        off) now rather than hours in, and the memory it took is reported against the device. It leaves no
        trace: RNG forked, buffers restored, gradients dropped, no optimizer step."""
        st = self.state
        if st.global_step >= self.total_steps:
            return {}
        buffers = {name: b.detach().clone() for name, b in self.model.named_buffers()}
        self._step_rng = self._torch_rng()  # what a back-off restores
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        while True:
            idx = self.schedule.indices(st.global_step)[: st.micro_batch]
            batch = data.to_device(self.recipe.collate([self.train_set[i] for i in idx]), self.device, False)
            try:
                with torch.random.fork_rng(devices=devices), self._autocast():
                    self.recipe.loss(self.model, batch).backward()
                break
            except Exception as err:  # noqa: BLE001 - only OOM is handled
                if not memory.is_oom(err):
                    raise
                self._back_off(err)
            finally:
                self.optimizer.zero_grad(set_to_none=True)
                with torch.no_grad():
                    for name, b in self.model.named_buffers():
                        b.copy_(buffers[name])
        sample = self.monitor.sample()
        used = (f"GPU peak {self.monitor.peak_mb():.0f} MB" if self.device.type == "cuda"
                else f"RSS {sample['rss_mb']:.0f} MB, RAM {sample['ram_pct']:.0f} %")
        log.info("pre-flight at micro-batch %d x %d: %s on %s", st.micro_batch, st.grad_accum, used,
                 memory.describe_device(self.device))
        return sample

    def fit(self) -> str:
        """Train until done or told to stop; returns "done", "budget", "steps" or "sigterm"."""
        self.model.train()
        st = self.state
        bar = tqdm(total=self.total_steps, initial=st.global_step, desc=f"session {st.sessions[-1]['index']}",
                   unit="step", dynamic_ncols=True, mininterval=1.0)
        try:
            while st.global_step < self.total_steps:
                reason = self.clock.should_stop(eval_due=self._eval_due(st.global_step + 1))
                if reason:
                    return reason
                try:
                    loss = self._step()
                except Exception as err:  # noqa: BLE001 - only OOM is handled, the rest re-raised
                    if not memory.is_oom(err):
                        raise
                    self._back_off(err)
                    continue
                self._after_step(loss)
                bar.update(1)
                if st.global_step % self.spec.optim.log_every_steps == 0:  # ~40 us: not every step
                    bar.set_postfix(loss=f"{loss:.4f}", left=f"{self.clock.remaining():.0f}s", refresh=False)
            return "done"
        finally:
            bar.close()

    def _step(self) -> float:
        """One optimizer step over `grad_accum` micro-batches. Returns the mean loss."""
        st, opt = self.state, self.optimizer
        if self._batches is None:
            self._batches = iter(self._loader(st.global_step))
        self._step_rng = self._torch_rng()  # an OOM retry replays the same dropout masks
        t0 = time.perf_counter()
        total = torch.zeros((), device=self.device)
        for _ in range(st.grad_accum):
            batch = data.to_device(next(self._batches), self.device, self.spec.data.non_blocking)
            with self._autocast():
                loss = self.recipe.loss(self.model, batch)
            total += loss.detach().float()
            self.scaler.scale(loss / st.grad_accum).backward()
        mean_loss = (total / st.grad_accum).item()  # the one host sync per optimizer step
        if math.isfinite(mean_loss):
            st.nonfinite_streak = 0
            if self.spec.optim.clip_grad_norm:
                self.scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.optim.clip_grad_norm)
            self.scaler.step(opt)
            self.scaler.update()
        else:
            self._non_finite(mean_loss)
        self.scheduler.step()  # per optimizer step, skipped or not: lr stays a function of the step
        opt.zero_grad(set_to_none=True)
        st.global_step += 1
        seconds = time.perf_counter() - t0
        self.clock.record_step(seconds)
        self.train_seconds += seconds
        self.session_samples += self.schedule.effective_batch
        return mean_loss

    def _after_step(self, loss: float) -> None:
        st, spec = self.state, self.spec
        if math.isfinite(loss):
            self._recent_losses.append(loss)
        if st.global_step % spec.optim.log_every_steps == 0 or st.global_step == self.total_steps:
            self._log_train()
        every = spec.session.empty_cache_every_steps
        if every and self.device.type == "cuda" and st.global_step % every == 0:
            memory.free_cached(self.device)
        if self._eval_due(st.global_step):
            improved = self.evaluate()
            if improved and spec.checkpoints.keep_best:
                self.save("best")
                return
        if time.monotonic() - self._last_save >= spec.session.save_every:
            self.save("periodic")

    def _log_train(self) -> None:
        st = self.state
        record = {
            "kind": "train", "step": st.global_step, "epoch": self.schedule.epoch_of(max(0, st.global_step - 1)),
            "loss": sum(self._recent_losses) / max(1, len(self._recent_losses)),
            "lr": self.scheduler.get_last_lr()[0],
            "samples_per_s": self.session_samples / max(1e-9, self.train_seconds),
            "micro_batch": st.micro_batch, "grad_accum": st.grad_accum,
        }
        if st.global_step % self.spec.session.memory_log_every_steps == 0:
            record.update(self.monitor.sample())
        self._recent_losses.clear()
        self.log_metrics(record)

    def save(self, reason: str) -> None:
        t0 = time.perf_counter()
        self._save(reason)
        self.clock.record_save(time.perf_counter() - t0)
        self._last_save = time.monotonic()

    # -- eval -----------------------------------------------------------------------------------
    def _eval_due(self, step: int) -> bool:
        every = self.spec.optim.eval_every_steps
        due = step % every == 0 if every else self.schedule.is_epoch_end(step)
        return due or step == self.total_steps

    def evaluate(self) -> bool:
        """Eval without touching the training RNG; returns whether the watched metric improved."""
        t0 = time.perf_counter()
        loader = data.eval_loader(self.recipe.eval_dataset(), self.recipe.collate, self.spec.optim.eval_batch,
                                  0, False, seed=self.spec.seed)
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad(), self._autocast():
            self.model.eval()
            try:
                batches = (data.to_device(b, self.device, self.spec.data.non_blocking) for b in loader)
                metrics = {k: float(v) for k, v in self.recipe.evaluate(self.model, batches).items()}
            finally:
                self.model.train()
        self.clock.eval_seconds = max(self.clock.eval_seconds, time.perf_counter() - t0)
        st = self.state
        st.last_eval = {"step": st.global_step, **metrics}
        self.log_metrics({"kind": "eval", "step": st.global_step, **metrics})
        name, mode = self.recipe.metric, self.recipe.metric_mode
        value = metrics.get(name)
        if value is None or not math.isfinite(value):
            return False
        better = st.best is None or (value < st.best["value"] if mode == "min" else value > st.best["value"])
        if better:
            st.best = {"metric": name, "value": value, "step": st.global_step}
        return better

    # -- failure handling -----------------------------------------------------------------------
    def _non_finite(self, loss: float) -> None:
        st = self.state
        st.nonfinite_streak += 1
        st.skipped_steps += 1
        log.warning("non-finite loss %s at step %d: step skipped (%d in a row)", loss, st.global_step,
                    st.nonfinite_streak)
        if st.nonfinite_streak < self.spec.optim.nonfinite_patience:
            return
        if st.precision == "fp32":
            raise NonFiniteLossError(
                f"loss was non-finite for {st.nonfinite_streak} steps in a row in fp32 at step {st.global_step};"
                " lower optim.lr or check the data")
        log.warning("falling back from %s to fp32 after %d non-finite losses (seed 003)", st.precision,
                    st.nonfinite_streak)
        st.precision, st.nonfinite_streak = "fp32", 0
        self.scaler = self._new_scaler()

    def _back_off(self, err: BaseException) -> None:
        st = self.state
        smaller = memory.back_off(st.micro_batch, st.grad_accum)
        if smaller is None:
            raise err
        log.warning("out of memory at micro-batch %d: retrying step %d with micro-batch %d x accumulation %d",
                    st.micro_batch, st.global_step, *smaller)
        st.micro_batch, st.grad_accum = smaller
        self.optimizer.zero_grad(set_to_none=True)
        torch.set_rng_state(self._step_rng[0])
        if self._step_rng[1] is not None:
            torch.cuda.set_rng_state_all(self._step_rng[1])
        self._batches = None  # rebuilt at the same step with the new micro-batch
        memory.free_cached(self.device)

    # -- helpers --------------------------------------------------------------------------------
    def _torch_rng(self) -> tuple:
        """The generators a forward/backward draws from (dropout): ~3 us, against ~150 us for the full
        rng_state (numpy's get_state dominates), taken every step. Recipes keep numpy/python randomness
        out of loss(), deriving it from (seed, epoch, index) in their datasets."""
        return torch.get_rng_state(), (torch.cuda.get_rng_state_all() if self.device.type == "cuda" else None)

    def _autocast(self):
        if self.state.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.float16 if self.state.precision == "fp16" else torch.bfloat16
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def _loader(self, start_step: int):
        d = self.spec.data
        sampler = data.MicroBatchSampler(self.schedule, start_step, self.total_steps, self.state.micro_batch)
        pin = (self.device.type == "cuda") if d.pin_memory == "auto" else d.pin_memory
        return data.make_loader(self.train_set, sampler, self.recipe.collate, num_workers=d.num_workers,
                                pin_memory=pin, prefetch_factor=d.prefetch_factor,
                                persistent_workers=d.persistent_workers, seed=self.spec.seed + start_step)
