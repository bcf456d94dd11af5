"""The relays flow: several run specs (folds, seeds, a sweep) trained at once under Kaggle's concurrent GPU
session cap and one weekly GPU quota.

Each round takes every relay's step (tasks/relay_step.py, the one the `relay` flow takes: observe, decide, hand
over finished sessions and recover from their failures, notify, show the running ones; no slot or quota needed),
then fills the free slots of the account's session cap (tasks/account_slots.py, the scheduler the `relay` flow
uses with one relay: `cap` sessions in flight here, and the account's Prefect limit), given fairly to the
relays waiting to push in the order they became ready (first come, first served; one that just handed over goes
to the back), as across every flow run on the server (tasks/slot_queue.py). Every new session's budget is an equal share of the quota left among the unfinished relays (capped by
its spec), so one relay cannot spend the week alone. When the quota is spent, every waiting relay waits for
the same refresh (one wait for all), while sessions already running are still handed over.

A relay that fails (a code error, its retries used up, a bad spec) is reported and left; the others go on.
Like `relay`, it keeps no state: kill it anywhere and start it again. `mode="tick"` does one round and returns.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, List, Literal, Optional, Tuple, Union

from prefect import flow, get_run_logger

from relay.orchestrator import joint_plan, measured, plan as planner, policy
from relay.orchestrator.kaggle.types import Refusal
from relay.orchestrator.policy import push_budget, utc
from relay.orchestrator.relay_state import FINAL, IN_FLIGHT, LOOK_AGAIN, State, Wait, label, move, overall
from relay.front_door import SpecParameter, spec_at_flow
from relay.shared.errors import InputError
from relay.shared.progress import Progress, SessionRecord
from relay.shared.spec import LoadedSpec
from tasks import relay_step, relay_tasks
from tasks import relays_artifacts, run_labels
from tasks.account_slots import AccountSessions
from tasks.live_view import follow_sessions
from tasks.relay_step import RelayContext, RelayFailed, Step

MAX_ERROR_ROUNDS = 3  # a relay whose round raised this many times in a row (after task retries) is failed


@dataclass
class Relay:
    spec_path: str
    name: str
    ctx: Optional[RelayContext] = None
    failed: str = ""              # why it stopped for good (this flow run)
    errors: int = 0               # rounds in a row that raised
    state: State = State.NEW      # the state machine the `relay` flow drives too (relay/orchestrator/relay_state.py)
    waits_for: Optional[Wait] = None
    step: Optional[Step] = None   # what its last step found or did
    last_end: float = 0.0         # when its last handed-over session ended (fair order)

    @property
    def progress(self) -> Optional[Progress]:
        return self.step.progress if self.step else None

    def enter(self, state: State, step: Optional[Step] = None, waits_for: Optional[Wait] = None) -> None:
        self.state, self.waits_for = move(self.state, state), waits_for
        self.step = step or self.step

    def fail(self, why: str) -> None:
        self.failed = why
        self.enter(State.FAILED)

    @property
    def shown(self) -> str:
        """Its state in the relays table and the flow's result."""
        return label(self.state, self.waits_for, self.step.why if self.step else "")


@dataclass
class Round:
    rows: Dict[str, dict] = field(default_factory=dict)
    in_flight: List[str] = field(default_factory=list)
    pushed: List[str] = field(default_factory=list)
    handed_over: List[str] = field(default_factory=list)
    refused: int = 0
    quota_wait: Optional[datetime] = None  # the refresh every waiting relay waits for


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
                step_lock_wait_s: float = 0.0, tick: bool = False) -> List[Relay]:
    relays = []
    for shown, loaded in specs:
        relay = Relay(str(loaded.path or shown) if isinstance(loaded, LoadedSpec) else shown, shown)
        try:
            if isinstance(loaded, Exception):
                raise loaded
            relay.ctx = RelayContext.open(loaded.spec, loaded.text, backend, state_dir, step_lock_wait_s, tick=tick)
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


def _advance(relay: Relay, rnd: Round, slots: AccountSessions) -> None:
    """One relay's step (tasks/relay_step.py, as the `relay` flow takes it); after a hand-over it looks again,
    so that its next session may go into a slot this round."""
    step = relay_step.advance(relay.ctx)
    slots.stepped(relay.name, step.state)
    if step.state in LOOK_AGAIN:
        if step.state is State.HANDED_OVER:
            rnd.handed_over.append(relay.name)
        relay.enter(step.state, step)
        step = relay_step.advance(relay.ctx)
        slots.stepped(relay.name, step.state)
    if step.state is State.RUNNING:
        relay_step.show_running(relay.ctx, step)
    relay.enter(step.state, step, step.waits_for)
    sessions = step.progress.sessions if step.progress else ()
    relay.last_end = max([_ts(s.ended) for s in sessions] or [0.0])


def _ts(value) -> float:
    if value is None:
        return 0.0
    try:
        return planner.as_utc(value).timestamp()
    except (planner.PlanError, ValueError, TypeError):
        return 0.0


