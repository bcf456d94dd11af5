"""The per-step books of one session, the Session's (session/api.py), whether a user's loop or the built-in
Trainer (session/loop.py) drives it: the step times and samples (the clock's step time, samples/s), the
logging window of losses, the divergence guard's wiring (session/divergence.py) and the insurance-save timer,
with what of them goes into the checkpoint's `relay` dict.

The loss reaches the books in one of two modes, each with its own keys in the checkpoint:

- "window" (a script's loop, and the built-in Trainer in one process): the loss is kept as given, a device
  tensor unread, and the window is read off the device at once at a log step, so a step costs no host-device
  sync; there the Session API's guard judges it (`update_many`), and the Trainer counts its non-finite skips and
  judges each loss within its phase (take_window, judge). The checkpoint holds `window_losses`, `window_steps`,
  the Trainer's `window_phases` and, with a guard, `divergence`.
  A script's loop in one process (Session.step_done) goes one step further: its log step only starts the read
  (`close_window`: a CUDA window is copied into pinned memory behind the step's kernels, with an event) and the
  window is judged and logged at the next step (`take_closed`), when the copy is long done: the host never waits
  for the step it just queued (on an H200, a hand-written loop that read a 10-step window at its log step ran 1.4 %
  slower at 1.7 ms steps and 2.9 % at 1.3 ms than one that read nothing, 0.5 % and 2.8 % when it copied the window
  without a wait and read it later; bench/step_split.py). The closed window and whether its line is written yet go
  into the checkpoint too (`closed_*`); a save or an explicit log writes its line first.
- "step" (the Trainer with several processes): the loss is a float every rank agreed on, added as it comes (no
  guard judges it); the checkpoint holds `window_losses` and `divergence` (None).

Either way the guard's history and the unjudged window are part of the run's exact state: a run split into
sessions logs the uninterrupted run's means and stops, or not, at its step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from relay.kernel.session.budget import SessionClock
from relay.kernel.session.divergence import DivergenceGuard

MODES = ("step", "window")
KEYS = ("window_losses", "window_steps", "window_phases", "closed_at", "closed_losses", "closed_steps",
        "closed_metrics", "closed_logged", "divergence")  # what the books own in the checkpoint's `relay` dict


@dataclass
class ClosedWindow:
    """A window closed at its log step, its read under way, judged and logged at the next step."""

    at: int  # the log step
    steps: list[int]
    losses: Any  # floats, or (pinned host tensor, CUDA event) while the copy is in flight
    metrics: dict = field(default_factory=dict)  # what the script gave step_done() at the log step
    logged: bool = False  # its metrics.jsonl line is written (a save writes it before its checkpoint)

    def read(self) -> list[float]:
        if isinstance(self.losses, tuple):
            host, done = self.losses
            done.synchronize()  # the copy was queued a step ago: done, unless the GPU runs a step behind
            self.losses = host.tolist()
        return self.losses


class StepBooks:
    def __init__(self, clock: SessionClock, save_every: float, *, guard: bool, mode: str):
        if mode not in MODES:
            raise ValueError(f"StepBooks mode {mode!r}: one of {MODES}")
        self.clock, self.save_every, self.mode = clock, float(save_every), mode
        self.guard = DivergenceGuard() if guard else None
        self.diverged: Optional[str] = None  # why the session stops itself on a diverging loss
        self.losses: list = []  # the losses since the last log step ("window": as given, device tensors unread)
        self.steps: list[int] = []  # "window": the step of each, what the guard's reason names
        self.phases: list = []  # "window" given phases (the Trainer's): the phase of each, which the guard compares within
        self.closed: Optional[ClosedWindow] = None  # the Session API's last log step's window, judged at the next step
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
        """The loss of `step`. "step": a float, judged now (within `phase`: a stage's losses compare only with
        each other); "window": kept as given until the log step reads and judges it."""
        self.losses.append(loss)
        if self.mode == "window":
            self.steps.append(step)
            if phase is not None:
                self.phases.append(phase)
        else:
            self.judge(step, loss, phase)

    def end_window(self, judge: bool = True) -> list[float]:
        """A log step: the window's losses as floats (one device read) and a new window. "window" mode judges them
        here unless `judge` is False (several processes: the losses are agreed on, not judged)."""
        losses, steps = read_losses(self.losses) if self.mode == "window" else self.losses, self.steps
        self.losses, self.steps, self.phases = [], [], []
        if judge and self.mode == "window":
            self._judge_many(steps, losses)
        return losses

    def close_window(self, step: int, metrics: dict) -> None:
        """A log step of a script's loop: the window's read starts, without a wait; take_closed() at the next step
        judges it."""
        if self.closed is not None:  # read before its staging buffer is reused (step_done reads it first anyway)
            self.closed.read()
        self.closed = ClosedWindow(step, self.steps, start_read(self.losses, self.staging), metrics)
        self.losses, self.steps, self.phases = [], [], []

    def take_closed(self, judge: bool = True) -> ClosedWindow:
        """The closed window, read (waiting only for a copy not yet done) and judged by the guard."""
        window, self.closed = self.closed, None
        if judge:
            self._judge_many(window.steps, window.read())
        return window

    def _judge_many(self, steps: list[int], losses: list[float]) -> None:
        if losses and self.guard is not None and self.diverged is None:
            self.diverged = self.guard.update_many(steps, losses)

    def take_window(self, phase: Optional[str] = None) -> list[tuple[int, float, Optional[str]]]:
        """"window": the window read off the device at once, each loss with its step and phase, in step order, and
        a new window; the caller judges them (judge()). A window saved before phases were kept takes `phase`."""
        losses = read_losses(self.losses)
        phases = self.phases if len(self.phases) == len(losses) else [phase] * len(losses)
        window = list(zip(self.steps, losses, phases))
        self.losses, self.steps, self.phases = [], [], []
        return window

    def judge(self, step: int, loss: float, phase: Optional[str] = None) -> None:
        """One finite loss to the divergence guard, within its phase (a stage's losses compare only with each
        other), unless the run already diverged."""
        if self.guard is not None and self.diverged is None:
            self.diverged = self.guard.update(step, loss, phase=phase)

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
        if self.mode == "window":
            self.losses = read_losses(self.losses)
        guard = self.guard.state_dict() if self.guard is not None else None
        if self.mode == "step":
            return {"window_losses": list(self.losses), "divergence": guard}
        closed = self.closed
        return {"window_losses": list(self.losses), "window_steps": list(self.steps),
                **({"window_phases": list(self.phases)} if self.phases else {}),
                **(_closed_state(closed) if closed is not None else {}),
                **({"divergence": guard} if guard is not None else {})}

    def load_state_dict(self, relay: dict) -> None:
        """From the checkpoint's `relay` dict (at its `global_step`); a checkpoint written before a key was saved
        reads as: an empty window, a fresh guard history, one loss a step up to the checkpoint's step."""
        self.losses = list(relay.get("window_losses") or [])
        if self.guard is not None:
            self.guard.load_state_dict(relay.get("divergence"))
        if self.mode == "window":
            step = int(relay.get("global_step", 0))
            self.steps = list(relay.get("window_steps") or range(step - len(self.losses) + 1, step + 1))
            self.phases = list(relay.get("window_phases") or [])
            self.closed = None if relay.get("closed_at") is None else ClosedWindow(
                int(relay["closed_at"]), list(relay["closed_steps"]), list(relay["closed_losses"]),
                dict(relay.get("closed_metrics") or {}), bool(relay.get("closed_logged")))


def _closed_state(closed: ClosedWindow) -> dict:
    """A closed window in the checkpoint, read (a save waits for the device anyway), its metrics as numbers."""
    return {"closed_at": closed.at, "closed_losses": list(closed.read()), "closed_steps": list(closed.steps),
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
