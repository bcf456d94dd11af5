"""One relay's step, the relay's algorithm, carried out the same way by the `relay` flow (one relay) and the
`relays` flow (several under one session cap and one quota): observe Kaggle, decide (chain.decide), hand a
finished session over under a claim on Kaggle, act on what chain.after_handover decides (restore a corrupt
checkpoint version, a new attempt once the code changed, a retry, stop), tell a person, show the running session,
and push when the flow gives the relay a slot and a budget. A flow adds only its own part: how it waits (watch or
tick), and, for several relays, the shared cap, the joint quota plan and the order in which ready relays get slots.
What it needs of the process it runs in (the Kaggle calls with retries, the log, the artifacts, a person told, the
step lock, the live view) is its context's (relay_context.py; tasks/relay_host.py gives Prefect's).
"""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import replace
from datetime import datetime, timezone
from typing import Optional

from relay.orchestrator import chain, goodput, handoff, restore, storage
from relay.orchestrator.chain import Do
from relay.orchestrator.relay_state import State, Wait
from relay.orchestrator.kaggle.lease import LeaseBusy, LeaseLost, NotALease
from relay.orchestrator.kaggle.selective_output import DiskSpaceError
from relay.orchestrator.kaggle.types import KaggleUnresponsive, Quota, Refusal
from relay.orchestrator.policy import environment_change, plan_text, recovery, wedge_notice
from relay.orchestrator.relay_context import RelayContext, RelayFailed, Step
from relay.orchestrator.session_view import Running
from relay.shared.progress import Charge, Progress


def advance(ctx: RelayContext) -> Step:
    """Observe, decide, and do what needs no session slot: hand over a finished session and recover from its
    failure, or stop. Returns "ready" with the next session's action, or the step taken or waited for; raises
    RelayFailed when the relay needs a person. Holds the step lock (ctx.pause releases it)."""
    logger = ctx.host.logger()
    ctx.lock.acquire()
    obs = ctx.host.observe(ctx.backend, ctx.names, ctx.local, ctx.spec.kaggle.startup_overhead)
    action = chain.decide(ctx.spec.name, obs)
    logger.info("decide: %s %s (%s)", action.do.value, action.run_id or "", action.reason)
    _report(ctx, obs, action)
    if action.do in (Do.HARVEST, Do.SALVAGE, Do.WEDGED):
        step = _wedged(ctx, obs, action) if action.do is Do.WEDGED else _hand_over(ctx, obs, action)
        if step.state is not State.READY:
            return step
        action = chain.unless_stopped(ctx.spec.name, obs, step.action)  # a retry is a push too
    if action.do is Do.STOPPED:
        logger.warning("%s", action.reason)
        return Step(State.STOPPED, action, obs, obs.published, why=action.reason)
    if action.do is Do.DONE:
        done = obs.published or Progress()
        ctx.tell("finished", "finished", f"{ctx.spec.name} finished at step {done.global_step}, last eval"
                 f" {done.metrics}; the final model is the Kaggle dataset {ctx.names.model_dataset}")
        return Step(State.DONE, action, obs, obs.published, stored=_stored(ctx))
    if action.do is Do.FAILED:
        raise RelayFailed(action.reason)
    if action.do is Do.PUSH:
        if obs.published is not None and obs.published.stop_reason == "diverged":
            stop = chain.diverged_unchanged(obs, handoff.code_changed(ctx.backend, ctx.names, ctx.spec, ctx.spec_text))
            if stop is not None:
                raise RelayFailed(stop.reason)
        return Step(State.READY, action, obs, obs.published)
    ahead = obs.deadline if obs.kernel_state == "running" and (obs.deadline or 0) > obs.observed_at else None
    return Step(State.RUNNING, action, obs, obs.published, deadline=ahead)


