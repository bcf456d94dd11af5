"""The per-step books of one session, the Session's (session/api.py), whichever loop drives it (a script's, an
integration's, the built-in Trainer's, relay/kernel/trainer.py): the step times and samples (the clock's step time,
samples/s), the logging window of losses, the divergence guard's wiring (session/divergence.py) and the
insurance-save timer, with what of them goes into the checkpoint's `relay` dict.

A loss is kept as given (a device tensor unread) with its step and its phase (what the guard compares it within: a
stage of the Trainer's, None for a script), so a step costs no host-device sync. In one process a log step only
starts the window's read (`close_window`: a CUDA window is copied into pinned memory behind the step's kernels, with
an event) and the window is judged and logged at the next step (`take_closed`), when the copy is long done: the host
never waits for the step it just queued (on an H200, a hand-written loop that read a 10-step window at its log step
ran 1.4 % slower at 1.7 ms steps and 2.9 % at 1.3 ms than one that read nothing, 0.5 % and 2.8 % when it copied the
window without a wait and read it later; bench/step_split.py). With several processes the window is read at its log
step (`end_window`) and its mean agreed on by every rank, not judged.

Judging a window takes its losses in step order. A loop that skips a step whose loss is not finite (the Trainer:
its fused optimizer or GradScaler skip it on the device) gives `on_loss`: each loss goes to it first (the Session
counts the skips there), and a non-finite one then stays out of the mean and the guard.

One set of keys in the checkpoint: `window_losses`, `window_steps`, `window_phases`, `divergence` (None without a
guard) and, while a closed window waits for its judging, `closed_*`. A checkpoint written before a key was saved
(the Trainer's older books held `window_losses` and `divergence` alone under several processes) reads as: one loss
a step up to the checkpoint's step, in the phase of the loss added next, no closed window, a fresh guard history.
The unjudged windows and the guard's history are part of the run's exact state: a run split into sessions logs the
uninterrupted run's means and stops, or not, at its step.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from relay.kernel.session.budget import SessionClock
from relay.kernel.session.divergence import DivergenceGuard

KEYS = ("window_losses", "window_steps", "window_phases", "closed_at", "closed_losses", "closed_steps",
        "closed_phases", "closed_metrics", "closed_logged", "divergence")  # the books' keys in the `relay` dict
UNKNOWN = object()  # the phase of a loss restored from a checkpoint that kept none: the next loss's


@dataclass
class ClosedWindow:
    """A window closed at its log step, its read under way, judged and logged at the next step."""

    at: int  # the log step
    steps: list[int]
    losses: Any  # floats, or (pinned host tensor, CUDA event) while the copy is in flight
    metrics: dict = field(default_factory=dict)  # what the script gave step_done() at the log step
    logged: bool = False  # its metrics.jsonl line is written (a save writes it before its checkpoint)
    phases: list = field(default_factory=list)
    measured: dict = field(default_factory=dict, compare=False)  # this process's (samples/s, memory): not saved

    def read(self) -> list[float]:
        if isinstance(self.losses, tuple):
            host, done = self.losses
            done.synchronize()  # the copy was queued a step ago: done, unless the GPU runs a step behind
            self.losses = host.tolist()
        return self.losses


class StepBooks:
    def __init__(self, clock: SessionClock, save_every: float, *, guard: bool,
                 on_loss: Optional[Callable[[int, float], None]] = None):
        """`on_loss(step, loss)`: a loop that skips a step whose loss is not finite gets each loss as it is judged,
        in step order; its non-finite ones then stay out of the mean and the guard."""
        self.clock, self.save_every, self.on_loss = clock, float(save_every), on_loss
        self.guard = DivergenceGuard() if guard else None
        self.diverged: Optional[str] = None  # why the session stops itself on a diverging loss
        self.losses: list = []  # the losses since the last log step, as given (device tensors unread)
        self.steps: list[int] = []  # the step of each, what the guard's reason names
        self.phases: list = []  # the phase of each, which the guard compares within
        self.closed: Optional[ClosedWindow] = None  # the last log step's window, judged at the next step
        self.staging = HostStaging()  # where each closed CUDA window is copied to
        self.samples = 0  # this session's samples and training seconds: its samples/s
        self.seconds = 0.0
        self.last_save = time.monotonic()
        self.insurance_skipped = False  # once, at the step the session stops after: its final save covers it

    # -- speed ------------------------------------------------------------------------------------------
    def count(self, seconds: float, samples: Optional[int]) -> None:
        """One optimizer step took `seconds` (on the clock too: it plans the stop) over `samples` (None: unknown)."""
        self.clock.record_step(seconds)
        self.seconds += seconds
        if samples:
            self.samples += samples

    def samples_per_s(self) -> Optional[float]:
        """Unknown (None) until a step counted its samples."""
        return self.samples / self.seconds if self.seconds and self.samples else None

    # -- the loss window --------------------------------------------------------------------------------
    def add_loss(self, step: int, loss: Any, phase: Optional[str] = None) -> None:
        """The loss of `step` (the step count after it), kept as given until its window is read and judged."""
        if self.phases and self.phases[-1] is UNKNOWN:
            self.phases = [phase if p is UNKNOWN else p for p in self.phases]
        self.losses.append(loss)
        self.steps.append(step)
        self.phases.append(phase)

    def end_window(self, judge: bool = True) -> list[float]:
        """A log step read now (several processes): the losses kept (one device read, judged) and a new window;
        the guard judges them unless `judge` is False (several processes: agreed on, not judged)."""
        losses, steps, phases = read_losses(self.losses), self.steps, self.phases
        self.losses, self.steps, self.phases = [], [], []
        return self._judge(steps, losses, phases, judge)

    def close_window(self, step: int, metrics: dict, measured: Optional[dict] = None) -> None:
        """A log step in one process: the window's read starts, without a wait; take_closed() at the next step
        judges it."""
        if self.closed is not None:  # read before its staging buffer is reused (step_done reads it first anyway)
            self.closed.read()
        self.closed = ClosedWindow(step, self.steps, start_read(self.losses, self.staging), metrics,
                                   phases=self.phases, measured=measured or {})
        self.losses, self.steps, self.phases = [], [], []

    def take_closed(self, judge: bool = True) -> ClosedWindow:
        """The closed window, read (waiting only for a copy not yet done) and judged: given to `on_loss`, and to
        the guard unless `judge` is False."""
        window, self.closed = self.closed, None
        self._judge(window.steps, window.read(), window.phases, judge)
        return window

    def kept(self, losses: list[float]) -> list[float]:
        """The losses a window's mean is over: the finite ones for a loop that skips the others, else all."""
        return losses if self.on_loss is None else [x for x in losses if math.isfinite(x)]

    def _judge(self, steps: list[int], losses: list[float], phases: list, guard: bool) -> list[float]:
        """The losses in step order to `on_loss`, then the kept ones to the guard (within their phase) until the
        run diverges; returns the kept ones."""
        hook = self.on_loss
        for step, loss, phase in zip(steps, losses, phases):
            if hook is not None:
                hook(step, loss)
                if not math.isfinite(loss):
                    continue
            if guard and self.guard is not None and self.diverged is None:
                self.diverged = self.guard.update(step, loss, phase=None if phase is UNKNOWN else phase)
        return self.kept(losses)

    # -- the insurance save -----------------------------------------------------------------------------
    def insurance_due(self) -> bool:
        """A periodic save is due (session.save_every since the last one): insurance against a SIGKILL."""
        return time.monotonic() - self.last_save >= self.save_every

    def insure_now(self, stopping: bool) -> bool:
        """Take the due insurance save now? Not at the step the session stops after (its final save holds what
        the loop runs after the step, an eval's RNG draws included); skipped once, so a loop that goes on past
        that stop is insured again."""
        if not stopping or self.insurance_skipped:
            return True
        self.insurance_skipped = True
        return False

    def saved(self) -> None:
        self.last_save = time.monotonic()

    # -- the checkpoint ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What goes into the checkpoint's `relay` dict. The window not yet logged and judged is read now (a save
        waits for the device anyway) and kept read: a session resumed inside it logs the uninterrupted run's
        mean, and its guard judges the same losses."""
        self.losses = read_losses(self.losses)
        unknown = bool(self.phases) and self.phases[0] is UNKNOWN  # restored without phases, none added since
        return {"window_losses": list(self.losses), "window_steps": list(self.steps),
                "window_phases": [] if unknown else list(self.phases),
                **(_closed_state(self.closed) if self.closed is not None else {}),
                "divergence": self.guard.state_dict() if self.guard is not None else None}

    def load_state_dict(self, relay: dict) -> None:
        """From the checkpoint's `relay` dict (at its `global_step`), whichever keys of KEYS it holds."""
        self.losses = list(relay.get("window_losses") or [])
        if self.guard is not None:
            self.guard.load_state_dict(relay.get("divergence"))
        step, n = int(relay.get("global_step", 0)), len(self.losses)
        self.steps = list(relay.get("window_steps") or range(step - n + 1, step + 1))
        phases = list(relay.get("window_phases") or [])
        self.phases = phases if len(phases) == n else [UNKNOWN] * n
        self.closed = None
        if relay.get("closed_at") is not None:
            steps = list(relay["closed_steps"])
            self.closed = ClosedWindow(int(relay["closed_at"]), steps, list(relay["closed_losses"]),
                                       dict(relay.get("closed_metrics") or {}), bool(relay.get("closed_logged")),
                                       list(relay.get("closed_phases") or [None] * len(steps)))


