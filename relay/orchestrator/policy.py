"""The relay's policy beside its decision (relay.orchestrator.chain): how long the next session may train, the plan and ETA
a person reads, what to say after a session hit Kaggle's limit or was wedged, and when a session ran on another
environment than the one before it. Shared by the flows, `relay status` and `relay plan`; no Prefect here."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from typing import Optional

from relay.orchestrator import chain, handoff, measured, plan as planner
from relay.orchestrator.handoff import SESSION_LIMIT
from relay.shared import runtime
from relay.shared.progress import Progress, sessions_of


def utc(value: datetime) -> datetime:
    """The kaggle client parses quotaRefreshTime without a zone; Kaggle's times are UTC."""
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)


def session_budget(spec, quota) -> float:
    """Seconds of training to ask of the next session: the spec's budget, within Kaggle's session cap
    (less start-up), and within what is left of the weekly GPU quota."""
    k = spec.kaggle
    budget = min(spec.session.budget or math.inf, k.session_timeout - k.startup_overhead)
    if quota is not None and quota.allowed_s > 0:
        budget = min(budget, quota.remaining_s - k.startup_overhead)
    return budget


# A session's push asks Kaggle for what the session will take (docs/kaggle.md, "Kaggle's own timeout"): a hung or
# wedged session then costs that, not the 12 h cap.
FIRST_SESSION_S = 2 * 3600.0  # a session bounded by steps, none of whose steps was measured yet: at most 2 h
STEP_SLACK = 0.25             # on top of the slowest step time measured: a slower GPU of the shape, evals, noise
SLACK_FLOOR_S = 300.0         # ... and at least this much


def session_need(spec, progress: Progress | dict | None) -> Optional[float]:
    """Seconds of training the next session needs when its steps are known (session.max_steps, or the run's
    steps left): the steps at the slowest step time any recorded session measured (its wall time less its
    saves: start-up and restore inside it included, the safe side), with STEP_SLACK, plus the slowest save and
    session.safety_margin. Before a session measured a step: the same at the user's session.step_seconds, else
    (nothing known) FIRST_SESSION_S for a session bounded by steps. None where it cannot be told (a session bounded
    by time, a run of unknown length). A session slower than this stops at this budget and saves (stop reason
    `budget`), and the next one goes on, measured."""
    progress = Progress.read(progress) or Progress()
    total = progress.total_steps or _spec_steps(spec)
    left = None if total is None else max(0, int(total) - int(progress.global_step or 0))
    steps = min((n for n in (spec.session.max_steps, left) if n is not None), default=None)
    if steps is None:
        return None
    sessions = progress.sessions
    per_step = [((s.seconds or 0) - (s.save_seconds or 0)) / steps_of
                for s in sessions if (steps_of := (s.step_end or 0) - (s.step_start or 0)) > 0]
    per_step = [x for x in per_step if x > 0] or ([spec.session.step_seconds] if spec.session.step_seconds else [])
    if not per_step:
        return FIRST_SESSION_S if spec.session.max_steps is not None else None
    train = steps * max(per_step)
    save = max((s.save_seconds or 0.0 for s in sessions), default=0.0)
    return train + max(STEP_SLACK * train, SLACK_FLOOR_S) + save + spec.session.safety_margin


def push_budget(spec, quota, progress: Progress | dict | None) -> float:
    """The next session's budget as pushed: session_budget, no longer than the session needs (session_need).
    Kaggle's timeout for it follows (handoff.kaggle_timeout_s: the budget and the margins)."""
    need = session_need(spec, progress)
    return session_budget(spec, quota) if need is None else min(session_budget(spec, quota), need)


@dataclass(frozen=True)
class Forecast:
    """The one finish estimate: `relay status`, the progress artifact, the summary and the flow's log all say
    this (forecast), so they never show two finish times for one relay."""

    text: str                    # the plan as a person reads it, with where each figure comes from
    finish: Optional[datetime]   # when the run's last session ends (its final save done); None without a plan
    figures: measured.Overheads

    def line(self, now: datetime) -> str:
        """The finish as the progress artifact says it."""
        if self.finish is None:
            return ""
        return f"finish ~{planner.when(self.finish)} (in {planner.format_duration((self.finish - now).total_seconds())})"


def plan_limits(spec, figures: measured.Overheads) -> planner.SessionLimits:
    """The session limits a relay's plan uses: the spec's, with start-up, the final save and the hand-over as
    measured (relay/orchestrator/measured.py). A session bounded by time takes its start-up and the budget the
    relay pushes (session_budget: the spec's, within Kaggle's timeout less kaggle.startup_overhead); one bounded by
    steps (session.max_steps, or the run's end) its steps and its final save."""
    cap = min(spec.kaggle.session_timeout, figures.startup.seconds + session_budget(spec, None))
    return planner.SessionLimits(session_cap_s=cap, startup_s=figures.startup.seconds,
                                 save_s=spec.session.safety_margin + 1, handoff_s=figures.handover.seconds,
                                 min_train_s=0, max_steps=spec.session.max_steps, final_save_s=figures.save.seconds)


