"""A run as a sequence of stages: several models trained one after another, or closed-form fits, in one relay.

A recipe declares its stages (`Recipe.stages()`); the run's optimizer steps (the spec's epochs/max_steps) are
laid out over them by `plan`, a pure function, so which stage a step belongs to never needs saving: a session
that ends between two stages, or in the middle of one, resumes in the right place from `global_step` alone.
Each stage gets its own optimizer and learning-rate schedule over its own step range (a fit stage has none:
the recipe does the step), and the previous stage's optimizer state is dropped when the next one begins.
"""
from __future__ import annotations

from dataclasses import dataclass

from relay.errors import InputError


@dataclass(frozen=True)
class Stage:
    """One part of a run. `steps` None takes an equal share of what the fixed-length stages leave; `fit` True
    means the recipe's `fit_step` does each step (ALS iterations, an SVD) instead of an optimizer."""

    name: str
    steps: int | None = None
    fit: bool = False


@dataclass(frozen=True)
class Span:
    stage: Stage
    start: int  # first global step of the stage
    end: int  # one past its last

    @property
    def length(self) -> int:
        return self.end - self.start


def plan(stages: list[Stage], total: int) -> list[Span]:
    """Lay `total` steps over the stages in order; the remainder of an uneven share goes to the last shared one."""
    if not stages:
        raise ValueError("a recipe declares at least one stage")
    fixed = sum(s.steps for s in stages if s.steps is not None)
    shared = [s for s in stages if s.steps is None]
    left = total - fixed
    if left < len(shared) or (not shared and left != 0):
        need = f"{fixed + len(shared)} or more" if shared else str(fixed)
        raise InputError(f"optim: the run has {total} optimizer steps, the recipe's stages "
                         f"({', '.join(_describe(s) for s in stages)}) need {need}; set optim.max_steps accordingly")
    share, extra = divmod(left, len(shared)) if shared else (0, 0)
    spans, start = [], 0
    for s in stages:
        n = s.steps if s.steps is not None else share + (extra if s is shared[-1] else 0)
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
