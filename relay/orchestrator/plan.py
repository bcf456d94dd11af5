"""Quota planner: split the remaining work into Kaggle sessions and forecast when it finishes.
(~410 lines: the model below, its planner and its text form stay in one place; plan_sessions is one
walk over the sessions, week by week, kept whole so the quota rules read in order.)

Pure functions over small dataclasses: no I/O and no clock reads (`now` is always a parameter), so the
flow, `relay plan` and the tests all get the same answer for the same inputs.

Model (times in seconds, datetimes timezone-aware UTC):
- A session bills `startup_s + steps * step_seconds + save_s` of GPU time (`final_save_s`, its measured final
  save, in place of the margin `save_s` when it ends at a step count) and may not exceed `session_cap_s`. Non-final sessions use their whole allotment (the runtime trains until its deadline);
  the final one is only as long as the remaining work needs.
- The weekly quota is charged at session start (Kaggle reserves it). A session may start when its billed
  time up to the next refresh fits in what is left this week; the part after the refresh is charged to the
  next week. When the leftover quota buys less than `min_train_s` of training, the session waits for the
  refresh instead: waiting is a state of the plan ("waiting until T"), never an error.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Iterable, Mapping

HOUR = 3600.0
WEEK_S = 7 * 24 * HOUR
SATURDAY = 5  # datetime.weekday(): Monday is 0
MAX_SESSIONS = 10_000  # a plan longer than this is a unit mix-up, not a training run


class PlanError(ValueError):
    """A bad planner input; the message is one line naming the field."""


@dataclass(frozen=True)
class SessionLimits:
    session_cap_s: float = 12 * HOUR   # Kaggle's per-session wall limit (GPU)
    startup_s: float = 10 * 60         # kernel boot, installs, restore, first step: billed, no progress
    save_s: float = 5 * 60             # final checkpoint save before the deadline
    handoff_s: float = 10 * 60         # harvest + publish checkpoint + push between sessions (not billed)
    min_train_s: float = 30 * 60       # leftover quota buying less training than this waits for the refresh
    concurrency: int = 1               # a relay chain is sequential; >1 only for independent work items
    max_steps: int | None = None       # optimizer steps per session (session.max_steps), whatever time is left
    # a session ending at a step count takes its steps, then its final save (measured), not the margin save_s
    # that a session ending at its deadline keeps; None: save_s
    final_save_s: float | None = None

    @property
    def max_train_s(self) -> float:
        return self.session_cap_s - self.startup_s - self.save_s


def limits_from_spec(spec: Any) -> SessionLimits:
    """A run spec's session limits. `session.budget` is the session's wall time after start-up (the SessionClock
    starts once the kernel has booted and restored), so it caps a session at start-up + budget, below Kaggle's
    timeout: vqa-t4's 11h30m trains 11h25m a session, not the 11h45m the 12 h timeout alone would allow."""
    cap = spec.kaggle.session_timeout
    if spec.session.budget is not None:
        cap = min(cap, spec.kaggle.startup_overhead + spec.session.budget)
    return SessionLimits(session_cap_s=cap, startup_s=spec.kaggle.startup_overhead, save_s=spec.session.safety_margin,
                         max_steps=spec.session.max_steps)


@dataclass(frozen=True)
class QuotaState:
    """The weekly GPU quota as seen at `observed_at`."""

    total_allowed_s: float
    used_s: float
    reserved_s: float
    refresh_at: datetime               # next refresh; afterwards the full quota is available again
    observed_at: datetime
    source: str = "api"                # "api" (GetAcceleratorQuotaStatistics) or "ledger"
    period_s: float = WEEK_S

    @property
    def remaining_s(self) -> float:
        return max(0.0, self.total_allowed_s - self.used_s - self.reserved_s)


@dataclass(frozen=True)
class PlannedSession:
    index: int                         # 1-based position in this plan
    starts: datetime
    budget_s: float                    # wall/billed seconds: startup + training + save
    train_s: float
    steps: int
    step_start: int
    step_end: int
    cumulative_gpu_s: float            # GPU time of this plan's sessions up to and including this one
    week: int                          # quota week it starts in: 1 = the current one
    waited_for_quota: bool             # its start was pushed to a quota refresh
    epoch_end: float | None = None     # epochs done at its end, when steps_per_epoch is known

    @property
    def ends(self) -> datetime:
        return self.starts + timedelta(seconds=self.budget_s)