def plan_text(spec, progress: Progress | dict | None, quota, now: datetime, running=None) -> str:
    """forecast's text."""
    return forecast(spec, progress, quota, now, running).text


def forecast(spec, progress: Progress | dict | None, quota, now: datetime, running=None) -> Forecast:
    """Sessions left, their budgets and the finish date, from what was handed over and the account's quota, with
    the start-up, save and hand-over times the relay measured of its own sessions (the spec's until one was).
    `running` (relay.orchestrator.live_progress.Eta): the session that trains now, which keeps its real start and ends
    where the one estimate says, then saves; the sessions after it are planned from its end and a hand-over."""
    progress = Progress.read(progress)
    figures = measured.overheads(spec, progress, running_started=running.started_at if running else None)
    head, not_before, measured_steps = "", None, _measured_sessions(progress)
    step_source = (f"measured over {measured_steps} session{'s' if measured_steps > 1 else ''}" if measured_steps
                   else "measured in the running session" if running is not None
                   else "your estimate, session.step_seconds")
    if running is not None:
        start, end = (datetime.fromtimestamp(t, timezone.utc) for t in (running.started_at, running.session_ends_at))
        # Kaggle still shows it running: it ends no earlier than now (a process that ended while Kaggle keeps the
        # session, wedged or not yet seen ended, is saved and handed over after now, not at its last line)
        end = max(end, now)
        head = (f"running: session {running.session}, started {planner.when(start)}, ends ~{planner.when(end)}"
                f" at step {running.session_end_step} ({running.ends_by})\n")
        before = progress or Progress()
        progress = replace(before, global_step=running.session_end_step,
                           total_steps=before.total_steps or running.total_steps)
        saved = end + timedelta(seconds=figures.save.seconds)  # its final save
        if running.session_end_step >= running.total_steps:
            return Forecast(head + f"done at the running session's end, ~{planner.when(saved)}\n"
                            + _figures_line(None, step_source, figures), saved, figures)
        not_before = saved + timedelta(seconds=figures.handover.seconds)
    try:
        q = quota_state(spec, progress, quota, now)
        p = planner.plan_from_progress(progress or Progress(), q, now, limits=plan_limits(spec, figures),
                                       step_seconds_estimate=(1 / running.steps_per_s if running
                                                              else spec.session.step_seconds),
                                       total_steps=(progress.total_steps if progress else None) or _spec_steps(spec),
                                       steps_per_epoch=progress.steps_per_epoch if progress else None,
                                       not_before=not_before,
                                       sessions_before=1 if running is not None else 0)
        return Forecast(head + planner.format_plan(p) + "\n" + _figures_line(p, step_source, figures)
                        + limit_warning(spec, progress), p.finish, figures)
    except (planner.PlanError, KeyError, TypeError, ValueError) as err:
        if running is None and not (progress and progress.sessions):  # nothing measured a step yet
            err = ("no step time known: the first session asks Kaggle for"
                   f" {planner.format_duration(FIRST_SESSION_S)} and its progress lines bring its step time"
                   " (set session.step_seconds, or `relay plan SPEC --step-seconds S`, to plan from your estimate)")
        return Forecast(head + f"(no plan yet: {err})" + limit_warning(spec, progress), None, figures)


def quota_state(spec, progress: Progress | None, quota, now: datetime) -> planner.QuotaState:
    """The week's quota as every plan says it (`relay plan`, `relay status`, the summary): Kaggle's quota statistics
    (`quota`: the backend's answer) when read, its refresh time Kaggle's; else the relay's own sessions against
    kaggle.weekly_gpu_quota, refreshing at the weekly reset Kaggle is said to keep (Saturday 00:00 UTC), which the
    plan then names as assumed."""
    if quota is not None and quota.refresh_time:
        return planner.quota_from_api({"gpuQuota": {"timeUsed": quota.used_s, "totalTimeAllowed": quota.allowed_s,
                                                    "timeReserved": quota.reserved_s},
                                       "quotaRefreshTime": utc(quota.refresh_time)}, now)
    return planner.quota_from_ledger([(s.started, 0 if s.seconds is None else s.seconds) for s in sessions_of(progress)],
                                     now, total_allowed_s=spec.kaggle.weekly_gpu_quota)