def run_round(backend, relays: List[Relay], slots: AccountSessions, logger) -> Round:
    """Every relay's step, then the ready ones pushed into the free slots in the order they became ready, each
    with an equal share of the quota left."""
    rnd = Round()
    for relay in relays:
        if relay.failed or relay.state is State.DONE:  # nothing left to do: no step, no lock, no write
            continue
        try:
            _advance(relay, rnd, slots)
            relay.errors = 0
        except RelayFailed as err:
            _failed(relay, str(err), slots, logger)
            relay_step.stopped(relay.ctx, err)
        except InputError as err:
            _failed(relay, str(err), slots, logger)
        except Exception as err:  # noqa: BLE001 - transient after the tasks' retries: try again next round
            relay.errors += 1
            relay.enter(State.ERROR)  # its slot as it was: the step says nothing of its session
            logger.warning("relay %s: %s (%d/%d)", relay.name, err, relay.errors, MAX_ERROR_ROUNDS)
            if relay.errors >= MAX_ERROR_ROUNDS:
                _failed(relay, f"{type(err).__name__}: {err}", slots)
    try:
        _fill_slots(backend, relays, slots, rnd, logger)
    finally:
        for relay in relays:
            if relay.ctx is not None:
                relay.ctx.close()  # another orchestrator may take a step that did not happen here at once
    rnd.in_flight = list(slots.in_flight)
    for relay in relays:
        if relay.state is State.READY:  # no slot, or no quota, this round
            relay.enter(State.WAITING, waits_for=Wait.QUOTA if rnd.quota_wait else Wait.SLOT)
    return rnd


def _failed(relay: Relay, why: str, slots: AccountSessions, logger=None) -> None:
    """The relay needs a person: reported and left (its slot given back unless its session runs)."""
    relay.fail(why)
    slots.failed(relay.name)
    if logger is not None:
        logger.error("relay %s failed: %s (the others go on)", relay.name, why)


def _fill_slots(backend, relays: List[Relay], slots: AccountSessions, rnd: Round, logger) -> None:
    """Push the ready relays into the free slots in the order they became ready (first come, first served, as
    across flow runs: tasks/slot_queue.py), each session's budget an equal share of the quota left among the
    unfinished relays."""
    ready = [r for r in relays if not r.failed and r.state is State.READY]
    if not ready or len(slots.in_flight) >= slots.sessions:
        return
    quota = relay_tasks.read_quota(backend)
    unfinished = [r for r in relays if r.state not in FINAL]
    turns = slots.in_turn([r.name for r in ready])
    ready.sort(key=lambda r: turns.index(r.name))
    for relay in ready:
        budget = push_budget(relay.ctx.spec, quota, relay.step.progress)  # no longer than it needs
        if quota is not None and quota.allowed_s > 0:
            budget = min(budget, quota.remaining_s / max(1, len(unfinished)))  # equal shares of what is left
        if budget <= relay.ctx.spec.session.safety_margin or rnd.quota_wait:
            rnd.quota_wait = utc(quota.refresh_time) if quota is not None and quota.refresh_time else None
            break
        if not slots.take(relay.name, relay.step.action.run_id):  # every session of the cap runs (here, or by the account's Prefect limit)
            break
        step = relay_step.push(relay.ctx, relay.step, budget, quota)
        slots.stepped(relay.name, step.state)
        if step.refusal is not None:
            logger.warning("relay %s: %s", relay.name, step.why)
            rnd.refused += 1
            if step.refusal is Refusal.QUOTA and quota is not None:
                rnd.quota_wait = utc(quota.refresh_time)
            break  # the cap (or the quota) is reached on Kaggle's side: the rest wait their turn
        relay.enter(step.state, step, step.waits_for)
        if step.state is State.WAITING:  # claimed by another orchestrator, or the claim failed: it tries again
            logger.info("relay %s: %s", relay.name, step.why)
        elif step.state is State.PUSHED:  # (or stopped by the user, `relay stop`, since its step observed)
            rnd.pushed.append(relay.name)
    if rnd.quota_wait:
        for relay in ready:
            if relay.state is State.READY:
                relay_step.quota_spent(relay.ctx, relay.step, quota)


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


def one_account(specs: List[Tuple[str, Union[LoadedSpec, Exception]]]) -> Optional[str]:
    """The credentials block the specs name (kaggle.credentials_block): the cap and the quota are one account's.
    `specs`: as read_specs parsed them (a bad spec is that relay's failure, in load_relays, not everyone's)."""
    named = {loaded.spec.kaggle.credentials_block for _, loaded in specs if isinstance(loaded, LoadedSpec)}
    if len(named) > 1:
        raise InputError(f"relays: the specs name different kaggle.credentials_block ({sorted(map(str, named))});"
                         " one relays run drives one account: start one per account")
    return named.pop() if named else None


