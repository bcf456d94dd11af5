"""What the relay's live view shows of the running session, computed from its progress lines (live_progress.py
follows them): which lines are events (the first line within each tenth of the session's steps for the flow's
log, within each quarter for a summary version; each eval; its end), which early warnings are new, the progress
text with its ETA and finish, the plan, the metrics history its curves are drawn from, and the log lines. Bounded by the session's events, not by how long it runs
or how often it is read: each read shows the events of the lines read since the last one, in their order.
tasks/live_view.py writes what a read shows into Prefect (the flow's log, the artifacts, a tick's marks).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from relay.orchestrator import handoff
from relay.orchestrator.live_progress import Eta, LiveSession, early_warnings, estimate, eta_text, session_fraction
from relay.shared import progress_line
from relay.shared.progress import Progress

LOG_EVERY = 10        # log lines per session: one at each tenth of its steps
SUMMARY_EVERY = 4     # summary and table versions per session: one at each quarter of its steps


@dataclass(frozen=True)
class Summary:
    """One summary version (and session-table row) of the running session: its lines up to the event."""

    upto: list
    text: str      # the progress text as of that line
    plan: str      # the plan and its ETA, from the same estimate


@dataclass
class Shown:
    """What one read shows, in the order it is written: the new early warnings, the progress artifact (step,
    total, text), the summary versions (their curves from `metrics`, the handed-over sessions' history), the log
    lines. `lines`: the session has a progress line to show."""

    run_id: str
    progress: Optional[Progress]
    warnings: List[Tuple[str, str]] = field(default_factory=list)   # (key, text), each new this read
    card: Optional[Tuple[int, int, str]] = None
    summaries: List[Summary] = field(default_factory=list)
    state: str = ""                                                 # the kernel state the summaries say
    metrics: Optional[Path] = None
    log_lines: List[str] = field(default_factory=list)
    lines: bool = False


class SessionView:
    """The running session as the live view shows it: the session it follows and what of it was shown (the tenth
    logged, the quarter summarized, the newest eval, the warnings given), so nothing is shown twice."""

    def __init__(self, backend, names, local: Path, session_max_steps: Optional[int] = None,
                 stuck_after_s: float = 1800.0,
                 plan: Callable[[Optional[Progress], Optional[Eta]], str] = lambda progress, eta: "",
                 finish: Callable[[Optional[Progress], Optional[Eta]], str] = lambda progress, eta: "",
                 links: str = ""):
        self.backend, self.names, self.local = backend, names, local
        self.session_max_steps, self.stuck_after_s = session_max_steps, stuck_after_s
        self.plan = plan
        self.finish = finish  # the run's finish, policy.forecast's: the one the summary's plan and `relay status` say
        self.links = links    # where the relay lives on Kaggle (chain.Names.links), in every summary
        self.deadline: Optional[float] = None  # unix time: Kaggle still running the session after it is a wedge
        self.live: Optional[LiveSession] = None
        self.logged = self.summarized = -1     # the tenth logged and the quarter summarized of this session
        self.eval_shown: Optional[list] = None  # [step, metric names] of the newest eval shown
        self.warned: set = set()                # (run id, key) of the early warnings given
        self._seen = 0                          # records of this session read
        self._wedge_shown: Optional[str] = None  # the run whose wedge the table and summary were given

    def follow_run(self, run_id: str, deadline: Optional[float] = None) -> bool:
        """Follow `run_id`'s session (a new follower for a new run, or when the last stream ended empty: right
        after a push it can still be the previous version's log); True when it is a new one, shown from its start."""
        self.deadline = deadline  # a session still running past it is wedged: the progress card says so
        if self.live is not None and self.live.run_id == run_id and not (self.live.ended and not self.live.records):
            return False
        self.live = LiveSession(self.backend, self.names.kernel, run_id).start()
        self.logged, self.summarized, self._seen, self.eval_shown = -1, -1, 0, None
        return True

    def resume(self, logged: int, summarized: int, warned: list, eval_shown: Optional[list]) -> None:
        """What earlier flow runs (ticks) showed of this session, so a tick shows only what they did not."""
        self.logged, self.summarized, self.eval_shown = logged, summarized, eval_shown
        self.warned |= {(self.live.run_id, key) for key in warned}

    def to_show(self, progress: Optional[Progress], kernel_state: str, show_progress: bool = True,
                catch_up: bool = False, logger=None) -> Optional[Shown]:
        """What to show of the lines read since the last read: a log line for each of their events, in order, and
        one summary version at the newest event (the summary is updated in place: an earlier one of the same read
        would be overwritten at once, a drawing and two writes for nothing); the progress artifact at the newest
        line if `show_progress` or with a summary version. `catch_up` (a tick's view, reading a session it did not
        follow from its start): one log line for all of it. None before the session is followed. What cannot be
        computed is said in `logger`'s lines and left out, never fatal."""
        live = self.live
        if live is None:
            return None
        progress = Progress.read(progress)  # a parsed document reads as the model
        shown, records = Shown(live.run_id, progress), list(live.records)
        try:
            shown.warnings = self._new_warnings(records, progress, kernel_state)
        except Exception as err:  # noqa: BLE001 - a warning that failed never fails a relay
            logger.warning("early warnings of %s not given: %s", live.run_id, err)
        if progress_line.newest(records) is None:
            return shown
        shown.lines = True
        log_at, summary_at = [], []
        for i in range(self._seen, len(records)):
            log, summary = self._events(records[:i + 1])
            log_at += [i] if log else []
            summary_at += [i] if summary else []
        self._seen = len(records)
        if shown.warnings and not summary_at:
            summary_at.append(len(records) - 1)
        wedged = self.deadline is not None and kernel_state == "running" and time.time() >= self.deadline
        if wedged and self._wedge_shown != live.run_id:  # once: the table's row and the summary's title say it
            self._wedge_shown = live.run_id
            summary_at = sorted(set(summary_at) | {len(records) - 1})
        shown.state = "running past its deadline: wedged" if wedged else kernel_state
        summary_at = summary_at[-1:]
        if catch_up:
            log_at = log_at[-1:]
        try:
            if show_progress or summary_at:
                shown.card = (int(progress_line.newest(records)["step"]), self._total(records, progress),
                              self._text(records, progress, kernel_state, logger))
            for i in summary_at:
                upto = records[:i + 1]
                plan = self._plan(replace(progress or Progress(), total_steps=self._total(upto, progress)),
                                  estimate(upto, self.session_max_steps))
                shown.summaries.append(Summary(upto, self._text(upto, progress, kernel_state, logger), plan))
        except Exception as err:  # noqa: BLE001 - the live view never fails a relay
            logger.warning("live view of %s not refreshed: %s", live.run_id, err)
        if shown.summaries and progress:
            try:  # what the handed-over sessions logged, kept in `local`: the summaries' curves go on from it
                shown.metrics = handoff.published_metrics(self.backend, self.names, self.local, progress)
            except Exception as err:  # noqa: BLE001
                logger.warning("live view of %s not refreshed: %s", live.run_id, err)
                shown.summaries = []
        try:
            shown.log_lines = [self._log_line(records[:i + 1], progress) for i in log_at]
        except Exception as err:  # noqa: BLE001
            logger.warning("progress of %s not logged: %s", live.run_id, err)
        return shown

    def _events(self, upto: list) -> tuple:
        """(log line?, summary version?) for the newest of `upto`: a tenth (for the log) or a quarter (for the
        summary) of the session's steps passed, an eval, the session's end."""
        record = upto[-1]
        if record.get("kind") == "eval":  # once: a tick reads the session's history again from its start
            shown = [int(record.get("step") or 0), sorted(k for k in record if k.startswith("eval_"))]
            if self.eval_shown is not None and (shown[0] < self.eval_shown[0] or shown == self.eval_shown):
                return False, False
            self.eval_shown = shown
            return True, True
        if record.get("kind") not in ("train", "end"):
            return False, False
        fraction = 1.0 if record.get("kind") == "end" else session_fraction(upto, self.session_max_steps)
        # the first line within each tenth (quarter): as many per session whether it is 10 or 10,000 steps long
        tenth, quarter = math.ceil(fraction * LOG_EVERY), math.ceil(fraction * SUMMARY_EVERY)
        log, summary = tenth > self.logged, quarter > self.summarized
        self.logged, self.summarized = max(self.logged, tenth), max(self.summarized, quarter)
        return log, summary

    def _log_line(self, upto: list, progress: Optional[Progress]) -> str:
        record = upto[-1]
        newest = progress_line.newest(upto) or record  # an eval before the session's first train line
        step = newest["step"]
        if record.get("kind") == "eval":  # at its own step: the newest train line (rate-bounded) can be older
            step, newest = record.get("step"), newest if newest.get("step") == record.get("step") else {}
        loss = newest.get("loss")
        said = f", loss {loss:.4g}" if isinstance(loss, (int, float)) else ""
        if record.get("kind") == "eval":
            said += f"; eval {_pairs(record)}"
        return (f"{self.live.run_id} step {step} of {self._total(upto, progress)}{said};"
                f" {eta_text(upto, self.session_max_steps)}")

    def _text(self, upto: list, progress: Optional[Progress], kernel_state: str, logger) -> str:
        newest = progress_line.newest(upto) or upto[-1]
        steps = int(newest["step"]) - int(upto[0].get("step_start") or 0)
        return (f"{self.names.name}: step {newest['step']} of {self._total(upto, progress)}; session"
                f" {newest.get('session')} ({self.live.run_id}): {steps} steps, {kernel_state};"
                f" {eta_text(upto, self.session_max_steps, self.deadline, kernel_state)}"
                f"{self._finish(upto, progress, logger)};"
                f" updated {time.strftime('%H:%M:%S UTC', time.gmtime())}")

    def _finish(self, upto: list, progress: Optional[Progress], logger) -> str:
        """'; finish ~...' as the plan says it, from the same progress and estimate the summary's plan is given."""
        try:
            said = self.finish(replace(progress or Progress(), total_steps=self._total(upto, progress)),
                               estimate(upto, self.session_max_steps))
        except Exception as err:  # noqa: BLE001 - a finish that cannot be told is left out, never fatal
            logger.info("no finish estimate: %s", err)
            return ""
        return f"; {said}" if said else ""

    @staticmethod
    def _total(records: list, progress: Optional[Progress]) -> int:
        newest = progress_line.newest(records) or {}
        return int(newest.get("total_steps") or (progress.total_steps if progress else None) or newest.get("step")
                   or 1)

    def _new_warnings(self, records: list, progress: Optional[Progress], kernel_state: str) -> list:
        """Each early warning once per session: those not given before, marked given."""
        speeds = [s.samples_per_s for s in (progress.sessions if progress else ()) if s.samples_per_s]
        found = early_warnings(records, slow_below=sorted(speeds)[len(speeds) // 2] if speeds else None)
        if kernel_state == "running" and self.live.silent_for() > self.stuck_after_s:
            found.append(("stuck", f"no progress line for {self.live.silent_for() / 60:.0f} min (a stuck data loader"
                                   " or collective?)"))
        new = [(key, text) for key, text in found if (self.live.run_id, key) not in self.warned]
        self.warned |= {(self.live.run_id, key) for key, _ in new}
        return new

    def _plan(self, progress: Optional[Progress], eta: Optional[Eta]) -> str:
        try:
            return self.plan(progress, eta)
        except Exception as err:  # noqa: BLE001 - a plan that cannot be made is said, never fatal
            return f"(no plan: {err})"


def _pairs(record: dict) -> str:
    """An eval record's metrics as `name value` pairs."""
    return ", ".join(f"{k[len('eval_'):]} {v:.4g}" if isinstance(v, float) else f"{k[len('eval_'):]} {v}"
                     for k, v in record.items() if k.startswith("eval_"))


@dataclass(frozen=True)
class Running:
    """One running session to wait on: its relay's view (tasks/live_view.py LiveView), run id, kernel version and
    handed-over progress."""

    view: object
    run_id: str
    version: int
    progress: Optional[Progress]
