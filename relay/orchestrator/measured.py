"""What a relay measured of its own sessions (issue 47): start-up, save and hand-over times, and what they make of
the GPU time charged. The plan and every ETA use these in place of the spec's guesses (kaggle.startup_overhead,
the save margin) once one was measured, and say where each figure comes from.

A pure function of the published progress.json: `sessions` (the kernel's clock: when each session's clock started
and ended, its save time) and `charges` (the orchestrator's view of each attempt: its push, its process's end, when
Kaggle showed it ended; relay/orchestrator/goodput.py). No I/O, no clock.
- start-up: an attempt's push to its session's clock start (Kaggle's queue, the image, the kernel bundle, imports);
- save: a session's measured save time (the final save a session bounded by steps ends with);
- hand-over: a session's end (its clock) to the next attempt's push (Kaggle's shut-down, the relay seeing it,
  download, verify, publish, push): wall time between sessions, not charged; measured as the whole gap between
  two sessions' clocks less the start-up (the running session's first progress line ends the last gap), over
  clean hand-overs only (not after a kill or a wedge, nor across a failed attempt).
Each is the median over the sessions that measured it: one session that waited for quota or a slow download must
not move every later estimate.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Iterable, List, Mapping, Optional, Sequence

from relay.orchestrator.goodput import CLEAN_ENDS, duration_text

# No spec key says how long a hand-over takes: download, verify, publish and push of a small checkpoint, and a
# poll of the relay's, are about a minute; a measured one replaces it after the relay's second session.
HANDOVER_DEFAULT_S = 60.0
# nor how long a save takes (the kernel measures it): 20 s writes a few GB to Kaggle's disk. session.safety_margin is
# what a session keeps for it, an upper bound, so the smaller of the two.
SAVE_DEFAULT_S = 20.0


@dataclass(frozen=True)
class Figure:
    seconds: float
    source: str  # "measured over N sessions", "--startup" (a flag), else "assumed: ..." (the spec's, a default)

    def text(self, what: str) -> str:
        return f"{what} {duration_text(self.seconds)} ({self.source})"


@dataclass(frozen=True)
class Overheads:
    startup: Figure
    save: Figure
    handover: Figure

    def text(self) -> str:
        return ", ".join((self.startup.text("start-up"), self.save.text("save"), self.handover.text("hand-over")))


def startup_times(progress: Optional[Mapping]) -> List[float]:
    """Each handed-over attempt's push to its session's clock start, in seconds (attempts the relay saw pushed)."""
    progress = progress or {}
    pushed = {c.get("run_id"): _num(c.get("pushed_at")) for c in progress.get("charges") or []}
    out = []
    for s in progress.get("sessions") or []:
        at, started = pushed.get(s.get("run_id")), _num(s.get("started"))
        if at is not None and started is not None and started >= at:
            out.append(started - at)
    return out


def save_times(progress: Optional[Mapping]) -> List[float]:
    return [float(s["save_seconds"]) for s in (progress or {}).get("sessions") or []
            if _num(s.get("save_seconds")) is not None and float(s["save_seconds"]) > 0]


def overheads(spec, progress: Optional[Mapping], startup: Optional[float] = None, save: Optional[float] = None,
              handover: Optional[float] = None, running_started: Optional[float] = None) -> Overheads:
    """The figures a plan uses: given ones (flags), else measured over the relay's sessions, else the spec's
    (kaggle.startup_overhead) or the defaults (SAVE_DEFAULT_S, at most session.safety_margin; HANDOVER_DEFAULT_S).
    `running_started`: the running session's first progress line (unix time): its gap from the last handed-over
    session's end, less the start-up, is a hand-over measured while the session runs (its push is in no record
    yet), so the relay's second session already plans with a measured hand-over."""
    def pick(given, measured: Sequence[float], fallback: float, fallback_source: str, flag: str) -> Figure:
        if given is not None:
            return Figure(float(given), flag)
        if measured:
            n = len(measured)
            return Figure(statistics.median(measured), f"measured over {n} session{'s' if n > 1 else ''}")
        return Figure(float(fallback), fallback_source)

    k, s = spec.kaggle, spec.session
    start_fig = pick(startup, startup_times(progress), k.startup_overhead, _origin(k, "startup_overhead"), "--startup")
    # what a finish date feels is the whole gap between two sessions' clocks (hand-over and start-up): measured
    # as one, so a start-up measured on other sessions than the hand-over (the first session's cold start) is
    # not counted twice; the hand-over is that gap less the start-up
    gaps = session_gaps(progress, running_started)
    handovers = [max(0.0, statistics.median(gaps) - start_fig.seconds)] * len(gaps) if gaps else []
    return Overheads(
        startup=start_fig,
        save=pick(save, save_times(progress), min(s.safety_margin, SAVE_DEFAULT_S),
                  _origin(s, "safety_margin") if s.safety_margin < SAVE_DEFAULT_S else "assumed", "--save"),
        handover=pick(handover, handovers, HANDOVER_DEFAULT_S, "assumed", "--handover"))


