"""The live view's writes into Prefect: what the running session shows, as relay.orchestrator.session_view computes
it from the session's log (relay.orchestrator.live_progress follows it), written into the relay's artifacts and
the flow's log, bounded by the session's events, not by how long it runs:
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
import time
from typing import Callable, Dict, List, Optional

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from relay.orchestrator.kaggle.types import KaggleUnresponsive, KernelState, NotFound
from relay.orchestrator.live_progress import LiveSession
from relay.orchestrator.session_view import Running, SessionView
from relay.shared.progress import Progress
from tasks import artifacts
from tasks.prefect_writes import soon


class LiveView:
    """A relay's running session in Prefect: what its SessionView shows, written as log lines, notifications and
    artifact versions; a tick's view (one with marks) remembers across flow runs what it showed."""

    def __init__(self, session: SessionView, notify: Callable[[str, str], None] = lambda key, text: None,
                 marks: Optional["TickMarks"] = None):
        self.session = session
        self.notify = notify
        self.marks = marks  # a tick's: what the earlier ticks showed
        self.progress_artifact: Optional[str] = None  # this flow run's progress artifact, updated in place

    def follow(self, run_id: str, deadline: Optional[float] = None) -> LiveSession:
        """The follower of `run_id`'s session; a tick's view goes on from what the earlier ticks showed of it."""
        if self.session.follow_run(run_id, deadline) and self.marks is not None:
            logged, summarized, warned, self.progress_artifact = self.marks.recall(run_id)
            self.session.resume(logged, summarized, warned, self.marks.eval_shown(run_id))
        return self.session.live

    def show_progress(self, step: int, total: int, text: str) -> None:
        """The relay's progress artifact: this flow run's, updated in place; created once per flow run (then
        the key's latest version), or once for all the ticks of a relay."""
        if self.progress_artifact is None and self.marks is not None:  # a tick: the one the earlier ticks made
            self.progress_artifact = self.marks.recall()[3]
        self.progress_artifact = artifacts.show_progress(self.session.names.name, step, total, text,
                                                         self.progress_artifact)
        if self.marks is not None:
            self.marks.keep(progress_artifact=self.progress_artifact)

    def show_end(self, run_id: str, progress: Optional[Progress], kernel_state: str) -> None:
        """The last lines of `run_id`'s session, seen ended in `kernel_state`, when this view follows it: its
        stream's end waited for (the stored log is served at once), then one refresh."""
        live = self.session.live
        if live is not None and live.run_id == run_id:
            live.wait(60)
            self.refresh(progress, kernel_state)

    def refresh(self, progress: Optional[Progress], kernel_state: str, show_progress: bool = True) -> None:
        """Write what the session shows since the last refresh (SessionView.to_show): the new early warnings to the
        flow's log and as notifications, the progress artifact, the summary versions, the log lines; a tick's
        marks after. Each write to Prefect's server is one of the session's events, never one per refresh."""
        logger, view = get_run_logger(), self.session
        shown = view.to_show(progress, kernel_state, show_progress, catch_up=self.marks is not None, logger=logger)
        if shown is None:
            return
        try:
            for key, text in shown.warnings:
                logger.warning("early warning, %s: %s", shown.run_id, text)
                self.notify(f"warning-{shown.run_id}-{key}", f"{view.names.name} {shown.run_id}: {text}")
        except Exception as err:  # noqa: BLE001 - a notification that failed never fails a relay
            logger.warning("early warnings of %s not given: %s", shown.run_id, err)
        if not shown.lines:
            return
        try:  # the live view never fails a relay
            if shown.card is not None:
                self.show_progress(*shown.card)
            for summary in shown.summaries:
                artifacts.publish_running(view.names.name, shown.progress or Progress(), summary.upto, view.local,
                                          shown.metrics, summary.text, shown.state, summary.plan, view.links)
        except Exception as err:  # noqa: BLE001
            logger.warning("live view of %s not refreshed: %s", shown.run_id, err)
        for line in shown.log_lines:
            logger.info("%s", line)
        if self.marks is not None:
            self.marks.keep(run_id=shown.run_id, logged=view.logged, summarized=view.summarized,
                            eval_shown=view.eval_shown,
                            warned=sorted(key for run_id, key in view.warned if run_id == shown.run_id))


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


# time.monotonic, as follow_sessions reads it: a name a test may rebind in its flow process to end a follow's wait
# at an event (tests/relay_fixtures.py's flow driver wakes the follow of a session the emulator has wedged, whose
# deadline the test moved: no real minute waited for it)
monotonic = time.monotonic


@task(name="follow-sessions", cache_policy=NO_CACHE, task_run_name="follow {label}")
def follow_sessions(sessions: List[Running], label: str, poll_seconds: float, live_seconds: float,
                    give_up: float, max_status_errors: int = 10, show_ends: bool = True) -> Dict[str, str]:
    """Wait until one of `sessions` finishes, asking Kaggle their states every `poll_seconds` and refreshing
    their views as often (the lines read since, in order); their progress artifacts every `live_seconds` and with
    each summary version: one task run per session's end, however long it runs. Returns
    {run_id: kernel state}; stops waiting once `give_up` (time.monotonic()) has passed. A status error is
    asked again at the next poll; KaggleUnresponsive (the client gave up) goes up to the flow, which looks
    at Kaggle again later. `show_ends=False`: returns as soon as a session is seen ended, its views not
    refreshed (the relays flow shows the ends beside their hand-overs, after the freed slot's push)."""
    states = {s.run_id: "starting" for s in sessions}
    seen: set = set()  # sessions Kaggle's status call has shown
    errors, finished, next_status, next_view = 0, False, 0.0, 0.0
    while monotonic() < give_up:
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
            if finished and not show_ends:  # a slot is free: no view's refresh (seconds for 4) before its push
                return states
        show = time.monotonic() >= next_view  # the progress artifact: every live_seconds (and with a summary)
        if show:
            next_view = time.monotonic() + live_seconds
        for s in sessions:
            s.view.refresh(s.progress, states[s.run_id], show_progress=show)
        if finished:
            for s in sessions:  # the stored log's last lines: the session's end in its view
                if states[s.run_id] in _FINISHED:
                    s.view.show_end(s.run_id, s.progress, states[s.run_id])
            return states
        time.sleep(min(live_seconds, poll_seconds))
    return states


_FINISHED = {s.value for s in KernelState if s.finished}


def _state(s: Running) -> Optional[KernelState]:
    try:
        return s.view.session.backend.kernel_status(s.view.session.names.kernel, s.version).state
    except NotFound:  # the new version is not visible to the status call yet
        return None
