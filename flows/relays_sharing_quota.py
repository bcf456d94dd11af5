"""The relays flow: several run specs (folds, seeds, a sweep) trained at once under Kaggle's concurrent GPU
session cap and one weekly GPU quota.

Each round (flows/relay_rounds.py, the one driver the `relay` flow uses with one relay) takes every unfinished
relay's step, concurrently (relay/orchestrator/relay_step.py: observe, decide, hand over finished sessions and
recover from their failures, notify, show the running ones; no slot or quota needed), then fills the free slots
of each account's session limit (tasks/account_slots.py: its specs' kaggle.account_sessions, counted by the
account's Prefect limit), given to the relays waiting to push in the order they became ready (first come, first served;
one that just handed over goes to the back), as across every flow run on the server (tasks/slot_queue.py). Every
new session's budget is an equal share of the quota left among the unfinished relays (capped by its spec), so
one relay cannot spend the week alone. When the quota is spent, every waiting relay waits for the same refresh
(one wait for all), while sessions already running are still handed over. The run holds its relays' step locks
with one lease for all of them (tasks/run_step_locks.py: no write per relay per round), and its tags
name its accounts only (relay names are in its parameters and its relays table).

A relay that fails (a code error, its retries used up, a bad spec) is reported and left; the others go on.
Like `relay`, it keeps no state: kill it anywhere and start it again. `mode="tick"` does one round and returns.
"""
from __future__ import annotations

import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import List, Literal, Optional, Tuple, Union

from prefect import flow, get_run_logger

from flows.relay_rounds import FIRST_LOOKS, Relay, Round, run_round
from relay.orchestrator import joint_plan, measured, plan as planner, policy
from relay.orchestrator.kaggle.types import KernelState
from relay.orchestrator.policy import utc
from relay.orchestrator.relay_state import FINAL, IN_FLIGHT, State, Wait, overall
from relay.front_door import SpecParameter, spec_at_flow
from relay.shared.errors import InputError
from relay.shared.progress import Progress, SessionRecord
from relay.shared.spec import LoadedSpec
from relay.orchestrator import relay_step
from relay.orchestrator.relay_context import RelayFailed
from tasks import relay_host, relay_tasks
from tasks import relays_artifacts, run_labels
from tasks.account_slots import AccountSessions
from tasks.live_view import follow_sessions
from tasks.run_step_locks import RunStepLocks


def read_specs(specs: List[SpecParameter]) -> List[Tuple[str, Union[LoadedSpec, Exception]]]:
    """Each relay's spec parsed once, here at the flow's start (relay.front_door.spec_at_flow): (what names it
    before, the spec read, or why it could not be: one bad spec is that relay's failure, not everyone's)."""
    parsed: List[Tuple[str, Union[LoadedSpec, Exception]]] = []
    for spec in specs:
        try:
            parsed.append((run_labels.spec_name(spec), spec_at_flow(spec)))
        except (InputError, OSError) as err:
            parsed.append((run_labels.spec_name(spec), err))
    return parsed


def load_relays(specs: List[Tuple[str, Union[LoadedSpec, Exception]]], backend, state_dir: str,
                locks: Optional[RunStepLocks] = None, tick: bool = False) -> List[Relay]:
    relays = []
    for shown, loaded in specs:
        relay = Relay(str(loaded.path or shown) if isinstance(loaded, LoadedSpec) else shown, shown)
        try:
            if isinstance(loaded, Exception):
                raise loaded
            relay.ctx = relay_host.open_relay(loaded.spec, loaded.text, backend, state_dir, tick=tick,
                                              lock=locks.member(loaded.spec.name) if locks else None)
        except (InputError, OSError) as err:  # one bad spec is that relay's failure, not everyone's
            relay.fail(f"bad spec: {err}")
            relays.append(relay)
            continue
        relay.name = relay.ctx.spec.name
        relays.append(relay)
    names = [r.name for r in relays]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise InputError(f"relays: spec names must differ (they name the kernels and datasets): {duplicates}")
    return relays


def _ts(value) -> float:
    if value is None:
        return 0.0
    try:
        return planner.as_utc(value).timestamp()
    except (planner.PlanError, ValueError, TypeError):
        return 0.0