def view_forecasts(spec, backend) -> tuple:
    """The live view's plan (the summary's) and finish (the progress text's), both `forecast`'s, as `relay status`
    says it, so the UI shows one finish time. The account's quota is read once per summary, not per update."""
    quota_seen: list = []  # the quota the last summary's plan read: the progress text's finish reuses it

    def plan(progress, eta) -> str:  # at the running session's events (a quarter, an eval, a warning)
        quota_seen[:] = [_quota(backend)]
        return plan_text(spec, progress, quota_seen[0], datetime.now(timezone.utc), running=eta)

    def finish(progress, eta) -> str:  # at every progress update: no Kaggle call of its own after the first
        if not quota_seen:
            quota_seen.append(_quota(backend))
        now = datetime.now(timezone.utc)
        return forecast(spec, progress, quota_seen[0], now, running=eta).line(now)

    return plan, finish


def _quota(backend):
    try:
        return backend.quota()
    except Exception:  # noqa: BLE001 - the plan falls back to the relay's own ledger
        return None


def _measured_sessions(progress: Optional[Progress]) -> int:
    """How many sessions planner.measured_step_seconds averages over (the last 3 that made progress)."""
    useful = [s for s in (progress.sessions if progress else ())
              if (s.step_end or 0) > (s.step_start or 0) and (s.seconds or 0) > 0]
    return min(3, len(useful))


def _figures_line(p, step_source: str, figures: measured.Overheads) -> str:
    step = f"step {p.step_seconds:.3g}s ({step_source}), " if p is not None else ""
    return f"figures: {step}{figures.text()}"


def _spec_steps(spec) -> Optional[int]:
    """The run's length where the spec states it (optim.max_steps); a recipe's epochs are known to its sessions."""
    return getattr(getattr(spec, "optim", None), "max_steps", None)


def budget_lowered(pushed_plan: dict, spec) -> bool:
    """After a session stopped at the limit left nothing to hand over: retry it only once the spec asks for
    a shorter session than the stopped attempt was pushed with (the budget is in the kernel's source: its plan)."""
    pushed = pushed_plan.get("budget")
    return pushed is not None and session_budget(spec, None) < float(pushed) - 1


def recovery(backend, names: chain.Names, spec, spec_text: str, action: chain.Action,
             result: chain.HandOverResult) -> chain.Recovery:
    """What chain.after_handover reads besides the hand-over: the spec's limits, and after a failed one what Kaggle
    shows of the failed session's push (its plan, read once)."""
    k = spec.kaggle
    facts = chain.Recovery(max_attempts=k.max_failed_sessions + 1, limit_advice=chain.session_limit_advice(
        action.session, session_budget(spec, None), k.session_timeout, k.startup_overhead))
    if result.ok:
        return facts
    pushed = backend.current_plan(names.kernel) or {}
    return replace(facts, pushed=pushed, lagging=result.stale and handoff.pushed_within(pushed, action.run_id,
                                                                                     k.status_lag),
                   budget_lowered=budget_lowered(pushed, spec),
                   code_changed=handoff.code_changed(backend, names, spec, spec_text, pushed))


def limit_warning(spec, progress: Progress | dict | None) -> str:
    """The plan says so when the last handed-over session was stopped at Kaggle's session limit."""
    progress = Progress.read(progress)
    if progress is None or progress.stop_reason != SESSION_LIMIT:
        return ""
    k = spec.kaggle
    session = len(progress.sessions) or 1
    return "\nwarning: " + chain.session_limit_advice(session, session_budget(spec, None), k.session_timeout,
                                                      k.startup_overhead)


def environment_change(progress: Progress | dict | None) -> Optional[str]:
    """What changed between the last two sessions of a progress.json (Kaggle's image, torch, CUDA, the CPU, the
    GPUs), as one line for a notification; None when nothing did or fewer than two sessions recorded it. The
    session itself marked exact resume unproven from its first step (progress.json's `exactness_lost`)."""
    progress = Progress.read(progress) or Progress()
    sessions = progress.sessions
    note = runtime.change_note(sessions[-2].as_mapping(), sessions[-1].as_mapping()) if len(sessions) > 1 else None
    return f"{progress.name or 'the relay'}: {note}" if note else None


def wedge_notice(name: str, then: chain.Action, published_step: int) -> str:
    """The one line a person is told, and the flow logs, about a wedged session (chain.on_wedged's `then`)."""
    if then.do is chain.Do.WAIT:
        return (f"{name}: {then.reason} (its GPU time still counts; `kaggle kernels delete` stops it, or set"
                " kaggle.on_wedged: delete)")
    return (f"{name}: {then.reason}; deleting its kernel (Kaggle's only way to stop it) after harvesting what it"
            f" left, then resuming from the last published checkpoint (step {published_step})")
