"""The relays flow's combined Prefect artifacts: one row per relay and one timeline of every relay's sessions."""
from __future__ import annotations

import base64
from pathlib import Path
from typing import List, Optional

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from relay.orchestrator import report
from relay.shared.progress import SessionRecord

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
