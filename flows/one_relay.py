"""The relay flow: train a run spec to the end across as many Kaggle sessions as it takes.

Each iteration observes Kaggle, decides one step (relay.orchestrator.chain.decide) and does it. `mode="watch"` loops
until the work is done (a laptop, a self-hosted worker); `mode="tick"` does what needs no waiting and returns (a
15-minute schedule in Prefect or GitHub Actions: nothing waits 12 h): a hand-over, then the next session's push,
as the `relays` flow's round does, so no session waits a whole tick after the one before it ended. Both rebuild
everything from Kaggle, so killing the flow anywhere and starting it again continues the relay.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Literal, Optional

from prefect import flow, get_run_logger

from relay.orchestrator.kaggle.types import KaggleUnresponsive
from relay.orchestrator.relay_state import State, Wait
from relay.orchestrator.policy import plan_text, session_budget, utc  # noqa: F401 - plan_text: part of the flow's API
from relay.front_door import SpecParameter, spec_at_flow
from flows import relay_rounds as rounds
from flows.relay_rounds import Relay
from relay.orchestrator import relay_step
from relay.orchestrator.relay_context import RelayContext, RelayFailed, Step  # noqa: F401 - the flow's API
from tasks import relay_host, run_labels
from tasks.account_slots import AccountSessions
from tasks.live_view import follow_sessions

# A watch waiting for the weekly quota looks at it again this often before the refresh Kaggle announced: the
# announced time is when the oldest charged session leaves the 7-day window, and quota freed sooner is used.
# A watch waiting for a slot of its account's limit takes a whole step (Kaggle looked at again) at least as often.
QUOTA_RECHECK_S = 15 * 60.0


@flow(name="relay", log_prints=True, flow_run_name=run_labels.relay_run_name)
def relay(spec: SpecParameter = "examples/price-demo.yaml", mode: Literal["watch", "tick"] = "watch",
          credentials_block: Optional[str] = None, poll_seconds: float = 30.0,
          max_hours: float = 24 * 14, state_dir: str = "runs", live_seconds: float = 30.0,
          tick_follow_seconds: float = 5.0, step_lock_wait_s: float = 600.0) -> dict:
    """Advance (tick) or run to the end (watch) the relay of `spec`. Returns {"state", "step", ...}.
    While a session runs the flow waits on it in one task run, its progress refreshed every `live_seconds`
    (tasks/live_view.py: log lines and artifact versions at its events only); a tick reads its log for at most
    `tick_follow_seconds`. Each step waits at most `step_lock_wait_s` for another flow run of this relay on
    this Prefect server (tasks/step_lock.py; 0: no lock); pushes and hand-overs are claimed on Kaggle.
    The Kaggle account: `credentials_block`, else the spec's kaggle.credentials_block, else the worker's
    environment; each session holds a slot of the account's session limit until it is handed over
    (tasks/account_slots.py: the scheduler of the `relays` flow, here with one relay).
    `spec`: the path of a spec file, or its YAML text (a deployment run), or the spec `relay run` read; parsed
    once, here (relay.front_door.spec_at_flow)."""
    loaded = spec_at_flow(spec)  # the one parse in this process: the spec, and the text a push ships
    run_spec = loaded.spec
    backend = relay_host.make_backend(credentials_block or run_spec.kaggle.credentials_block)
    ctx = relay_host.open_relay(run_spec, loaded.text, backend, state_dir, step_lock_wait_s, tick=mode == "tick")
    get_run_logger().info("relay %s on Kaggle account %s", run_spec.name, ctx.backend.username)
    run_labels.label(name=run_labels.relay_name(run_spec.name, mode),  # named by a path's stem before the parse
                     add_tags=run_labels.tags(ctx.spec.name, ctx.names.owner))
    pace = Pace(mode, poll_seconds, time.monotonic() + max_hours * 3600, live_seconds, tick_follow_seconds)
    slots = AccountSessions(ctx.backend.username, run_spec.kaggle.account_sessions)
    slots.add(run_spec.name, run_spec.kaggle.session_timeout + run_spec.kaggle.startup_overhead)
    try:
        summary = drive(ctx, pace, slots)
        if mode == "watch":  # the runs list says how the watch ended, not the last session it followed
            run_labels.label(name=f"{ctx.spec.name}: {summary.get('state')} at step {summary.get('step')}")
        return summary
    except RelayFailed as err:
        slots.failed(run_spec.name)  # it pushes nothing until a person acts
        relay_step.stopped(ctx, err)
        raise
    finally:
        slots.close()
        ctx.close()


@dataclass(frozen=True)
class Pace:
    """How the flow waits: tick (what needs no waiting, then return) or watch (until the work is done or
    `give_up`)."""

    mode: str
    poll_seconds: float
    give_up: float             # time.monotonic() past which a watch stops waiting
    live_seconds: float        # how often the running session's view is refreshed
    tick_follow_seconds: float


def drive(ctx: RelayContext, pace: Pace, slots: Optional[AccountSessions] = None) -> dict:
    """The relay's loop: one step (relay/orchestrator/relay_step.py), then wait or return; in tick mode it
    returns at the first wait or push. A watch outlives a Kaggle that stops answering (every step is rebuilt from
    Kaggle); a tick reports it."""
    while True:
        try:
            return _steps(ctx, pace, slots)
        except KaggleUnresponsive as err:
            if pace.mode == "tick" or time.monotonic() > pace.give_up:
                raise
            ctx.pause()
            get_run_logger().warning("%s; looking again in %.0f s", err, pace.poll_seconds)
            time.sleep(pace.poll_seconds)


def _steps(ctx: RelayContext, pace: Pace, slots: Optional[AccountSessions]) -> dict:
    relay = Relay(ctx.spec.name, ctx.spec.name, ctx)  # its one state: the `relays` flow's Relay, here alone
    slots = slots or AccountSessions(ctx.backend.username, ctx.spec.kaggle.account_sessions)
    if ctx.spec.name not in slots.slots:
        slots.add(ctx.spec.name, ctx.spec.kaggle.session_timeout + ctx.spec.kaggle.startup_overhead)
    while True:
        step = rounds.step(relay, slots)
        if step.state is State.READY:  # the one push loop, the `relays` flow's, over this one relay
            rounds.push_in_turn(ctx.backend, [relay], slots, rounds.Round(), get_run_logger())
            step = relay.step
        if step.state in (State.DONE, State.STOPPED) or (pace.mode == "tick" and step.state is State.PUSHED):
            return step.summary()
        if step.state is State.RUNNING:
            summary = _follow(ctx, step, pace)
        elif step.state is State.WAITING:
            summary = _wait(ctx, step, pace, slots)
        else:
            continue  # handed over, restored or pushed: look again
        if summary is not None:
            return summary


def _follow(ctx: RelayContext, running: Step, pace: Pace) -> Optional[dict]:
    """The kernel is queued or running: follow its log and show the running session; None: look again."""
    ctx.pause()
    if pace.mode == "tick":  # what the stream gives within a bounded time
        relay_step.show_running(ctx, running, catch_up_s=pace.tick_follow_seconds)
        return running.summary()
    relay_step.show_running(ctx, running)
    if time.monotonic() > pace.give_up:
        raise RelayFailed(f"gave up waiting for {running.action.run_id}: the flow's max_hours have passed")
    run_labels.label(name=f"{ctx.spec.name}: session {running.action.session}")
    session = relay_step.following(ctx, running)
    if session is None:  # not visible to Kaggle's status call yet: look again after one poll
        time.sleep(pace.poll_seconds)
        return None
    # until the session ends, or its deadline passed (is it wedged?): then the flow looks at Kaggle again; with
    # no deadline ahead (one passed: it is wedged and waited on), at least every 10 min
    look = 600.0 if running.deadline is None else running.deadline - time.time() + pace.poll_seconds
    try:
        follow_sessions([session], session.run_id, pace.poll_seconds, pace.live_seconds,
                        min(pace.give_up, time.monotonic() + look))
    except KaggleUnresponsive:
        raise  # drive() waits it out
    except Exception as err:  # noqa: BLE001 - status errors: the next step looks at Kaggle again
        get_run_logger().warning("following %s stopped: %s; looking again in %.0f s", session.run_id, err,
                                 pace.poll_seconds)
        time.sleep(pace.poll_seconds)
    return None


def _wait(ctx: RelayContext, waiting: Step, pace: Pace, slots: Optional[AccountSessions] = None) -> Optional[dict]:
    """In tick mode, end with "waiting"; in watch mode, sleep (until the quota refresh, if known; at most until
    another orchestrator's claim ends; for a slot of the account's limit, until one is free) and return None:
    look again."""
    ctx.pause()
    get_run_logger().warning(waiting.why)
    if pace.mode == "tick":
        return waiting.summary()
    if time.monotonic() > pace.give_up:
        raise RelayFailed(f"gave up: {waiting.why}")
    if waiting.waits_for is Wait.SLOT and slots is not None:
        # another relay's session may run for hours: no step per poll, only a read of the limit
        slots.wait_free(ctx.spec.name, min(pace.give_up, time.monotonic() + QUOTA_RECHECK_S), pace.poll_seconds)
        return None
    delay = pace.poll_seconds
    if waiting.until is not None:  # the refresh Kaggle announces; looked at again meanwhile, in case it moves
        delay = max(pace.poll_seconds, min(QUOTA_RECHECK_S,
                                           (utc(waiting.until) - datetime.now(timezone.utc)).total_seconds()))
    if waiting.lease_end is not None:
        delay = min(delay, max(0.05, waiting.lease_end - time.time() + 0.05))
    time.sleep(min(delay, 3600))
    return None


if __name__ == "__main__":
    import sys

    print(json.dumps(relay(*sys.argv[1:2]), indent=1))
