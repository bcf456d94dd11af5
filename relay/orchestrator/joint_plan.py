"""One quota plan for several relays sharing Kaggle's concurrent-session cap and one weekly GPU quota.

Each relay's own plan (relay.orchestrator.plan.plan_from_progress) says how many sessions of what length it still needs.
This places all of them on `cap` slots: a free slot goes to the relay that is ready (its previous session
ended) and has had the fewest sessions so far (ties: the one that waited longest, then the name), and a session
that no longer fits in the quota left waits for the refresh, when the full weekly quota is back. The
result: an ETA per relay and for all of them, and the quota waits. Pure: no Kaggle, no clock.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Dict, List, Optional, Sequence


@dataclass
class JointPlan:
    eta: Dict[str, datetime]                   # end of each relay's last planned session
    eta_all: Optional[datetime]
    quota_waits: List[datetime] = field(default_factory=list)  # refreshes some session waited for
    order: List[tuple] = field(default_factory=list)           # (name, start, end) of every planned session


def plan_jointly(needs: Dict[str, Sequence[float]], *, now: datetime, cap: int, quota_left_s: float,
                 quota_allowed_s: float, refresh_at: datetime, period_s: float = 7 * 86400.0,
                 handoff_s: float = 0.0, done_sessions: Optional[Dict[str, int]] = None,
                 running: Sequence[str] = (), reserved_s: float = 0.0) -> JointPlan:
    """`needs[name]`: the billed seconds of each session the relay still needs, in order. A relay in
    `running` has its first session already under way (it holds a slot from `now`, its quota is being
    billed). `quota_left_s` is what Kaggle says is left, less `reserved_s`, its timeReserved: the time the running
    sessions still hold (kaggle-cli #1029). A running session's budget is charged only beyond what is reserved,
    so it is counted once, not once as reserved and again as its own budget."""
    if cap < 1:
        raise ValueError("cap: at least one concurrent session")
    queue = {name: list(budgets) for name, budgets in needs.items() if budgets}
    sessions = dict(done_sessions or {})
    ready = {name: now for name in queue}
    slots = [now] * cap
    plan = JointPlan(eta={}, eta_all=None)
    left, refresh = quota_left_s, refresh_at

    def place(name: str, start: datetime, budget: float) -> datetime:
        end = start + timedelta(seconds=budget)
        plan.order.append((name, start, end))
        plan.eta[name] = end
        ready[name] = end + timedelta(seconds=handoff_s)
        sessions[name] = sessions.get(name, 0) + 1
        return end

    reserved = max(0.0, reserved_s)
    for i, name in enumerate(n for n in running if n in queue):  # already started: it will bill its budget
        budget = queue[name].pop(0)
        held = min(budget, reserved)  # already out of quota_left_s
        reserved -= held
        left -= budget - held
        slots[i % cap] = place(name, now, budget)
    while any(queue.values()):
        slots.sort()
        t = slots[0]
        waiting = [n for n, q in queue.items() if q]
        candidates = [n for n in waiting if ready[n] <= t]
        if not candidates:
            t = min(ready[n] for n in waiting)
            candidates = [n for n in waiting if ready[n] <= t]
        name = min(candidates, key=lambda n: (sessions.get(n, 0), ready[n], n))
        budget = min(queue[name].pop(0), quota_allowed_s)  # no session outlasts a whole week's quota
        while t >= refresh:  # refreshes the simulation passed without waiting for them
            left, refresh = quota_allowed_s, refresh + timedelta(seconds=period_s)
        if budget > left:  # wait for the refresh: the full quota is back
            plan.quota_waits.append(refresh)  # one wait for all: no slot starts anything before it
            slots[1:] = [max(s, refresh) for s in slots[1:]]
            t, left, refresh = refresh, quota_allowed_s, refresh + timedelta(seconds=period_s)
        left -= budget
        slots[0] = place(name, t, budget)
    plan.eta_all = max(plan.eta.values(), default=None)
    return plan