def _closed_state(closed: ClosedWindow) -> dict:
    """A closed window in the checkpoint, read (a save waits for the device anyway), its metrics as numbers."""
    return {"closed_at": closed.at, "closed_losses": list(closed.read()), "closed_steps": list(closed.steps),
            "closed_phases": [None if p is UNKNOWN else p for p in closed.phases],
            "closed_metrics": {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in closed.metrics.items()},
            "closed_logged": closed.logged}


def start_read(values: list, staging: Optional["HostStaging"] = None) -> Any:
    """Begin reading a window off the device: one-element CUDA tensors on one device are stacked and copied into
    pinned host memory behind the kernels queued so far, with an event recorded after the copy (ClosedWindow.read
    waits on it); anything else is read now, which waits for nothing (CPU tensors, floats). `staging`: the pinned
    buffer and event to reuse (one a session), else fresh ones."""
    try:
        flat = torch.stack(values) if values else None
    except (TypeError, RuntimeError):  # not all tensors, or on several devices, or of several shapes
        flat = None
    if flat is None or flat.numel() != len(values):
        return read_losses(values)
    if not flat.is_cuda:
        return flat.reshape(-1).tolist()
    return (staging or HostStaging()).copy(flat.reshape(-1))


class HostStaging:
    """One pinned host buffer and one CUDA event, reused by every window a session reads (one is in flight at a
    time: the step after a log step reads it, before the next log step closes another). `.to("cpu",
    non_blocking=True)` would take a block from the caching host allocator at each window, which queries its
    pending events on the way in and records one on the way out, and a new event would be created each time. What
    that saves was not timed apart: with it, a window's close still cost ~210 us of host time on an H200 (an ad hoc
    timer; docs/benchmarks.md), the stack, the copy and the event record left."""

    def __init__(self):
        self.buffer: Optional[torch.Tensor] = None
        self.event: Optional[Any] = None
        self.device: Optional[torch.device] = None

    def copy(self, flat: torch.Tensor) -> tuple:
        """(a pinned host view that will hold `flat`, the event recorded after its copy)."""
        n = flat.numel()
        if self.buffer is None or self.buffer.numel() < n or self.buffer.dtype != flat.dtype or \
                self.device != flat.device:
            self.buffer = torch.empty(max(n, 64), dtype=flat.dtype, pin_memory=True)
            self.event, self.device = torch.cuda.Event(), flat.device
        host = self.buffer[:n]
        host.copy_(flat, non_blocking=True)
        self.event.record(torch.cuda.current_stream(flat.device))
        return host, self.event


def read_losses(values: list) -> list[float]:
    """The losses as floats, in one device read when they are one-element tensors on one device (loss.detach() of
    each step): one sync per window instead of one per loss. Exactly the values float() gives each: .tolist() reads
    the stacked dtype, and stacking only widens (bf16 beside fp32 -> fp32), so the logged mean and the guard's
    decisions do not change with the read. The checks are torch.stack's own (asking each tensor its device, dtype
    and shape cost 3x the stack at a 10-step window); the rare mixed window (floats restored from a checkpoint,
    or given by the script, beside tensors) takes its tensors in one read too."""
    if not values:
        return []
    try:
        flat = torch.stack(values).reshape(-1)  # a loss not detached adds a node freed at once: no no_grad() (2 us)
        if flat.numel() == len(values):
            return flat.tolist()
    except (TypeError, RuntimeError):  # not all tensors, or on several devices, or of several shapes
        pass
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if 1 < len(tensors) < len(values):
        read = iter(read_losses(tensors))
        return [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]
    return [float(v) for v in values]  # a loss of several elements fails here, as float(loss) always did
