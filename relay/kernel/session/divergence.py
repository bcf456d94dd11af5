"""Stop a session whose loss blows up, while there is still quota to save (session.stop_on_divergence).

Kaggle cannot stop a running session from outside, so the session stops itself with stop reason "diverged":
it saves, and the relay hands that checkpoint over and stops with the reason instead of pushing another session.

What it judges is the smoothed loss `s`, an exponential moving average over `span` steps (a single noisy batch
moves it by 2/(span+1) of its size), against the run's own history since the guard's warmup of `span` steps:
`start` (s when the warmup ended), `best` (the lowest s since) and `noise` (the loss's standard deviation around
s, as it was when `best` was set, so a divergence cannot raise its own bar). The run diverges when

    s > best + max(rise * (start - best), noise_k * noise, floor * |best|)        for `span` steps in a row,

that is, the smoothed loss has given back half of what training gained (or, for a run that has gained little,
rose by 3 standard deviations of its noise, and by at least a tenth of itself) and stayed there. A loss that is
not finite for `nonfinite_patience` steps in a row stops at once. Noise near a loss of zero does not trigger it in
a run that got there: the bar is set by what the run gained, not by a ratio to a small number. A history that
begins already there can be (a model trained to a loss of ~1e-7 on 8 batches, then trained on in a fresh workdir:
AdamW's spikes there gave back more than its nothing gained, and bench_step_overhead's session "diverged").
Calibrated on the project's own runs (docs/benchmarks.md, `bench/bench_divergence.py`).

The guard's state is part of the run's exact state: the Session saves `state_dict()` in the checkpoint and loads
it back, so a run split into sessions stops, or does not, at the step an uninterrupted run would. It is wired
through session/stepbooks.py's StepBooks and judges only once a window, loss by loss within each loss's phase,
from the window's losses read off the device in one go, so a step costs no host-device sync: at the step after
each log step (the window's copy started at the log step, so the host does not wait for it) and at the last step,
whichever loop drives the Session (the built-in Trainer's too, its non-finite skips counted first and kept out),
in one process (with several, a window's mean is agreed on by every rank, not judged).
Those steps do not depend on where sessions are cut, and the windows not yet judged are saved with the
checkpoint. A new `phase` (a new model of a multi-model recipe, a curriculum stage) and a stop restart the
history: losses of a new phase do not compare with the last one's, and a run resumed after a stop is judged from
where it stands.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Optional


@dataclass
class _History:
    """Everything the decision depends on: plain numbers, saved in the checkpoint."""

    phase: Optional[str] = None
    n: int = 0                        # finite losses seen in this history
    smoothed: float = 0.0
    variance: float = 0.0             # of the loss around the smoothed loss, same span
    start: Optional[float] = None     # the smoothed loss when the warmup ended
    best: Optional[float] = None
    noise: float = 0.0                # the standard deviation when `best` was set
    above: int = 0                    # steps in a row over the bar
    nonfinite: int = 0                # non-finite losses in a row


class DivergenceGuard:
    def __init__(self, span: int = 20, rise: float = 0.5, noise_k: float = 3.0, floor: float = 0.1,
                 nonfinite_patience: int = 3):
        self.span, self.rise, self.noise_k, self.floor = span, rise, noise_k, floor
        self.nonfinite_patience = nonfinite_patience
        self._alpha = 2.0 / (span + 1)
        self.h = _History()

    # -- the run's exact state ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return asdict(self.h)

    def load_state_dict(self, state: Optional[dict]) -> None:
        """A checkpoint written before the guard saved its history (None) starts a new one."""
        self.h = _History(**{k: v for k, v in (state or {}).items() if k in _History.__dataclass_fields__})

    # -- the decision ------------------------------------------------------------------------------
    def bar(self) -> Optional[float]:
        """The smoothed loss above which a step counts as diverging (None during the warmup)."""
        h = self.h
        if h.best is None:
            return None
        return h.best + max(self.rise * (h.start - h.best), self.noise_k * h.noise, self.floor * abs(h.best))

    def update(self, step: int, loss: Any, phase: Optional[str] = None) -> Optional[str]:
        """Count one step's loss; the reason in words when the session must stop at this step, else None."""
        h = self.h
        if phase != h.phase:
            self.h = h = _History(phase=phase)
        loss = float(loss)
        if not math.isfinite(loss):
            h.nonfinite += 1
            if h.nonfinite < self.nonfinite_patience:
                return None
            self.h = _History(phase=phase)
            return f"the loss was {loss} for {self.nonfinite_patience} steps in a row at step {step}"
        h.nonfinite = 0
        self._smooth(loss)
        bar = self.bar()
        if bar is None:
            if h.n >= self.span:
                h.start = h.best = h.smoothed
                h.noise = math.sqrt(h.variance)
            return None
        if h.smoothed < h.best:
            h.best, h.noise = h.smoothed, math.sqrt(h.variance)
        h.above = h.above + 1 if h.smoothed > bar else 0
        if h.above < self.span:
            return None
        why = (f"the loss diverged at step {step}: its {self.span}-step average was over {bar:.4g} for {self.span}"
               f" steps in a row, now {h.smoothed:.4g} (best {h.best:.4g}, start {h.start:.4g}, noise {h.noise:.3g})")
        self.h = _History(phase=phase)  # judged afresh if the run is resumed
        return why

    def _smooth(self, loss: float) -> None:
        h = self.h
        h.n += 1
        if h.n == 1:
            h.smoothed = loss
            return
        delta = loss - h.smoothed
        h.smoothed += self._alpha * delta
        h.variance = (1 - self._alpha) * (h.variance + self._alpha * delta * delta)