def joint_eta(relays: List[Relay], quota, cap: int, now: datetime) -> Optional[joint_plan.JointPlan]:
    """One plan across the relays (relay/orchestrator/joint_plan.py) from each relay's own remaining-session plan."""
    needs, done = {}, {}
    for relay in relays:
        if relay.failed or relay.state is State.DONE or not relay.progress:
            continue
        try:
            k = relay.ctx.spec.kaggle
            q = planner.QuotaState(quota.allowed_s, quota.used_s, quota.reserved_s, utc(quota.refresh_time), now) \
                if quota is not None and quota.refresh_time else \
                planner.quota_from_ledger([], now, total_allowed_s=k.weekly_gpu_quota)
            # the figures each relay's own plan uses (policy.forecast): start-up, save and hand-over as measured
            limits = policy.plan_limits(relay.ctx.spec, measured.overheads(relay.ctx.spec, relay.progress))
            p = planner.plan_from_progress(relay.progress, q, now, limits=limits,
                                           total_steps=relay.progress.total_steps)
        except (planner.PlanError, KeyError, TypeError, ValueError):
            continue  # no step time measured yet: no ETA for this relay
        needs[relay.name] = [s.budget_s for s in p.sessions]
        done[relay.name] = len(relay.progress.sessions)
    if not needs:
        return None
    allowed = quota.allowed_s if quota is not None and quota.allowed_s > 0 else 30 * 3600.0
    left = quota.remaining_s if quota is not None and quota.allowed_s > 0 else allowed
    refresh = utc(quota.refresh_time) if quota is not None and quota.refresh_time else planner.next_weekly_reset(now)
    running = [r.name for r in relays if r.state in IN_FLIGHT]
    return joint_plan.plan_jointly(needs, now=now, cap=cap, quota_left_s=left, quota_allowed_s=allowed,
                                   refresh_at=refresh, done_sessions=done, running=running,
                                   reserved_s=quota.reserved_s if quota is not None else 0.0)


def _plan(backend, relays: List[Relay], cap: int, now: datetime) -> Optional[joint_plan.JointPlan]:
    quota = relay_tasks.read_quota(backend) if any(r.progress for r in relays) else None
    return joint_eta(relays, quota, cap, now)


def _shown(relays: List[Relay], plan) -> tuple:
    """What the relays report shows: (rows, sessions, the ETAs to the minute)."""
    etas = [f"{when:%Y-%m-%d %H:%M}" for when in (plan.eta_all, *plan.quota_waits) if when] if plan else None
    return _rows(relays, plan), _sessions(relays), etas


def account_sessions(relays: List[Relay]) -> int:
    """The account's concurrent sessions, from its specs' kaggle.account_sessions (the smallest, if they differ):
    the one source of the cap, for one relay or many."""
    return min([r.ctx.spec.kaggle.account_sessions for r in relays if r.ctx is not None] or [2])


def one_account(specs: List[Tuple[str, Union[LoadedSpec, Exception]]]) -> Optional[str]:
    """The credentials block the specs name (kaggle.credentials_block): the cap and the quota are one account's.
    `specs`: as read_specs parsed them (a bad spec is that relay's failure, in load_relays, not everyone's)."""
    named = {loaded.spec.kaggle.credentials_block for _, loaded in specs if isinstance(loaded, LoadedSpec)}
    if len(named) > 1:
        raise InputError(f"relays: the specs name different kaggle.credentials_block ({sorted(map(str, named))});"
                         " one relays run drives one account: start one per account")
    return named.pop() if named else None


@flow(name="relays", log_prints=True, flow_run_name=run_labels.relays_run_name)
def relays(specs: List[SpecParameter], mode: Literal["watch", "tick"] = "watch", cap: Optional[int] = None,
           credentials_block: Optional[str] = None, poll_seconds: float = 30.0, max_hours: float = 24 * 28,
           state_dir: str = "runs", live_seconds: float = 30.0, step_lock_wait_s: float = 600.0) -> dict:
    """Advance (tick) or run to the end (watch) every relay in `specs`, at most the specs' kaggle.account_sessions
    sessions at once (`cap`: no longer read, kept so that runs created with it still start).
    Returns {"state", "relays": {name: {...}}, "quota_wait", "refused"}; raises RelayFailed at the end of a
    watch if any relay failed (after the others finished). `live_seconds` and `step_lock_wait_s` as in the
    `relay` flow, for each relay."""
    logger = get_run_logger()
    locks = RunStepLocks(step_lock_wait_s)  # one lease for every relay of this run
    slots = None
    try:
        parsed = read_specs(specs)  # each spec parsed once: its account, its relay, the text its pushes ship
        backend = relay_host.make_backend(credentials_block or one_account(parsed))
        logger.info("relays on Kaggle account %s", backend.username)
        all_relays = load_relays(parsed, backend, state_dir, locks, tick=mode == "tick")
        slots = _account_slots(backend, all_relays, cap, logger)
        return _drive(backend, all_relays, slots, mode, poll_seconds, max_hours, state_dir, live_seconds, locks,
                      logger)
    finally:
        if slots is not None:
            slots.close()
        locks.close()