@flow(name="relays", log_prints=True, flow_run_name=run_labels.relays_run_name)
def relays(specs: List[SpecParameter], mode: Literal["watch", "tick"] = "watch", cap: int = 2,
           credentials_block: Optional[str] = None, poll_seconds: float = 30.0, max_hours: float = 24 * 28,
           state_dir: str = "runs", live_seconds: float = 30.0, step_lock_wait_s: float = 600.0) -> dict:
    """Advance (tick) or run to the end (watch) every relay in `specs`, at most `cap` sessions at once.
    Returns {"state", "relays": {name: {...}}, "quota_wait", "refused"}; raises RelayFailed at the end of a
    watch if any relay failed (after the others finished). `live_seconds` and `step_lock_wait_s` as in the
    `relay` flow, for each relay."""
    logger = get_run_logger()
    if cap < 1:
        raise InputError(f"relays: cap {cap}: at least 1 concurrent session")
    parsed = read_specs(specs)  # each spec parsed once: its account, its relay, the text its pushes ship
    backend = relay_step.make_backend(credentials_block or one_account(parsed))
    logger.info("relays on Kaggle account %s", backend.username)
    all_relays = load_relays(parsed, backend, state_dir, step_lock_wait_s, tick=mode == "tick")
    slots = AccountSessions(backend.username, cap)  # the `relay` flow's scheduler, here with several relays
    for r in all_relays:
        if r.ctx is not None:
            slots.add(r.name, r.ctx.spec.kaggle.session_timeout + r.ctx.spec.kaggle.startup_overhead)
    run_labels.label(name=run_labels.relays_name([r.name for r in all_relays], mode),  # named by stems before
                     add_tags=run_labels.account_tags(r.ctx.names.owner for r in all_relays if r.ctx))
    give_up = time.monotonic() + max_hours * 3600
    announced_wait, refused, last_shown = None, 0, None
    while True:
        rnd = run_round(backend, all_relays, slots, logger)
        refused += rnd.refused
        if rnd.quota_wait and rnd.quota_wait != announced_wait:
            waiting = [r.name for r in all_relays if r.waits_for is Wait.QUOTA]
            logger.warning("weekly GPU quota spent; %d relays wait until %s: %s", len(waiting), rnd.quota_wait,
                           ", ".join(waiting))
            announced_wait = rnd.quota_wait
        quota = relay_tasks.read_quota(backend) if any(r.progress for r in all_relays) else None
        now = datetime.now(timezone.utc)
        plan = joint_eta(all_relays, quota, cap, now)
        rows, sessions = _rows(all_relays, plan), _sessions(all_relays)
        etas = [f"{when:%Y-%m-%d %H:%M}" for when in (plan.eta_all, *plan.quota_waits) if when] if plan else None
        shown = (rows, sessions, etas)
        if shown != last_shown:  # a new version only when it shows something new (ETAs to the minute, as shown)
            relays_artifacts.publish_relays_report(rows, sessions, Path(state_dir), plan)
            last_shown = shown
        summary = _summary(all_relays, rnd, plan, refused)
        active = [r for r in all_relays if r.state not in FINAL]
        if mode == "tick" or not active:
            failed = [r for r in all_relays if r.failed]
            if mode == "watch" and failed:
                raise RelayFailed("; ".join(f"{r.name}: {r.failed}" for r in failed))
            return summary
        if time.monotonic() > give_up:
            raise RelayFailed(f"gave up after {max_hours} h")
        delay = poll_seconds
        if rnd.quota_wait and not rnd.in_flight:  # nothing to hand over meanwhile: sleep to the refresh
            delay = max(poll_seconds, (rnd.quota_wait - now).total_seconds())
        try:
            waited = _wait_on_sessions(active, rnd, poll_seconds, live_seconds, give_up)
        except Exception as err:  # noqa: BLE001 - Kaggle unanswered, status errors: the next round looks again
            logger.warning("following the running sessions stopped: %s; looking again in %.0f s", err, poll_seconds)
            waited = False
        if not waited:
            time.sleep(min(delay, 3600))


def _wait_on_sessions(active: List[Relay], rnd: Round, poll_seconds: float, live_seconds: float,
                      give_up: float) -> bool:
    """When nothing but a session's end can change a relay's state (each active relay runs a session or waits
    for a slot or the quota), wait in one task run until a session ends (or the quota refreshes, or a session's
    deadline passes), their views current; the next round then follows that event. False: a relay waits on
    something else (a claim, Kaggle's status lag): the flow polls."""
    running = [relay_step.following(r.ctx, r.step) for r in active if r.state is State.RUNNING]
    idle = all(r.state is State.RUNNING or r.waits_for is not None for r in active)
    if not running or None in running or not idle or rnd.refused:  # refused: a session not ours fills the cap
        return False
    until = give_up
    for r in active:  # a session past its deadline may be wedged: the next round looks at Kaggle then
        if r.state is State.RUNNING:
            look = 600.0 if r.step.deadline is None else r.step.deadline - time.time() + poll_seconds
            until = min(until, time.monotonic() + look)
    if rnd.quota_wait:
        until = min(until, time.monotonic() + max(0.0, (rnd.quota_wait - datetime.now(timezone.utc)).total_seconds()))
    follow_sessions(running, ", ".join(s.run_id for s in running), poll_seconds, live_seconds, until)
    return True


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