@dataclass(frozen=True)
class Plan:
    now: datetime
    remaining_steps: int
    step_seconds: float
    limits: SessionLimits
    quota: QuotaState
    sessions: tuple[PlannedSession, ...] = field(default_factory=tuple)

    @property
    def done(self) -> bool:
        return self.remaining_steps == 0

    @property
    def finish(self) -> datetime | None:
        return max(s.ends for s in self.sessions) if self.sessions else None

    @property
    def waiting_until(self) -> datetime | None:
        """Set when the next session cannot start now for lack of quota."""
        first = self.sessions[0] if self.sessions else None
        return first.starts if first and first.waited_for_quota else None

    @property
    def state(self) -> str:
        if self.done:
            return "done"
        return "waiting" if self.waiting_until else "ready"

    @property
    def total_gpu_s(self) -> float:
        return self.sessions[-1].cumulative_gpu_s if self.sessions else 0.0


# ---------------------------------------------------------------- time helpers

def as_utc(value: datetime | float | int | str, name: str = "time") -> datetime:
    """A timezone-aware UTC datetime from a datetime, unix seconds or an ISO string."""
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise PlanError(f"{name} must be timezone-aware, got naive {value.isoformat()}")
        return value.astimezone(timezone.utc)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return datetime.fromtimestamp(float(value), tz=timezone.utc)
    if isinstance(value, str):
        try:
            parsed = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
        except ValueError:
            raise PlanError(f"{name}: not an ISO timestamp: {value!r}") from None
        return as_utc(parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc), name)
    raise PlanError(f"{name}: expected a datetime, unix seconds or ISO string, got {type(value).__name__}")


def last_weekly_reset(now: datetime, weekday: int = SATURDAY, hour: int = 0) -> datetime:
    """The most recent reset at or before `now` (UTC weekday/hour, e.g. Saturday 00:00)."""
    now = as_utc(now, "now")
    if not 0 <= weekday <= 6 or not 0 <= hour <= 23:
        raise PlanError(f"weekly reset: weekday must be 0..6 and hour 0..23, got {weekday}, {hour}")
    midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
    reset = midnight - timedelta(days=(now.weekday() - weekday) % 7) + timedelta(hours=hour)
    return reset - timedelta(days=7) if reset > now else reset


def next_weekly_reset(now: datetime, weekday: int = SATURDAY, hour: int = 0) -> datetime:
    return last_weekly_reset(now, weekday, hour) + timedelta(days=7)


def _seconds(value: Any, name: str) -> float:
    """Seconds from a timedelta, a number or the wire form "108000s"."""
    if value is None:
        return 0.0
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d+(\.\d+)?s?\s*", value):
        return float(value.strip().rstrip("s"))
    raise PlanError(f"{name}: not a duration: {value!r}")


def _get(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)


# ---------------------------------------------------------------- quota sources

def quota_from_api(stats: Any, now: datetime) -> QuotaState:
    """QuotaState from a GetAcceleratorQuotaStatistics answer: the wire dict (camelCase, "108000s")
    or the kagglesdk response object (timedelta/datetime fields)."""
    now = as_utc(now, "now")
    gpu = _get(stats, "gpuQuota") or _get(stats, "gpu_quota")
    if gpu is None:
        raise PlanError("gpuQuota: missing from the quota statistics")
    total = _seconds(_get(gpu, "totalTimeAllowed") or _get(gpu, "total_time_allowed"), "gpuQuota.totalTimeAllowed")
    if total <= 0:
        raise PlanError(f"gpuQuota.totalTimeAllowed must be > 0, got {total}")
    refresh_raw = _get(stats, "quotaRefreshTime") or _get(stats, "quota_refresh_time")
    refresh = as_utc(refresh_raw, "quotaRefreshTime") if refresh_raw else next_weekly_reset(now)
    while refresh <= now:  # a stale answer: the refresh it names already happened
        refresh += timedelta(seconds=WEEK_S)
    return QuotaState(
        total_allowed_s=total,
        used_s=_seconds(_get(gpu, "timeUsed") or _get(gpu, "time_used"), "gpuQuota.timeUsed"),
        reserved_s=_seconds(_get(gpu, "timeReserved") or _get(gpu, "time_reserved"), "gpuQuota.timeReserved"),
        refresh_at=refresh, observed_at=now, source="api")


