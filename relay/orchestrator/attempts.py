"""Every attempt of a relay as a person reads it in the session table and the timeline: the sessions handed over
(progress.json's `sessions`) and the attempts that handed nothing over (killed and retried, wedged and deleted:
the `charges` with `failed`, relay/orchestrator/goodput.py), each with how it ended, why it failed and the steps it
lost. A pure function of the published progress.json, like the ledger: the table, the timeline and the chart agree.

Steps lost:
- a failed attempt trained from the checkpoint its retry resumed from (the next handed-over session's first step)
  to its newest progress line (`last_step` of its charge): all of them lost;
- a handed-over session that did not end cleanly (killed: salvaged at its last save) lost what it trained after
  that save: its newest progress line less its recorded end.
"""
from __future__ import annotations

import re
from typing import List, Mapping, Optional

from relay.orchestrator.goodput import CLEAN_ENDS

WEDGED = "wedged"
FAILED = "failed"
KILLED = "killed"


def session_of(run_id: str) -> Optional[int]:
    """<relay>-s003-a2 -> 3."""
    found = re.search(r"-s(\d+)-a\d+$", str(run_id or ""))
    return int(found.group(1)) if found else None


def steps_lost(session: Mapping, charge: Optional[Mapping]) -> Optional[int]:
    """A handed-over session's steps trained after its last save and trained again (killed), else None."""
    if not charge or session.get("stop_reason") in CLEAN_ENDS or charge.get("last_step") is None:
        return None
    lost = int(charge["last_step"]) - int(session.get("step_end") or 0)
    return lost if lost > 0 else None


def failed_attempts(progress: Optional[Mapping]) -> List[dict]:
    """The attempts that handed nothing over, as session records (index, run_id, started, ended, seconds,
    stop_reason "wedged" or "failed", why, steps_lost, step_start/step_end as far as it trained)."""
    progress = progress or {}
    sessions = progress.get("sessions") or []
    out = []
    for c in progress.get("charges") or []:
        if not c.get("failed"):
            continue
        index = session_of(c.get("run_id"))
        # its retry resumed from the checkpoint it resumed from: the first handed-over session of its index
        resumed = next((s.get("step_start") for s in sessions if s.get("index") == index
                        and s.get("step_start") is not None), None)
        started = _first(c.get("kaggle_start"), c.get("pushed_at"))
        ended = _first(c.get("kaggle_end"), c.get("kaggle_end_seen"))
        last = c.get("last_step")
        lost = max(0, int(last) - int(resumed)) if last is not None and resumed is not None else None
        out.append({"index": index, "run_id": c.get("run_id"), "started": started, "ended": ended,
                    "seconds": ended - started if started is not None and ended is not None else None,
                    "step_start": resumed, "step_end": last if lost is not None else None,
                    "stop_reason": WEDGED if c.get("wedged") else FAILED,
                    "why": "ran past its deadline, deleted" if c.get("wedged") else _why(c.get("failed")),
                    "steps_lost": lost, "failed_attempt": True})
    return out


def every_attempt(progress: Optional[Mapping]) -> List[dict]:
    """The handed-over sessions (with `steps_lost` where a kill cost steps, `wedged` where Kaggle ran it past its
    end) and the failed attempts, in the order they started."""
    progress = progress or {}
    charges = {c.get("run_id"): c for c in progress.get("charges") or []}
    out = []
    for s in progress.get("sessions") or []:
        charge = charges.get(s.get("run_id"))
        extra = {}
        lost = steps_lost(s, charge)
        if lost is not None:
            extra["steps_lost"] = lost
        if charge and charge.get("wedged"):
            extra["wedged"] = True
        if s.get("stop_reason") not in CLEAN_ENDS and s.get("ended") is not None:
            extra["stop_reason"] = KILLED  # salvaged at its last save: its record says where it was ("running")
        out.append({**s, **extra})
    failed = failed_attempts(progress)
    out += failed
    # failed attempts of session N go before its handed-over attempt; without a start they keep that place
    return sorted(out, key=lambda s: (s.get("index") or 0, not s.get("failed_attempt"), s.get("started") or 0))


def _why(failed: object) -> str:
    """The charge's reason without the "session 3 (<run id>) failed: " the row already says."""
    text = str(failed or "")
    return re.sub(r"^(retry: )?session \d+ \([^)]*\)( failed:)? ?", "", text).strip() or "failed"


def _first(*values) -> Optional[float]:
    for v in values:
        if isinstance(v, (int, float)):
            return float(v)
    return None