def _account_slots(backend, all_relays: List[Relay], cap: Optional[int], logger) -> AccountSessions:
    """The `relay` flow's scheduler, here with several relays."""
    sessions_cap = account_sessions(all_relays)
    if cap is not None and cap != sessions_cap:
        logger.warning("relays: the cap parameter (%s) is no longer read: the account's sessions are its specs'"
                       " kaggle.account_sessions (%d)", cap, sessions_cap)
    slots = AccountSessions(backend.username, sessions_cap)
    for r in all_relays:
        if r.ctx is not None:
            slots.add(r.name, r.ctx.spec.kaggle.session_timeout + r.ctx.spec.kaggle.startup_overhead)
    return slots


def _drive(backend, all_relays: List[Relay], slots: AccountSessions, mode: str, poll_seconds: float,
           max_hours: float, state_dir: str, live_seconds: float, locks: RunStepLocks, logger) -> dict:
    sessions_cap = slots.sessions
    run_labels.label(name=run_labels.relays_name([r.name for r in all_relays], mode),  # named by stems before
                     add_tags=run_labels.account_tags(r.ctx.names.owner for r in all_relays if r.ctx))
    locks.hold([r.name for r in all_relays if r.ctx is not None])  # one write for all, before the first round
    give_up = time.monotonic() + max_hours * 3600
    announced_wait, refused, last_shown, still_running, ended = None, 0, None, frozenset(), {}
    next_report = 0.0  # when the relays report may show a new version (time.monotonic())
    reporter = relays_artifacts.ReportInBackground()  # published beside the loop, which follows the sessions meanwhile
    plan = None
    while True:
        rnd = run_round(backend, all_relays, slots, logger, still_running, ended, poll_seconds,
                        first_looks=len(all_relays) if mode == "tick" else FIRST_LOOKS)  # a tick looks at all
        refused += rnd.refused
        if rnd.quota_wait and rnd.quota_wait != announced_wait:
            waiting = [r.name for r in all_relays if r.waits_for is Wait.QUOTA]
            logger.warning("weekly GPU quota spent; %d relays wait until %s: %s", len(waiting), rnd.quota_wait,
                           ", ".join(waiting))
            announced_wait = rnd.quota_wait
        now = datetime.now(timezone.utc)
        active = [r for r in all_relays if r.state not in FINAL]
        ending = mode == "tick" or not active
        # the relays report (its ETAs, rows and timeline: O(relays) each, a PNG) only when a new version may be
        # shown, at most every live_seconds while relays run, never every loop: the loop follows the running
        # sessions and the queue's head, so its cost does not grow with the relays (issue 60)
        if ending or time.monotonic() >= next_report:
            plan = _plan(backend, all_relays, sessions_cap, now)
            shown = _shown(all_relays, plan)
            if shown != last_shown:  # a new version only when it shows something new (ETAs to the minute, as shown)
                reporter.publish(*shown[:2], Path(state_dir), plan, wait=ending)
                last_shown = shown
            next_report = time.monotonic() + live_seconds
        if ending:
            reporter.wait()
            summary = _summary(all_relays, rnd, plan, refused)
            failed = [r for r in all_relays if r.failed]
            if mode == "watch" and failed:
                raise RelayFailed("; ".join(f"{r.name}: {r.failed}" for r in failed))
            return summary
        if time.monotonic() > give_up:
            raise RelayFailed(f"gave up after {max_hours} h")
        delay = poll_seconds
        if rnd.quota_wait and not rnd.in_flight:  # nothing to hand over meanwhile: sleep to the refresh
            delay = max(poll_seconds, (rnd.quota_wait - now).total_seconds())
        if rnd.unseen:  # relays not looked at yet: the next round looks at them now
            still_running, ended = frozenset(), {}
            continue
        try:
            seen = _wait_on_sessions(active, rnd, poll_seconds, live_seconds, give_up)
        except Exception as err:  # noqa: BLE001 - Kaggle unanswered, status errors: the next round looks again
            logger.warning("following the running sessions stopped: %s; looking again in %.0f s", err, poll_seconds)
            seen = None
        # the relays whose session the wait saw still running: the next round need not look at them; unless
        # the wait ended with none ended: at a deadline (its own clock), when a session may be wedged
        at_deadline = seen is not None and not any(_finished(state) for state in seen.values())
        still_running = frozenset() if at_deadline else frozenset(
            r.name for r in active if r.state is State.RUNNING and r.step is not None
            and (seen or {}).get(r.step.action.run_id) in ("running", "queued"))
        ended = {r.name: seen[r.step.action.run_id] for r in active  # slots free, {relay: its kernel's end state}
                 if r.state is State.RUNNING and r.step is not None
                 and _finished((seen or {}).get(r.step.action.run_id))}
        if seen is None:
            time.sleep(min(delay, 3600))