def quota_from_ledger(
    records: Iterable[Any], now: datetime, *, total_allowed_s: float = 30 * HOUR,
    reset_weekday: int = SATURDAY, reset_hour: int = 0,
) -> QuotaState:
    """QuotaState from the relay's own ledger of billed sessions, when the API gives no statistics.

    `records` are (start, billed_seconds) pairs (start: datetime or unix seconds) or mappings with
    "start"/"started" and "billed_s"/"seconds". Only the part of a session after the last reset counts;
    a session still running at `now` counts in full (Kaggle reserves it)."""
    now = as_utc(now, "now")
    if total_allowed_s <= 0:
        raise PlanError(f"total_allowed_s must be > 0, got {total_allowed_s}")
    week_start = last_weekly_reset(now, reset_weekday, reset_hour)
    used = 0.0
    for i, record in enumerate(records):
        if isinstance(record, Mapping):
            start_raw = record.get("start", record.get("started"))
            billed_raw = record.get("billed_s", record.get("seconds"))
        else:
            start_raw, billed_raw = record
        start = as_utc(start_raw, f"ledger[{i}].start")
        billed = _seconds(billed_raw, f"ledger[{i}].billed_s")
        if billed < 0:
            raise PlanError(f"ledger[{i}].billed_s must be >= 0, got {billed}")
        end = start + timedelta(seconds=billed)
        if start > now or end <= week_start:
            continue
        used += (end - max(start, week_start)).total_seconds()
    return QuotaState(total_allowed_s=total_allowed_s, used_s=used, reserved_s=0.0,
                      refresh_at=week_start + timedelta(days=7), observed_at=now, source="ledger")


def measured_step_seconds(sessions: Iterable[Mapping[str, Any]], last: int = 3) -> float | None:
    """Seconds per step over the last `last` sessions of progress.json that made progress.

    Uses wall seconds minus save time, so restore and start-up inside the session are included:
    a slightly pessimistic step time, which is the safe side for a deadline."""
    useful = []
    for s in sessions:
        steps = (s.get("step_end") or 0) - (s.get("step_start") or 0)
        seconds = (s.get("seconds") or 0) - (s.get("save_seconds") or 0)
        if steps > 0 and seconds > 0:
            useful.append((steps, seconds))
    useful = useful[-last:]
    if not useful:
        return None
    return sum(sec for _, sec in useful) / sum(steps for steps, _ in useful)


# ---------------------------------------------------------------- the planner

def _validate(remaining_steps: int, step_seconds: float, limits: SessionLimits, quota: QuotaState) -> None:
    if isinstance(remaining_steps, bool) or not isinstance(remaining_steps, int) or remaining_steps < 0:
        raise PlanError(f"remaining_steps must be an integer >= 0, got {remaining_steps!r}")
    if not (isinstance(step_seconds, (int, float)) and math.isfinite(step_seconds) and step_seconds > 0):
        raise PlanError(f"step_seconds must be a finite number > 0, got {step_seconds!r}")
    for name in ("session_cap_s", "startup_s", "save_s", "handoff_s", "min_train_s"):
        if getattr(limits, name) < 0:
            raise PlanError(f"limits.{name} must be >= 0, got {getattr(limits, name)}")
    if limits.concurrency < 1:
        raise PlanError(f"limits.concurrency must be >= 1, got {limits.concurrency}")
    if limits.max_train_s <= 0:
        raise PlanError(f"limits.session_cap_s={limits.session_cap_s:g} leaves no training time after "
                        f"startup_s={limits.startup_s:g} + save_s={limits.save_s:g}")
    if step_seconds > limits.max_train_s:
        raise PlanError(f"step_seconds={step_seconds:g} is longer than a session's training time "
                        f"{limits.max_train_s:g}s (session_cap_s - startup_s - save_s)")
    if quota.total_allowed_s < limits.startup_s + step_seconds + limits.save_s:
        raise PlanError(f"quota.total_allowed_s={quota.total_allowed_s:g} cannot fit one session "
                        f"(startup_s + one step + save_s = {limits.startup_s + step_seconds + limits.save_s:g})")
    if quota.period_s <= 0:
        raise PlanError(f"quota.period_s must be > 0, got {quota.period_s}")


