"""When must this session stop? A deadline, measured step/eval/save times, and a SIGTERM flag.

The loop asks `should_stop()` at every optimizer-step boundary: stop when the next step (plus an eval
if one is due) plus the final save, with margin, would run past the deadline. Step times are taken as the
max of the recent ones, so one slow step (a GC pause, a cache flush) does not make us overrun. The clock also
knows when training last showed a sign of life (a step, an eval batch, a save): the stall watchdog reads it
(session/watchdog.py).
"""
from __future__ import annotations

import collections
import math
import signal
import time
from typing import Optional

SAVE_SAFETY_FACTOR = 1.5  # saves vary with page cache and disk state; assume the next is 50% slower


class SessionClock:
    def __init__(
        self,
        budget: Optional[float] = None,
        deadline: Optional[float] = None,
        safety_margin: float = 60.0,
        now: Optional[float] = None,
        max_steps: Optional[int] = None,
    ):
        """`budget`: seconds from now; `deadline`: absolute unix time; the earlier one wins.
        `max_steps`: optimizer steps this session may take (a step-bounded session, whatever the speed)."""
        self.started = time.time() if now is None else now
        self._t0 = time.monotonic()
        limits = [b for b in (budget,) if b is not None]
        if deadline is not None:
            limits.append(deadline - self.started)
        self.limit: float = min(limits) if limits else math.inf
        self.safety_margin = safety_margin
        self.max_steps = max_steps
        self.steps_taken = 0
        self._step_times: collections.deque[float] = collections.deque(maxlen=20)
        self.eval_seconds = 0.0
        self.save_seconds: Optional[float] = None
        self.estimated_save_seconds = 5.0  # replaced by the first measured save
        self.stop_signal: Optional[str] = None
        self.slowest_step = 0.0  # over the whole session: the stall watchdog's yardstick
        self.last_alive = self._t0  # time.monotonic() of the last sign of progress
        self._previous_handlers: dict[int, object] = {}

    # -- time -------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return time.monotonic() - self._t0

    def remaining(self) -> float:
        return self.limit - self.elapsed()

    def record_step(self, seconds: float) -> None:
        # every step of every loop comes here (bench/bench_step_overhead.py's null step): a compare instead of
        # max() and alive() inlined, two calls fewer a step
        self._step_times.append(seconds)
        self.steps_taken += 1
        if seconds > self.slowest_step:
            self.slowest_step = seconds
        self.last_alive = time.monotonic()  # alive()

    def alive(self) -> None:
        """Training goes on (a step, an eval batch, a save): the stall watchdog counts from here."""
        self.last_alive = time.monotonic()

    def idle(self) -> float:
        """Seconds since the last sign of progress."""
        return time.monotonic() - self.last_alive

    def record_save(self, seconds: float) -> None:
        self.save_seconds = seconds if self.save_seconds is None else max(seconds, 0.5 * self.save_seconds)

    def step_estimate(self) -> float:
        return max(self._step_times) if self._step_times else 0.0

    def time_needed(self, eval_due: bool = False) -> float:
        """Seconds to finish one more step (and an eval if due) and still save before the deadline."""
        save = self.save_seconds if self.save_seconds is not None else self.estimated_save_seconds
        return (
            self.step_estimate()
            + (self.eval_seconds if eval_due else 0.0)
            + SAVE_SAFETY_FACTOR * save
            + self.safety_margin
        )

    def should_stop(self, eval_due: bool = False) -> Optional[str]:
        """The reason to stop now ("sigterm", "steps" or "budget"), or None to go on."""
        if self.stop_signal:
            return "sigterm"
        if self.max_steps is not None and self.steps_taken >= self.max_steps:
            return "steps"
        if self.remaining() < self.time_needed(eval_due):
            return "budget"
        return None

    # -- signals ----------------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        """SIGTERM (Kaggle and the emulator send it at the limit) and a first Ctrl-C mean: finish the
        current step, save, exit 0. A second Ctrl-C interrupts at once."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous_handlers[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread (e.g. inside a test runner thread)
                pass

    def restore_signal_handlers(self) -> None:
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers.clear()

    def _on_signal(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and self.stop_signal:
            raise KeyboardInterrupt
        self.stop_signal = signal.Signals(signum).name