def _wedged(ctx: RelayContext, obs: chain.Observation, wedged: chain.Action) -> Step:
    """A session Kaggle still reports running past its deadline: tell a person, then per kaggle.on_wedged wait
    for Kaggle, or hand over what its output holds (if anything), delete its kernel so its quota stops, and go on
    from the last published checkpoint (chain.after_wedge)."""
    then = chain.on_wedged(wedged, ctx.spec.kaggle.on_wedged)
    notice = wedge_notice(ctx.spec.name, then, obs.published_step)
    told = ctx.tell("session.wedged", f"wedged-{wedged.run_id}", notice)
    if then.do is Do.WAIT:  # said once; every later look only decides it again
        ctx.host.logger().log(logging.WARNING if told else logging.INFO, "%s", notice)
        return Step(State.RUNNING, then, obs, obs.published)
    ctx.host.logger().warning("%s", notice)
    key = f"handover-{wedged.run_id}"
    held = _claim(ctx, key, obs, wedged)
    if isinstance(held, Step):
        return held
    confirm = ctx.lease.guard(held)
    harvested = None
    try:
        harvested = ctx.host.hand_over(ctx.backend, ctx.spec, ctx.names, wedged, obs, ctx.local,
                                          confirm=confirm)
        confirm()
    except LeaseLost as lost:
        return Step(State.WAITING, wedged, obs, obs.published, why=f"wedged {wedged.run_id}: stopped: {lost}")
    except (DiskSpaceError, KaggleUnresponsive):
        raise  # its output may hold a checkpoint: never deleted unread for want of disk here or of an answer
    except Exception as err:  # noqa: BLE001 - Kaggle may refuse a running session's output: nothing to harvest
        ctx.host.logger().warning("wedged %s: its output could not be read (%s); nothing harvested", wedged.run_id, err)
    pushed = _current_plan(ctx)  # the wedged attempt's push, read while its kernel is there
    ok = harvested is not None and harvested.ok
    then = chain.after_wedge(ctx.spec.name, wedged, ok, ctx.spec.kaggle.max_failed_sessions + 1)
    if not ok and then.do is Do.PUSH:  # deleted without a harvest: its GPU time is listed all the same
        _unlisted(ctx, wedged.run_id, harvested.log_tail if harvested is not None else "", then.reason, pushed,
                  wedged=True)
    # recorded on Kaggle before the delete, with the charges the retry carries: Kaggle can refuse the retry's push
    # for a while after a delete (the session count still counts the deleted session, kaggle-cli #185), and every
    # later look (this flow's, a tick's, another orchestrator's) must decide the same new attempt, never push the
    # deleted run id again, and push it with the deleted attempt's GPU time
    ctx.host.note_deleted(ctx.backend, ctx.names, wedged.run_id, ctx.unlisted if not ok else [])
    ctx.host.delete_kernel(ctx.backend, ctx.names.kernel)
    ctx.lease.took_effect(key)
    if then.failed:
        why_not = f" (its output: {harvested.reason})" if harvested is not None and not harvested.ok else ""
        _session_failed(ctx, wedged.run_id, then.failed + why_not
                        + _steps_lost(wedged.run_id, harvested.log_tail if harvested is not None else "", obs))
    if then.do is Do.FAILED:
        raise RelayFailed(then.reason)
    if then.do is Do.HANDED_OVER:
        return Step(State.HANDED_OVER, then, obs, harvested.progress)
    return Step(State.READY, then, obs, obs.published)  # the same session again, from the last published checkpoint


def _deleted_charges(obs: chain.Observation, action: chain.Action) -> list:
    """The failed attempts' charges recorded on Kaggle with the wedged run the relay deleted (the control record's
    deleted_charges), when `action` is that run's retry: the step that deleted may not be the one that pushes."""
    deleted, mine = chain.parse_run_id(obs.deleted_run), chain.parse_run_id(action.run_id)
    if deleted is None or mine is None or mine != (deleted[0], deleted[1] + 1):
        return []
    return [dict(c) for c in obs.deleted_charges]


