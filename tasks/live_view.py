"""The flow's view of the running session in Prefect: follows its log (relay.orchestrator.live_progress reads it) and
keeps the relay's artifacts current, bounded by the session's events, not by how long it runs:
- the progress artifact is updated in place (no new version) every `live_seconds` and with each summary version
  (each update is a write that Prefect's server handles: not at every status poll); the flow run creates it once
  and the hand-over's report updates the same one, so the key's latest version is always the newest state;
- the session table and the summary (new versions) at the session's events: the first line within each
  quarter of its steps (its start, ..., its end), each eval, each early warning;
- the flow's log says step, loss and ETA at every tenth of the session's steps and at each eval;
- `follow_sessions` waits on running sessions inside one task run until one ends (not one per poll);
- ticks (each a flow run of its own) share what they showed through `TickMarks`, so a relay ticked every few
  minutes for days adds what a watch would: the same log lines and summary versions, one progress artifact.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from relay.orchestrator import handoff
from relay.orchestrator.kaggle.types import KaggleUnresponsive, KernelState, NotFound
from relay.orchestrator.live_progress import Eta, LiveSession, early_warnings, estimate, eta_text, session_fraction
from relay.shared import progress_line
from tasks import artifacts
from tasks.prefect_writes import soon

LOG_EVERY = 10        # log lines per session: one at each tenth of its steps
SUMMARY_EVERY = 4     # summary and table versions per session: one at each quarter of its steps


class LiveView:
    def __init__(self, backend, names, local: Path, session_max_steps: Optional[int] = None,
                 stuck_after_s: float = 1800.0, notify: Callable[[str, str], None] = lambda key, text: None,
                 plan: Callable[[Optional[dict], Optional[Eta]], str] = lambda progress, eta: "",
                 marks: Optional["TickMarks"] = None,
                 finish: Callable[[Optional[dict], Optional[Eta]], str] = lambda progress, eta: "",
                 links: str = ""):
        self.backend, self.names, self.local = backend, names, local
        self.marks = marks  # a tick's: what the earlier ticks showed
        self.session_max_steps, self.stuck_after_s = session_max_steps, stuck_after_s
        self.notify, self.plan = notify, plan
        self.finish = finish  # the run's finish, policy.forecast's: the one the summary's plan and `relay status` say
        self.links = links    # where the relay lives on Kaggle (chain.Names.links), in every summary
        self.deadline: Optional[float] = None  # unix time: Kaggle still running the session after it is a wedge
        self._wedge_shown: Optional[str] = None  # the run whose wedge the table and summary were given
        self.live: Optional[LiveSession] = None
        self.progress_artifact: Optional[str] = None  # this flow run's progress artifact, updated in place
        self._warned: set = set()
        self._logged = self._summarized = -1  # the tenth logged and the quarter summarized of this session
        self._seen = 0                          # records of this session read by refresh
        self._eval_shown: Optional[list] = None  # [step, metric names] of the newest eval shown

    def follow(self, run_id: str) -> LiveSession:
        """The follower of `run_id`'s session (a new one for a new run, or when the last stream ended empty:
        right after a push it can still be the previous version's log)."""
        if self.live is None or self.live.run_id != run_id or (self.live.ended and not self.live.records):
            self.live = LiveSession(self.backend, self.names.kernel, run_id).start()
            self._logged, self._summarized, self._seen = -1, -1, 0  # a new session: its events start again
            self._eval_shown = None
            if self.marks is not None:
                self._logged, self._summarized, warned, self.progress_artifact = self.marks.recall(run_id)
                self._eval_shown = self.marks.eval_shown(run_id)
                self._warned |= {(run_id, key) for key in warned}
        return self.live

    def show_progress(self, step: int, total: int, text: str) -> None:
        """The relay's progress artifact: this flow run's, updated in place; created once per flow run (then
        the key's latest version), or once for all the ticks of a relay."""
        if self.progress_artifact is None and self.marks is not None:  # a tick: the one the earlier ticks made
            self.progress_artifact = self.marks.recall()[3]
        self.progress_artifact = artifacts.show_progress(self.names.name, step, total, text, self.progress_artifact)
        if self.marks is not None:
            self.marks.keep(progress_artifact=self.progress_artifact)

    def refresh(self, progress: Optional[dict], kernel_state: str, show_progress: bool = True) -> None:
        """A log line and a summary version for each event of the lines read since the last refresh, in their
        order (so how often this runs changes nothing); the progress artifact at the newest line if
        `show_progress` or with a summary version (each update is a write to Prefect's server). A tick's view
        (one with marks) reads history, a session it did not follow from its start: one log line and one summary
        version for all of it that the earlier ticks did not show."""
        live, logger = self.live, get_run_logger()
        if live is None:
            return
        catch_up = self.marks is not None
        records = list(live.records)
        try:
            warned = self._warn(records, progress, kernel_state)
        except Exception as err:  # noqa: BLE001 - a notification that failed never fails a relay
            logger.warning("early warnings of %s not given: %s", live.run_id, err)
            warned = False
        if self._newest(records) is None:
            return
        log_at, summary_at = [], []
        for i in range(self._seen, len(records)):
            log, summary = self._events(records[:i + 1])
            log_at += [i] if log else []
            summary_at += [i] if summary else []
        self._seen = len(records)
        if warned and not summary_at:
            summary_at.append(len(records) - 1)
        wedged = self.deadline is not None and kernel_state == "running" and time.time() >= self.deadline
        if wedged and self._wedge_shown != live.run_id:  # once: the table's row and the summary's title say it
            self._wedge_shown = live.run_id
            summary_at = sorted(set(summary_at) | {len(records) - 1})
        shown_state = "running past its deadline: wedged" if wedged else kernel_state
        if catch_up:
            log_at, summary_at = log_at[-1:], summary_at[-1:]
        try:  # the live view never fails a relay
            newest = self._newest(records)
            if show_progress or summary_at:
                self.show_progress(int(newest["step"]), self._total(records, progress),
                                   self._text(records, progress, kernel_state))
            for i in summary_at:
                upto = records[:i + 1]
                metrics = (handoff.published_metrics(self.backend, self.names, self.local, progress)
                           if progress else None)
                artifacts.publish_running(self.names.name, progress or {}, upto, self.local, metrics,
                                          self._text(upto, progress, kernel_state), shown_state,
                                          self._plan({**(progress or {}), "total_steps": self._total(upto, progress)},
                                                     estimate(upto, self.session_max_steps)),
                                          self.links)
        except Exception as err:  # noqa: BLE001
            logger.warning("live view of %s not refreshed: %s", live.run_id, err)
        try:
            for i in log_at:
                self._log(records[:i + 1], progress)
        except Exception as err:  # noqa: BLE001 - a view never fails a relay
            logger.warning("progress of %s not logged: %s", live.run_id, err)
        if self.marks is not None:
            self.marks.keep(run_id=live.run_id, logged=self._logged, summarized=self._summarized,
                            eval_shown=self._eval_shown,
                            warned=sorted(key for run_id, key in self._warned if run_id == live.run_id))

    def _events(self, upto: list) -> tuple:
        """(log line?, summary version?) for the newest of `upto`: a tenth (for the log) or a quarter (for the
        summary) of the session's steps passed, an eval, the session's end."""
        record = upto[-1]
        if record.get("kind") == "eval":  # once: a tick reads the session's history again from its start
            shown = [int(record.get("step") or 0), sorted(k for k in record if k.startswith("eval_"))]
            if self._eval_shown is not None and (shown[0] < self._eval_shown[0] or shown == self._eval_shown):
                return False, False
            self._eval_shown = shown
            return True, True
        if record.get("kind") not in ("train", "end"):
            return False, False
        fraction = 1.0 if record.get("kind") == "end" else session_fraction(upto, self.session_max_steps)
        # the first line within each tenth (quarter): as many per session whether it is 10 or 10,000 steps long
        tenth, quarter = math.ceil(fraction * LOG_EVERY), math.ceil(fraction * SUMMARY_EVERY)
        log, summary = tenth > self._logged, quarter > self._summarized
        self._logged, self._summarized = max(self._logged, tenth), max(self._summarized, quarter)
        return log, summary

    def _log(self, upto: list, progress: Optional[dict]) -> None:
        record = upto[-1]
        newest = self._newest(upto) or record  # an eval before the session's first train line
        step = newest["step"]
        if record.get("kind") == "eval":  # at its own step: the newest train line (rate-bounded) can be older
            step, newest = record.get("step"), newest if newest.get("step") == record.get("step") else {}
        loss = newest.get("loss")
        said = f", loss {loss:.4g}" if isinstance(loss, (int, float)) else ""
        if record.get("kind") == "eval":
            said += f"; eval {_pairs(record)}"
        get_run_logger().info("%s step %s of %s%s; %s", self.live.run_id, step,
                              self._total(upto, progress), said, eta_text(upto, self.session_max_steps))

    def _text(self, upto: list, progress: Optional[dict], kernel_state: str) -> str:
        newest = self._newest(upto) or upto[-1]
        steps = int(newest["step"]) - int(upto[0].get("step_start") or 0)
        return (f"{self.names.name}: step {newest['step']} of {self._total(upto, progress)}; session"
                f" {newest.get('session')} ({self.live.run_id}): {steps} steps, {kernel_state};"
                f" {eta_text(upto, self.session_max_steps, self.deadline, kernel_state)}"
                f"{self._finish(upto, progress)};"
                f" updated {time.strftime('%H:%M:%S UTC', time.gmtime())}")

    def _finish(self, upto: list, progress: Optional[dict]) -> str:
        """'; finish ~...' as the plan says it, from the same progress and estimate the summary's plan is given."""
        try:
            said = self.finish({**(progress or {}), "total_steps": self._total(upto, progress)},
                               estimate(upto, self.session_max_steps))
        except Exception as err:  # noqa: BLE001 - a finish that cannot be told is left out, never fatal
            get_run_logger().info("no finish estimate: %s", err)
            return ""
        return f"; {said}" if said else ""

    @staticmethod
    def _newest(records: list) -> Optional[dict]:
        return progress_line.newest(records)

    def _total(self, records: list, progress: Optional[dict]) -> int:
        newest = self._newest(records) or {}
        return int(newest.get("total_steps") or (progress or {}).get("total_steps") or newest.get("step") or 1)

    def _warn(self, records: list, progress: Optional[dict], kernel_state: str) -> bool:
        """Each early warning once per session, to the flow's log and a notification; True if one was new."""
        new = False
        for key, text in self._warnings(records, progress, kernel_state):
            if (self.live.run_id, key) not in self._warned:
                self._warned.add((self.live.run_id, key))
                new = True
                get_run_logger().warning("early warning, %s: %s", self.live.run_id, text)
                self.notify(f"warning-{self.live.run_id}-{key}", f"{self.names.name} {self.live.run_id}: {text}")
        return new

    def _warnings(self, records: list, progress: Optional[dict], kernel_state: str) -> list:
        speeds = [s.get("samples_per_s") for s in (progress or {}).get("sessions", []) if s.get("samples_per_s")]
        found = early_warnings(records, slow_below=sorted(speeds)[len(speeds) // 2] if speeds else None)
        if kernel_state == "running" and self.live.silent_for() > self.stuck_after_s:
            found.append(("stuck", f"no progress line for {self.live.silent_for() / 60:.0f} min (a stuck data loader"
                                   " or collective?)"))
        return found

    def _plan(self, progress: Optional[dict], eta: Optional[Eta]) -> str:
        try:
            return self.plan(progress, eta)
        except Exception as err:  # noqa: BLE001 - a plan that cannot be made is said, never fatal
            return f"(no plan: {err})"


class TickMarks:
    """What the ticks of a relay showed of its running session (the tenth logged, the quarter summarized, the
    early warnings given, the progress artifact), kept in the Prefect Variable `relay-view-<name>`: a tick is a flow run of its own, and
    without them every tick would add a log line, a summary version and a progress version. Written only when
    they change, so at most once per tenth of a session. A lost or unreadable mark costs one extra line."""

    def __init__(self, relay_name: str):
        self.variable = f"relay-view-{relay_name}"
        self._kept: Optional[dict] = None  # as last read or written

    def recall(self, run_id: Optional[str] = None) -> tuple:
        """(tenth logged, quarter summarized, warnings given) of `run_id`'s session and the progress artifact's
        id, as the last tick left them."""
        if self._kept is None:
            from prefect.variables import Variable

            try:
                self._kept = json.loads(Variable.get(self.variable, default="{}"))
            except Exception:  # noqa: BLE001 - a view never fails a relay
                self._kept = {}
        same = run_id is not None and self._kept.get("run_id") == run_id
        return (self._kept.get("logged", -1) if same else -1, self._kept.get("summarized", -1) if same else -1,
                self._kept.get("warned", []) if same else [], self._kept.get("progress_artifact"))

    def eval_shown(self, run_id: str) -> Optional[list]:
        """[step, metric names] of the newest eval of `run_id`'s session an earlier tick showed."""
        self.recall()
        return self._kept.get("eval_shown") if self._kept.get("run_id") == run_id else None

    def keep(self, **changes) -> None:
        """Write the marks with `changes` (run_id, logged, summarized, warned, eval_shown, progress_artifact),
        if any."""
        from prefect.variables import Variable

        self.recall()
        marks = {**self._kept, **changes}
        if marks == self._kept:
            return
        try:
            soon(lambda: Variable.set(self.variable, json.dumps(marks), overwrite=True))
            self._kept = marks
        except Exception as err:  # noqa: BLE001
            get_run_logger().warning("the view's marks of %s not kept: %s", self.variable, err)


def _pairs(record: dict) -> str:
    """An eval record's metrics as `name value` pairs."""
    return ", ".join(f"{k[len('eval_'):]} {v:.4g}" if isinstance(v, float) else f"{k[len('eval_'):]} {v}"
                     for k, v in record.items() if k.startswith("eval_"))


@dataclass(frozen=True)
class Running:
    """One running session to wait on: its relay's view, run id, kernel version and handed-over progress."""

    view: LiveView
    run_id: str
    version: int
    progress: Optional[dict]


@task(name="follow-sessions", cache_policy=NO_CACHE, task_run_name="follow {label}")
def follow_sessions(sessions: List[Running], label: str, poll_seconds: float, live_seconds: float,
                    give_up: float, max_status_errors: int = 10) -> Dict[str, str]:
    """Wait until one of `sessions` finishes, asking Kaggle their states every `poll_seconds` and refreshing
    their views as often (the lines read since, in order); their progress artifacts every `live_seconds` and with
    each summary version: one task run per session's end, however long it runs. Returns
    {run_id: kernel state}; stops waiting once `give_up` (time.monotonic()) has passed. A status error is
    asked again at the next poll; KaggleUnresponsive (the client gave up) goes up to the flow, which looks
    at Kaggle again later."""
    states = {s.run_id: "starting" for s in sessions}
    seen: set = set()  # sessions Kaggle's status call has shown
    errors, finished, next_status, next_view = 0, False, 0.0, 0.0
    while time.monotonic() < give_up:
        if time.monotonic() >= next_status:
            next_status = time.monotonic() + poll_seconds
            try:
                for s in sessions:
                    state = _state(s)
                    states[s.run_id] = state.value if state else "starting"
                    finished = finished or bool(state and state.finished)
                    if state is not None:
                        seen.add(s.run_id)
                    elif s.run_id in seen:  # seen, then gone: its kernel was deleted (`relay stop --now`)
                        finished = True
                errors = 0
            except KaggleUnresponsive:
                raise
            except Exception:  # noqa: BLE001 - transient: the next poll asks again
                errors += 1
                if errors >= max_status_errors:
                    raise
        show = time.monotonic() >= next_view  # the progress artifact: every live_seconds (and with a summary)
        if show:
            next_view = time.monotonic() + live_seconds
        for s in sessions:
            s.view.refresh(s.progress, states[s.run_id], show_progress=show)
        if finished:
            for s in sessions:  # the stored log's last lines: the session's end in its view
                if s.view.live is not None and states[s.run_id] in _FINISHED:
                    s.view.live.wait(60)  # returns at the stream's end: the stored log is served at once
                    s.view.refresh(s.progress, states[s.run_id])
            return states
        time.sleep(min(live_seconds, poll_seconds))
    return states


_FINISHED = {s.value for s in KernelState if s.finished}


def _state(s: Running) -> Optional[KernelState]:
    try:
        return s.view.backend.kernel_status(s.view.names.kernel, s.version).state
    except NotFound:  # the new version is not visible to the status call yet
        return None