def plan_sessions(
    remaining_steps: int, step_seconds: float, quota: QuotaState, now: datetime, *,
    limits: SessionLimits = SessionLimits(), done_steps: int = 0,
    steps_per_epoch: int | None = None, not_before: datetime | None = None, first_index: int = 1,
) -> Plan:
    """Split `remaining_steps` into sessions that fit the per-session cap and the weekly quota.

    `done_steps` numbers the planned steps (global step of the first one), `first_index` the planned sessions
    (the run's session number of the first one); `not_before` delays the first
    session (a session still running, a handoff in progress). Sessions end mid-epoch when an epoch is
    longer than a session: the runtime resumes at the exact step."""
    now = as_utc(now, "now")
    _validate(remaining_steps, step_seconds, limits, quota)
    if steps_per_epoch is not None and steps_per_epoch <= 0:
        raise PlanError(f"steps_per_epoch must be > 0, got {steps_per_epoch}")
    start = max(now, as_utc(not_before, "not_before")) if not_before else now

    period = timedelta(seconds=quota.period_s)
    refresh, week = quota.refresh_at, 1
    left_this_week = quota.remaining_s
    carried_to_next = 0.0            # billed time of sessions that run past the refresh
    overhead = limits.startup_s + limits.save_s
    fresh_week_allotment = min(limits.session_cap_s, quota.total_allowed_s)

    slots = [start] * limits.concurrency  # when each concurrent slot is free next
    sessions: list[PlannedSession] = []
    steps_left, step_at, cumulative, clock = remaining_steps, done_steps, 0.0, start
    while steps_left > 0:
        if len(sessions) >= MAX_SESSIONS:
            raise PlanError(f"remaining_steps={remaining_steps} needs more than {MAX_SESSIONS} sessions")
        slot = min(range(len(slots)), key=slots.__getitem__)
        # Starts never go back in time: the quota below is tracked as a running balance.
        t, waited = max(slots[slot], clock), False
        while True:
            while t >= refresh:       # roll the quota week forward (also when `quota` was observed long ago)
                left_this_week = quota.total_allowed_s - carried_to_next
                carried_to_next, refresh, week = 0.0, refresh + period, week + 1
            to_refresh = (refresh - t).total_seconds()
            if left_this_week >= to_refresh:  # may run past the refresh; the rest bills next week
                allot = min(limits.session_cap_s, to_refresh + quota.total_allowed_s - carried_to_next)
            else:
                allot = min(limits.session_cap_s, left_this_week)
            train = allot - overhead
            needed = steps_left * step_seconds
            worth_it = train >= needed or (train >= limits.min_train_s and train >= step_seconds)
            # A full fresh-week allotment is as good as it gets: waiting longer would never end.
            if worth_it or (allot >= fresh_week_allotment and train >= step_seconds):
                break
            t, waited = refresh, True
        fits = int(train // step_seconds)
        steps = min(steps_left, fits, limits.max_steps or steps_left)
        if steps == fits < steps_left:  # it trains to its deadline
            budget, train = allot, allot - overhead
        else:                           # it ends at a step count, then saves
            train = steps * step_seconds
            budget = limits.startup_s + train + (limits.save_s if limits.final_save_s is None else limits.final_save_s)
        before_refresh = min(budget, to_refresh)
        left_this_week -= before_refresh
        carried_to_next += budget - before_refresh
        cumulative += budget
        sessions.append(PlannedSession(
            index=first_index + len(sessions), starts=t, budget_s=budget, train_s=train, steps=steps,
            step_start=step_at, step_end=step_at + steps, cumulative_gpu_s=cumulative, week=week,
            waited_for_quota=waited,
            epoch_end=(step_at + steps) / steps_per_epoch if steps_per_epoch else None))
        steps_left -= steps
        step_at += steps
        slots[slot] = t + timedelta(seconds=budget + limits.handoff_s)
        clock = t
    return Plan(now=now, remaining_steps=remaining_steps, step_seconds=float(step_seconds),
                limits=limits, quota=quota, sessions=tuple(sessions))


def plan_from_progress(
    progress: Mapping[str, Any], quota: QuotaState, now: datetime, *, limits: SessionLimits = SessionLimits(),
    step_seconds_estimate: float | None = None, total_steps: int | None = None,
    steps_per_epoch: int | None = None, not_before: datetime | None = None, sessions_before: int = 0,
) -> Plan:
    """Plan the rest of a run from its progress.json (a parsed dict; `{}` before the first session).

    The measured step time wins over the estimate; `total_steps` is needed only before the first
    session has written progress.json. Planned sessions are numbered after the run's sessions so far and
    `sessions_before` more (a session still running)."""
    total = progress.get("total_steps") or total_steps
    if not total:
        raise PlanError("total_steps: unknown (no progress.json yet): pass the run's total steps")
    done = int(progress.get("global_step") or 0)
    step_seconds = measured_step_seconds(progress.get("sessions") or []) or step_seconds_estimate
    if step_seconds is None:
        raise PlanError("step_seconds_estimate: no session has measured a step yet: pass an estimate")
    return plan_sessions(max(0, int(total) - done), step_seconds, quota, now, limits=limits, done_steps=done,
                         steps_per_epoch=steps_per_epoch, not_before=not_before,
                         first_index=len(progress.get("sessions") or []) + sessions_before + 1)


# ---------------------------------------------------------------- presentation

def format_duration(seconds: float) -> str:
    """'11h35m', '45m', '40s', '2d 3h' for a human reading a plan."""
    seconds = max(0, int(round(seconds)))
    days, rest = divmod(seconds, 86400)
    hours, minutes = rest // 3600, (rest % 3600) // 60
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m" if minutes else f"{seconds}s"


def when(t: datetime) -> str:
    return t.strftime("%a %Y-%m-%d %H:%M UTC")


def format_plan(plan: Plan) -> str:
    from relay.orchestrator.goodput import duration_text as gpu  # GPU time: 30h00m, 5m, 1.5s

    q = plan.quota
    # GPU time is written one way everywhere (duration_text: the summary's charge, the goodput ledger, this)
    quota_line = (f"quota: {gpu(q.remaining_s)} of {gpu(q.total_allowed_s)} GPU left this week"
                  f" (used {gpu(q.used_s)}, reserved {gpu(q.reserved_s)}); refreshes"
                  f" {when(q.refresh_at)}" + (" (Kaggle's quota statistics)" if q.source == "api" else
                                              " (assumed: Kaggle's weekly reset, Saturday 00:00 UTC; the quota"
                                              " statistics were not read)"))
    if plan.done:
        return f"done: no training steps left\n{quota_line}"
    header = ("session", "starts", "budget", "steps", "GPU so far", "week")
    rows = []
    for s in plan.sessions:
        starts = when(s.starts) + (" (quota wait)" if s.waited_for_quota else "")
        steps = f"{s.steps} ({s.step_start}->{s.step_end}"
        steps += f", ep {s.epoch_end:.2f})" if s.epoch_end is not None else ")"
        rows.append((str(s.index), starts, format_duration(s.budget_s), steps,
                     gpu(s.cumulative_gpu_s), str(s.week)))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    right = {0, 2, 4, 5}
    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    out = [line(header), "  ".join("-" * w for w in widths), *map(line, rows)]
    finish = plan.finish
    assert finish is not None
    out.append("")
    out.append(f"{len(plan.sessions)} sessions, {plan.remaining_steps} steps at {plan.step_seconds:.3g} s/step, "
               f"{gpu(plan.total_gpu_s)} GPU; finish {when(finish)} "
               f"(in {format_duration((finish - plan.now).total_seconds())})")
    if plan.waiting_until:
        out.append(f"waiting for quota until {when(plan.waiting_until)}")
    out.append(quota_line)
    return "\n".join(out)

