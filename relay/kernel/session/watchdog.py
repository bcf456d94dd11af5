"""The stall watchdog: a session whose training shows no sign of progress for `session.stall_after` ends itself.

A hung data loader, a collective that never returns or a deadlock in a user's loop cannot save and never
reaches the next stop check: without this, such a session burns GPU quota until Kaggle's session timeout. A
daemon thread waits until the clock's last sign of progress (a step, an eval batch, a save:
SessionClock.alive) is `limit()` seconds old, then calls `on_stall(idle seconds)` once, which records the stall
and exits the process (relay/kernel/session/core.py). It wakes only when a stall could be due, never polls.
"""
from __future__ import annotations

import threading
from typing import Callable, Optional, Union

from relay.kernel.session.budget import SAVE_SAFETY_FACTOR, SessionClock

STALLED_EXIT = 75  # sysexits' EX_TEMPFAIL: a temporary failure, worth another try (the relay retries it)
STALL_FLOOR_S = 600.0  # `auto` never calls a stall before 10 minutes without progress, nor any setting before
                       # the session's first step (it builds the trainer, compiles, starts the loader's workers)
STALL_STEP_FACTOR = 20  # ... nor before 20 times the slowest step seen (a first step compiles, warms caches)
STALL_SAVE_FACTOR = 2 * SAVE_SAFETY_FACTOR  # ... nor before 3 times the save time (a waited save is one sign)


def stall_limit(setting: Union[str, float, None], clock: SessionClock) -> Optional[float]:
    """Seconds without progress that make a stall: the spec's duration, `auto` from the measured times, None
    when the watchdog is off."""
    if setting is None:
        return None
    if setting != "auto":
        return float(setting)
    save = clock.save_seconds if clock.save_seconds is not None else clock.estimated_save_seconds
    return max(STALL_FLOOR_S, STALL_STEP_FACTOR * clock.slowest_step, STALL_SAVE_FACTOR * save)


class StallWatchdog:
    def __init__(self, clock: SessionClock, setting: Union[str, float, None], on_stall: Callable[[float], None]):
        self.clock, self.setting, self.on_stall = clock, setting, on_stall
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="relay-stall-watchdog", daemon=True)

    def start(self) -> "StallWatchdog":
        if self.setting is not None:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        while True:
            limit = stall_limit(self.setting, self.clock)  # read again each time: the measured times grow
            due = limit if self.clock.steps_taken else max(limit, STALL_FLOOR_S)
            idle = self.clock.idle()
            if idle >= due:
                break
            if self._stopped.wait(min(due - idle, limit)):  # a first step soon makes `limit` the bound
                return
        if not self._stopped.is_set():
            self.on_stall(idle)
