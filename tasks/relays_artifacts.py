"""The relays flow's combined Prefect artifacts: one row per relay and one timeline of every relay's sessions."""
from __future__ import annotations

import base64
import contextvars
import logging
import threading
from pathlib import Path
from typing import List, Optional

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from relay.orchestrator import report
from relay.shared.progress import SessionRecord

log = logging.getLogger(__name__)
KEY = "relays"
TIMELINE_SESSIONS = 48  # the newest sessions drawn: a bar each, so the figure (and its time and memory) is bounded


@task(name="relays-report", cache_policy=NO_CACHE)
def publish_relays_report(rows: List[dict], sessions: List[SessionRecord], local: Path, plan=None) -> Optional[str]:
    """A table (relay, state, sessions, step, ETA) and a markdown summary with the joint timeline PNG (its newest
    TIMELINE_SESSIONS sessions).
    Returns the PNG's path, None before any session was handed over."""
    create_table_artifact(table=rows, key=f"{KEY}-table", description="relays: one row per relay")
    md = ["# relays", "", "| relay | state | sessions | step | ETA |", "|---|---|---|---|---|"]
    md += [f"| {r['relay']} | {r['state']} | {r['sessions']} | {r['step']} | {r['eta']} |" for r in rows]
    if plan is not None and plan.eta_all is not None:
        md += ["", f"all done (plan): **{plan.eta_all:%Y-%m-%d %H:%M} UTC**"
               + (f"; waits for the quota refresh at {', '.join(f'{w:%Y-%m-%d %H:%M}' for w in plan.quota_waits)}"
                  if plan.quota_waits else "")]
    png = None
    if any(s.started is not None for s in sessions):
        local.mkdir(parents=True, exist_ok=True)
        drawn = sessions[-TIMELINE_SESSIONS:]  # in start order: 200 relays' 400 sessions were a 20,000-pixel PNG
        title = "Relays timeline" + (f" (the newest {len(drawn)} of {len(sessions)} sessions)"
                                     if len(drawn) < len(sessions) else "")
        png = report.plot_timeline(drawn, local / "relays-timeline.png", title=title) \
            or local / "relays-timeline.png"
        data = base64.b64encode(Path(png).read_bytes()).decode()
        md += ["", f"![timeline](data:image/png;base64,{data})", f"`{png}`"]
    create_markdown_artifact(markdown="\n".join(md), key=f"{KEY}-summary", description="relays: state, ETA, timeline")
    return str(png) if png else None


class ReportInBackground:
    """The relays report published by a thread of its own, beside the flow's loop: a version (two artifacts and a
    PNG, seconds at 200 relays) no longer holds up the loop that sees a session's end and pushes the queue's head
    into its slot (issue 60). One version at a time; a newer one replaces one not started yet. A report that
    fails is said in the log and never stops the relays."""

    def __init__(self):
        self._next: Optional[tuple] = None
        self._thread: Optional[threading.Thread] = None
        self._guard = threading.Lock()

    def publish(self, rows: List[dict], sessions: List[SessionRecord], local: Path, plan=None,
                wait: bool = False) -> None:
        """Publish this version (after the one being published); `wait`: return once it is published."""
        job = (contextvars.copy_context(), (rows, sessions, local, plan))  # the flow run's: its artifacts
        with self._guard:
            self._next = job
            if self._thread is None:
                self._thread = threading.Thread(target=self._publish, name="relays-report", daemon=True)
                self._thread.start()
        if wait:
            self.wait()

    def wait(self) -> None:
        with self._guard:
            thread = self._thread
        if thread is not None:
            thread.join()

    def _publish(self) -> None:
        while True:
            with self._guard:
                job, self._next = self._next, None
                if job is None:
                    self._thread = None
                    return
            context, args = job
            try:
                context.run(publish_relays_report, *args)
            except Exception as err:  # noqa: BLE001 - a report never stops a relay
                log.warning("the relays report was not published: %s", err)