def _stored(ctx: RelayContext) -> Optional[dict]:
    """What the relay stores on Kaggle, said in the flow's log and its summary (None when it cannot be read)."""
    try:
        stored = storage.relay_storage(ctx.backend, ctx.names)
    except Exception as err:  # noqa: BLE001 - a report never stops a relay
        ctx.host.logger().info("what the relay stores on Kaggle was not read: %s", err)
        return None
    ctx.host.logger().info("%s", storage.storage_line(stored, ctx.spec.kaggle.checkpoint_versions))
    return stored


def _steps_lost(run_id: str, log_tail: str, obs: chain.Observation) -> str:
    """"; 150 steps lost (it trained to step 418; the relay goes on from step 268)": what an attempt trained past the
    published checkpoint, from its newest progress line in its log; "" when its log shows none past it."""
    try:
        last = Charge.read(goodput.charge_record(run_id, log_tail or "", None, None)).last_step
    except Exception:  # noqa: BLE001 - a log that cannot be read costs the figure, never the relay
        return ""
    published = Progress.read(obs.published)
    published = int(published.global_step) if published is not None else 0
    if last is None or last <= published:
        return ""
    return f"; {last - published} steps lost (it trained to step {last}; the relay goes on from step {published})"


def _session_failed(ctx: RelayContext, run_id: str, why: str) -> None:
    """A failed session (a code error, a stall, another accelerator than asked): in the flow's log and told."""
    ctx.host.logger().warning("%s", why)
    ctx.tell("session.failed", f"failed-{run_id}", f"{ctx.spec.name}: {why}")


def _hand_over(ctx: RelayContext, obs: chain.Observation, action: chain.Action) -> Step:
    """Harvest or salvage a finished session under a claim, then carry out chain.after_handover's decision."""
    key = f"handover-{action.run_id}"
    held = _claim(ctx, key, obs, action)
    if isinstance(held, Step):
        return held
    confirm = ctx.lease.guard(held)
    try:
        result = ctx.host.hand_over(ctx.backend, ctx.spec, ctx.names, action, obs, ctx.local, confirm=confirm)
    except LeaseLost as lost:
        return Step(State.WAITING, action, obs, obs.published, why=f"hand-over of {action.run_id} stopped: {lost}")
    facts = recovery(ctx.backend, ctx.names, ctx.spec, ctx.spec_text, action, result)
    then = chain.after_handover(ctx.spec.name, action, result, obs, facts)
    if then.failed:  # its reason says why nothing was handed over: said once, with the steps it cost
        _session_failed(ctx, action.run_id, then.failed + _steps_lost(action.run_id, result.log_tail, obs))
    elif not result.ok:
        ctx.host.logger().warning("session %d not handed over: %s%s", action.session, result.reason,
                                 _steps_lost(action.run_id, result.log_tail, obs))
    if then.do is Do.HANDED_OVER:
        ctx.lease.took_effect(key)
        changed = environment_change(result.progress)  # Kaggle's image, torch, CUDA or the GPUs changed
        if changed:
            ctx.tell("warning", f"environment-{action.run_id}", f"{ctx.spec.name}: {changed}")
        return Step(State.HANDED_OVER, then, obs, result.progress)
    if then.do is Do.WAIT:
        return Step(State.WAITING, then, obs, obs.published, why=then.reason)
    if then.do is Do.RESTORE:
        return _restore(ctx, obs, then, confirm)
    if then.do is Do.FAILED:
        raise RelayFailed(then.reason)
    if not result.ok:  # a retry or a new attempt from the same checkpoint: this one handed nothing over
        _unlisted(ctx, action.run_id, result.log_tail, result.reason or then.reason, facts.pushed or None)
    return Step(State.READY, then, obs, obs.published)  # a new attempt or a retry


