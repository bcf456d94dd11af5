"""Stop a session whose loss blows up, while there is still quota to save (session.stop_on_divergence).

Kaggle cannot stop a running session from outside, so the session stops itself: a loss above `factor` x the
median of the last `window` finite losses for `patience` steps in a row (after `warmup` losses), or not finite
for as many steps, ends the session with stop reason "diverged"; it saves, and the relay hands that checkpoint
over and stops with the reason instead of pushing another session. A pure function of the step losses, so a
resumed run decides as an uninterrupted one would (the window restarts with each session)."""
from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Optional


class DivergenceGuard:
    def __init__(self, factor: float = 10.0, window: int = 50, patience: int = 3, warmup: int = 20):
        self.factor, self.patience, self.warmup = factor, patience, warmup
        self._losses: deque = deque(maxlen=window)
        self._strikes = 0

    def update(self, step: int, loss: float) -> Optional[str]:
        """The reason in words when the session must stop at this step, else None."""
        loss = float(loss)
        high = (not math.isfinite(loss) or (len(self._losses) >= self.warmup
                                             and loss > self.factor * statistics.median(self._losses)))
        self._strikes = self._strikes + 1 if high else 0
        if math.isfinite(loss) and not high:
            self._losses.append(loss)
        if self._strikes < self.patience:
            return None
        base = f"{statistics.median(self._losses):.4g}" if self._losses else "none yet"
        return (f"the loss diverged at step {step}: {loss:.4g} for {self.patience} steps in a row, over"
                f" {self.factor:g}x the median of the recent losses ({base})")