def session_gaps(progress: Optional[Mapping], running_started: Optional[float] = None) -> List[float]:
    """Seconds from each session's clock end to the next one's clock start (the running session's first progress
    line for the last): the hand-over and the start-up between them. Clean hand-overs only: a gap after a session
    that did not end cleanly (killed: the relay saw it late, salvaged it) or that Kaggle ran on past its end
    (wedged: the relay waited for its deadline), or with a failed attempt pushed within it, measures the fault,
    not a hand-over, and would make every later finish estimate lean late."""
    progress = progress or {}
    charges = progress.get("charges") or []
    wedged = {c.get("run_id") for c in charges if c.get("wedged")}
    failed_pushes = [_num(c.get("pushed_at")) for c in charges if c.get("failed")]
    sessions = progress.get("sessions") or []
    ends = [(_num(s.get("ended")), _num(s.get("started"))) for s in sessions]
    starts = [start for _, start in ends[1:]] + [running_started]
    out = []
    for s, (end, _), start in zip(sessions, ends, starts):
        if end is None or start is None or start < end:
            continue
        if s.get("stop_reason") not in CLEAN_ENDS or s.get("run_id") in wedged:
            continue
        if any(at is not None and end <= at <= start for at in failed_pushes):
            continue
        out.append(start - end)
    return out


def _origin(section, key: str) -> str:
    """Whether the spec set `key` or left it at its default (pydantic records the keys a spec set): either way
    assumed, not measured, and said so."""
    if key in (getattr(section, "model_fields_set", None) or ()):
        return f"assumed: the spec's {key}"
    return f"assumed: {key}'s default"


def expected_goodput(sessions: Iterable, figures: Overheads, save_every_s: Optional[float]) -> Optional[float]:
    """Training / GPU time charged over planned sessions (relay.orchestrator.plan.PlannedSession): each is charged
    its start-up, its training and its saves (one every `save_every_s` of training, and the last); the hand-over
    is wall time between sessions, not charged. The same split as the goodput ledger's."""
    train = charged = 0.0
    for p in sessions:
        saves = 1 + (int(p.train_s // save_every_s) if save_every_s else 0)
        train += max(0.0, p.train_s - (saves - 1) * figures.save.seconds)
        charged += figures.startup.seconds + p.train_s + figures.save.seconds
    return train / charged if charged > 0 else None


def goodput_line(goodput: Optional[float], figures: Overheads, weekly_quota_s: float) -> str:
    """"expected goodput 93 % (start-up 2m (...), save 20s (...), hand-over 1m (...)); the week's 30 h buy 27.9 h of
    training"."""
    if goodput is None:
        return f"expected goodput: unknown ({figures.text()})"
    return (f"expected goodput {goodput:.0%} ({figures.text()}); the week's {weekly_quota_s / 3600:g} h buy"
            f" {goodput * weekly_quota_s / 3600:.1f} h of training")


def _num(value) -> Optional[float]:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None