def _current_plan(ctx: RelayContext) -> Optional[dict]:
    try:
        return ctx.backend.current_plan(ctx.names.kernel)
    except Exception as err:  # noqa: BLE001 - the ledger never stops a relay
        ctx.host.logger().info("the pushed plan of %s not read: %s", ctx.names.kernel, err)
        return None


def _unlisted(ctx: RelayContext, run_id: str, log_tail: str, why: str, plan: Optional[dict],
              wedged: bool = False) -> None:
    """Record a failed attempt that hands nothing over (its push, from its pushed `plan`; its end as the relay
    saw it now) for the next push to carry: no published progress.json would list its GPU time otherwise."""
    try:
        record = goodput.failed_charge(run_id, log_tail, plan, time.time(), why, wedged=wedged)
        ctx.unlisted = goodput.failed_charges(plan, record)
    except Exception as err:  # noqa: BLE001 - the ledger never stops a relay
        ctx.host.logger().info("the charge of %s not recorded: %s", run_id, err)


def _restore(ctx: RelayContext, obs: chain.Observation, action: chain.Action, confirm) -> Step:
    """Not the session's fault: make the newest valid checkpoint version current again."""
    try:
        confirm()
        done = restore.restore_newest_valid(ctx.backend, ctx.names, f"{ctx.spec.name} checkpoint", action.run_id,
                                            action.reason, ctx.local)
    except restore.NoValidCheckpoint as err:
        raise RelayFailed(str(err)) from None
    except LeaseLost as lost:
        return Step(State.WAITING, action, obs, obs.published, why=f"restore after {action.run_id} stopped: {lost}")
    ctx.lease.took_effect(f"handover-{action.run_id}")
    ctx.host.logger().warning("%s", done)
    return Step(State.RESTORED, action, obs, obs.published)


def push(ctx: RelayContext, ready: Step, budget_s: float, quota: Optional[Quota]) -> Step:
    """Push the ready relay's next session with `budget_s` of training, under a claim on Kaggle: "pushed",
    "waiting" (claimed by another orchestrator; refused by Kaggle, with the refusal), or "stopped" (by the user
    since the step observed)."""
    action, obs = ready.action, ready.obs
    charges = ctx.unlisted or _deleted_charges(obs, action)  # an earlier step's delete: its record on Kaggle
    session = handoff.session_kernel(ctx.spec, ctx.spec_text, ctx.names, action, budget_s, obs.features_published,
                                     has_checkpoint=obs.published is not None, charges=tuple(charges))
    key = f"push-{action.run_id}"
    held = _claim(ctx, key, obs, action)  # its act, SaveKernel, follows within seconds
    if isinstance(held, Step):
        return held
    stop = ctx.host.user_stop(ctx.backend, ctx.names)  # a `relay stop` since this step observed: no push
    if stop:
        stopped = chain.unless_stopped(ctx.spec.name, replace(obs, stopped_by_user=stop), action)
        return Step(State.STOPPED, stopped, obs, obs.published, why=stopped.reason)
    pushed = ctx.host.push_session(ctx.backend, session)
    if pushed.refusal is not None:
        until = quota.refresh_time if (pushed.refusal is Refusal.QUOTA and quota) else None
        return Step(State.WAITING, action, obs, obs.published, why=f"push refused ({pushed.refusal.value}):"
                    f" {pushed.message}", until=until, refusal=pushed.refusal)
    ctx.lease.took_effect(key)
    ctx.unlisted = []  # in the pushed plan now
    return Step(State.PUSHED, action, obs, obs.published)


def plan(ctx: RelayContext, progress: Optional[Progress], quota: Optional[Quota]) -> None:
    ctx.host.logger().info("plan:\n%s", plan_text(ctx.spec, progress, quota, datetime.now(timezone.utc)))