def _wait_on_sessions(active: List[Relay], rnd: Round, poll_seconds: float, live_seconds: float,
                      give_up: float) -> Optional[dict]:
    """When nothing but a session's end can change a relay's state (each active relay runs a session or waits
    for a slot or the quota), wait in one task run until a session ends (or the quota refreshes, or a session's
    deadline passes), their views current; the next round then follows that event. None: a relay waits on
    something else (a claim, Kaggle's status lag): the flow polls. Returns the sessions' states as the wait last
    saw them ({run id: kernel state}), None when it did not wait."""
    running = [relay_step.following(r.ctx, r.step) for r in active if r.state is State.RUNNING]
    idle = all(r.state is State.RUNNING or r.waits_for is not None for r in active)
    if not running or None in running or not idle or rnd.refused:  # refused: a session not ours fills the cap
        return None
    until = give_up
    for r in active:  # a session past its deadline may be wedged: the next round looks at Kaggle then
        if r.state is State.RUNNING:
            look = 600.0 if r.step.deadline is None else r.step.deadline - time.time() + poll_seconds
            until = min(until, time.monotonic() + look)
    if rnd.quota_wait:
        until = min(until, time.monotonic() + max(0.0, (rnd.quota_wait - datetime.now(timezone.utc)).total_seconds()))
    return follow_sessions(running, ", ".join(s.run_id for s in running), poll_seconds, live_seconds, until,
                           show_ends=False)  # the round shows the ends, after the freed slots' pushes


def _finished(kernel_state: Optional[str]) -> bool:
    """Kaggle showed the session ended (its slot no longer counts there)."""
    return kernel_state in {s.value for s in KernelState if s.finished}


def _rows(relays: List[Relay], plan) -> List[dict]:
    rows = []
    for r in relays:
        p = r.progress
        eta = plan.eta.get(r.name) if plan else None
        rows.append({"relay": r.name, "state": r.failed and f"failed: {r.failed}"[:200] or r.shown,
                     "sessions": len(p.sessions) if p else 0,
                     "step": f"{p.global_step if p else 0} / {p.total_steps if p and p.has('total_steps') else '?'}",
                     "eta": eta.strftime("%Y-%m-%d %H:%M UTC") if eta else
                     ("-" if r.state is State.DONE else "unknown")})
    return rows


def _sessions(relays: List[Relay]) -> List[SessionRecord]:
    """All relays' handed-over sessions on one timeline, labelled by relay (the index a label, not a number)."""
    out = []
    for r in relays:
        for i, s in enumerate(r.progress.sessions if r.progress else (), 1):
            out.append(replace(s, index=f"{i} {r.name}"))
    return sorted(out, key=lambda s: _ts(s.started))


def _summary(relays: List[Relay], rnd: Round, plan, refused: int) -> dict:
    whole = overall([r.state for r in relays])
    if whole is State.RUNNING and rnd.quota_wait and not rnd.in_flight and not rnd.handed_over:
        whole = State.WAITING
    return {"state": whole.value, "refused": refused, "pushed": rnd.pushed, "handed_over": rnd.handed_over,
            "in_flight": rnd.in_flight, "quota_wait": rnd.quota_wait.isoformat() if rnd.quota_wait else None,
            "eta_all": plan.eta_all.isoformat() if plan and plan.eta_all else None,
            "relays": {r.name: {"state": r.shown, "error": r.failed,
                                "step": r.progress.global_step if r.progress else 0,
                                "sessions": len(r.progress.sessions) if r.progress else 0,
                                "weights_sha256": r.progress.weights_sha256 if r.progress else None,
                                "why": r.step.why if r.step and r.state is State.STOPPED else "",
                                **({"stored": r.step.stored} if r.step and r.step.stored is not None else {})}
                       for r in relays}}


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(relays(sys.argv[1:]), indent=1, default=str))
