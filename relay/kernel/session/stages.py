"""A run as a sequence of stages: several models trained one after another, or closed-form fits, in one relay.

A recipe declares its stages (`Recipe.stages()`); the run's optimizer steps (the spec's epochs/max_steps) are
laid out over them by `plan`, a pure function, so which stage a step belongs to never needs saving: a session
that ends between two stages, or in the middle of one, resumes in the right place from `global_step` alone.
Each stage gets its own optimizer and learning-rate schedule over its own step range (a fit stage has none:
the recipe does the step), and the previous stage's optimizer state is dropped when the next one begins.

A stage's `batch_scale` k multiplies the micro-batch for its steps (the seed's MLP at 512 beside the LSTM and
Transformer at 256): its step s takes the k x effective-batch indices of step s in a schedule of that size
(`data.StepSchedule.scaled`), still a pure function of the step, so exact resume holds inside the stage too.
Stages sharing the run's steps get equal *samples*: a stage at k x the batch gets 1/k of the steps.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from relay.shared.errors import InputError


@dataclass(frozen=True)
class Stage:
    """One part of a run. `steps` None takes an equal share of what the fixed-length stages leave; `fit` True
    means the recipe's `fit_step` does each step (ALS iterations, an SVD) instead of an optimizer."""

    name: str
    steps: int | None = None
    fit: bool = False
    batch_scale: int = 1  # micro-batch (and so effective batch) multiplier for this stage's steps

    def __post_init__(self):
        if type(self.batch_scale) is not int or self.batch_scale < 1:
            raise ValueError(f"stage {self.name}: batch_scale must be an integer >= 1, not {self.batch_scale!r}")


@dataclass(frozen=True)
class Span:
    stage: Stage
    start: int  # first global step of the stage
    end: int  # one past its last

    @property
    def length(self) -> int:
        return self.end - self.start


def plan(stages: list[Stage], total: int) -> list[Span]:
    """Lay `total` steps over the stages in order; the remainder of an uneven share goes to the last shared one.
    With every batch_scale 1 the shared stages get equal steps (the layout before batch_scale existed)."""
    if not stages:
        raise ValueError("a recipe declares at least one stage")
    fixed = sum(s.steps for s in stages if s.steps is not None)
    shared = [s for s in stages if s.steps is None]
    left = total - fixed
    if left < len(shared) or (not shared and left != 0):
        need = f"{fixed + len(shared)} or more" if shared else str(fixed)
        raise InputError(f"optim: the run has {total} optimizer steps, the recipe's stages "
                         f"({', '.join(_describe(s) for s in stages)}) need {need}; set optim.max_steps accordingly")
    # Equal samples per shared stage: weights proportional to 1/batch_scale (integers over the scales' lcm).
    lcm = math.lcm(*(s.batch_scale for s in shared)) if shared else 1
    weights = {id(s): lcm // s.batch_scale for s in shared}
    unit = left // sum(weights.values()) if shared else 0
    extra = left - unit * sum(weights.values())
    if shared and unit == 0:  # too few steps to weight: one each, the rest to the last shared stage
        weights = {k: 1 for k in weights}
        unit, extra = 1, left - len(shared)
    spans, start = [], 0
    for s in stages:
        n = s.steps if s.steps is not None else unit * weights[id(s)] + (extra if s is shared[-1] else 0)
        spans.append(Span(s, start, start + n))
        start += n
    return spans


def at(spans: list[Span], step: int) -> Span:
    """The stage that takes optimizer step `step` (0-based); past the end, the last one."""
    for span in spans:
        if span.start <= step < span.end:
            return span
    return spans[-1]


def _describe(stage: Stage) -> str:
    return f"{stage.name}: {stage.steps if stage.steps is not None else 'a share'}"


class StageSlot:
    """A registered object whose owner changes with the stage and the precision (the optimizer, its schedule, the
    scaler): it saves what `current` holds ({} for none: a fit stage's optimizer), and keeps a loaded state
    until the Trainer has entered the stage it belongs to."""

    def __init__(self) -> None:
        self.current: Any = None
        self.loaded: Optional[dict] = None

    def state_dict(self) -> dict:
        return self.current.state_dict() if self.current is not None else {}

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state

    def take(self) -> Optional[dict]:
        loaded, self.loaded = self.loaded, None
        return loaded