def quota_spent(ctx: RelayContext, ready: Step, quota: Optional[Quota]) -> Step:
    """The weekly GPU quota cannot pay for a session: wait for its refresh (told once per refresh)."""
    until = quota.refresh_time if quota is not None else None
    ctx.tell("quota-wait", f"quota-{until}", f"{ctx.spec.name}: the weekly GPU quota is spent; the relay waits"
             f" until {until} UTC")
    return Step(State.WAITING, ready.action, ready.obs, ready.progress,
                why=f"weekly GPU quota spent; waiting until {until}", until=until, waits_for=Wait.QUOTA)


def show_running(ctx: RelayContext, running: Step, catch_up_s: Optional[float] = None):
    """Follow the running session's log and refresh its live view (progress, table, curves, early warnings);
    given `catch_up_s` (a tick), once more with what the log gives within that many seconds."""
    # a session still running past its deadline is wedged: the progress card says so
    live = ctx.view.follow(running.action.run_id, running.deadline)
    ctx.view.refresh(running.progress, running.obs.kernel_state or "starting")
    if catch_up_s is not None:  # a tick's view: catches up
        live.wait(catch_up_s)
        ctx.view.refresh(running.progress, running.obs.kernel_state or "starting")
    return live


def show_end(ctx: RelayContext, running: Step, kernel_state: str) -> None:
    """The last lines of a session the flow saw end, in the live view that followed it (the relays flow gives the
    freed slot away first, then shows the end beside the hand-over)."""
    ctx.view.show_end(running.action.run_id, running.progress, kernel_state)  # not followed: the hand-over shows it


def following(ctx: RelayContext, running: Step) -> Optional[Running]:
    """The running session to wait on (tasks/live_view.py follow_sessions); None while Kaggle does not show its
    version yet (right after a push)."""
    if not running.obs.kernel_version:
        return None
    return Running(ctx.view, running.action.run_id, running.obs.kernel_version, running.progress)


def stopped(ctx: RelayContext, err: RelayFailed) -> None:
    """The relay stopped and needs a person: the summary artifact says why, and a person is told once."""
    ctx.host.publish_stop(ctx.spec.name, str(err))
    reason = str(err).split("\n")[0]
    ctx.tell("stopped", "stopped-" + hashlib.sha256(reason.encode()).hexdigest()[:12],
             f"{ctx.spec.name} stopped and needs you: {reason}")


def _claim(ctx: RelayContext, key: str, obs: chain.Observation, action: chain.Action):
    """Our claim on the step, or the "waiting" Step to return instead."""
    try:
        return ctx.lease.acquire(key)
    except LeaseBusy as busy:
        return Step(State.WAITING, action, obs, obs.published, why=str(busy), lease_end=busy.claim.expires)
    except NotALease as err:
        raise RelayFailed(str(err)) from None
    except Exception as err:  # noqa: BLE001 - Kaggle failing past the retries: look again later
        return Step(State.WAITING, action, obs, obs.published, why=f"could not claim {key} on Kaggle: {err}")


def _report(ctx: RelayContext, obs: chain.Observation, action: chain.Action) -> None:
    """The session table, curves and plan as artifacts, once per handed-over session."""
    if obs.published and obs.published.run_id != ctx.reported:
        metrics = handoff.published_metrics(ctx.backend, ctx.names, ctx.local, obs.published)
        text = plan_text(ctx.spec, obs.published, ctx.host.read_quota(ctx.backend), datetime.now(timezone.utc))
        ctx.host.publish_report(ctx.spec.name, obs.published, ctx.local, metrics, plan_text=text,
                                 state=action.do.value, links=ctx.links, save_every_s=ctx.spec.session.save_every)
        done, total = obs.published.global_step, obs.published.total_steps or 1
        ctx.view.show_progress(done, total, f"{ctx.spec.name}: step {done} of {total},"
                               f" {len(obs.published.sessions)} session(s) handed over; next:"
                               f" {action.do.value}; updated {datetime.now(timezone.utc):%H:%M:%S} UTC")
        ctx.reported = obs.published.run_id
