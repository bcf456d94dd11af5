"""The relay flow: train a run spec to the end across as many Kaggle sessions as it takes.

Each iteration observes Kaggle, decides one step (relay.orchestrator.chain.decide) and does it. `mode="watch"` loops
until the work is done (a laptop, a self-hosted worker); `mode="tick"` does at most one step and returns
(a 15-minute schedule in Prefect or GitHub Actions: nothing waits 12 h). Both rebuild everything from
Kaggle, so killing the flow anywhere and starting it again continues the relay.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal, Optional

from prefect import flow, get_run_logger

from relay.orchestrator import chain, handoff, restore
from relay.preflight import load_spec
from relay.orchestrator.policy import budget_lowered, plan_text, session_budget, utc
from relay.orchestrator.chain import Do
from relay.orchestrator.kaggle.lease import Lease, LeaseBusy, LeaseLost, NotALease
from relay.orchestrator.kaggle.types import Refusal
from tasks import artifacts, relay_tasks as t
from tasks.step_lock import StepLock
from tasks.live_view import LiveView
from tasks.notify import Notifier


class RelayFailed(RuntimeError):
    pass


def make_backend(credentials_block: Optional[str] = None):
    """The real Kaggle, or the emulator when RELAY_KAGGLE_ENDPOINT is set; credentials from the
    environment / kaggle.json, or from a Prefect Secret block holding {"username", "key"} JSON."""
    from relay.orchestrator.kaggle import ClientBackend

    creds = None
    if credentials_block:
        from prefect.blocks.system import Secret

        value = Secret.load(credentials_block).get()
        creds = json.loads(value) if isinstance(value, str) else value
    return ClientBackend(creds, os.environ.get("RELAY_KAGGLE_ENDPOINT"))


@flow(name="relay", log_prints=True)
def relay(spec: str = "examples/price-demo.yaml", mode: Literal["watch", "tick"] = "watch",
          credentials_block: Optional[str] = None, poll_seconds: float = 30.0,
          max_hours: float = 24 * 14, state_dir: str = "runs", live_seconds: float = 30.0,
          tick_follow_seconds: float = 5.0, step_lock_wait_s: float = 600.0) -> dict:
    """Advance (tick) or run to the end (watch) the relay of `spec`. Returns {"state", "step", ...}.
    While a session runs its progress is refreshed every `live_seconds`; a tick reads its log for at most
    `tick_follow_seconds`. Each step waits at most `step_lock_wait_s` for another flow run of this relay on
    this Prefect server (tasks/step_lock.py; 0: no lock); pushes and hand-overs are claimed on Kaggle."""
    run_spec = load_spec(spec)
    backend = make_backend(credentials_block)
    names = chain.Names(backend.username, run_spec.name)
    local = Path(state_dir) / run_spec.name  # a cache only: everything here can be rebuilt from Kaggle
    local.mkdir(parents=True, exist_ok=True)
    tell = Notifier(run_spec.name, run_spec.notify.block)
    lock = StepLock(run_spec.name, step_lock_wait_s)
    try:
        return _drive(run_spec, Path(spec).read_text(), backend, names, local, mode, tell, poll_seconds,
                      time.monotonic() + max_hours * 3600, live_seconds, tick_follow_seconds, lock)
    except RelayFailed as err:
        artifacts.publish_stop(run_spec.name, str(err))
        reason = str(err).split("\n")[0]
        tell("stopped", "stopped-" + hashlib.sha256(reason.encode()).hexdigest()[:12],
             f"{run_spec.name} stopped and needs you: {reason}")
        raise
    finally:
        lock.release()


def _drive(run_spec, spec_text: str, backend, names: chain.Names, local: Path, mode: str, tell: Notifier,
           poll_seconds: float, give_up: float, live_seconds: float, tick_follow_seconds: float,
           lock: StepLock) -> dict:
    """The relay's loop: observe, decide, act; in tick mode one step. Observing, deciding and acting hold
    the step lock; waiting does not."""
    logger = get_run_logger()
    view = LiveView(backend, names, local, curve_every_s=6 * live_seconds,  # 3 min by default
                    notify=lambda key, text: tell("warning", key, text))
    lease = Lease(backend, run_spec.name, run_spec.kaggle.lease)
    try:
        return _loop(run_spec, spec_text, backend, names, local, mode, tell, poll_seconds, give_up, live_seconds,
                     tick_follow_seconds, lock, logger, view, lease)
    finally:  # claims of steps that took no effect: free for the next tick or run at once, not at expiry
        lease.release_open()


def _loop(run_spec, spec_text, backend, names, local, mode, tell, poll_seconds, give_up, live_seconds,
          tick_follow_seconds, lock, logger, view, lease) -> dict:
    """Observe, decide, act, until the relay is done or stopped (watch) or after one step (tick)."""
    reported = None  # the handed-over run the artifacts show

    def wait_or_return(why: str, until=None, lease_end: Optional[float] = None) -> Optional[str]:
        lock.release()
        return _wait_or_return(mode, why, until, poll_seconds, give_up, logger, lease_end)

    def claim(key: str):
        """(our claim on the step, None) or (None, what to do: a state to return, or "" to look again)."""
        try:
            return lease.acquire(key), None
        except LeaseBusy as busy:
            return None, wait_or_return(str(busy), lease_end=busy.claim.expires) or ""
        except NotALease as err:
            raise RelayFailed(str(err)) from None
        except Exception as err:  # noqa: BLE001 - Kaggle failing past the retries: look again later
            return None, wait_or_return(f"could not claim {key} on Kaggle: {err}") or ""

    while True:
        lock.acquire()
        obs = t.observe(backend, names, local)
        action = chain.decide(run_spec.name, obs)
        logger.info("decide: %s %s (%s)", action.do.value, action.run_id or "", action.reason)
        if obs.published and obs.published.get("run_id") != reported:
            metrics = handoff.published_metrics(backend, names, local, obs.published)
            plan = plan_text(run_spec, obs.published, t.read_quota(backend), datetime.now(timezone.utc))
            artifacts.publish_report(run_spec.name, obs.published, local, metrics, plan_text=plan,
                                     state=action.do.value)
            reported = obs.published.get("run_id")

        if action.do in (Do.HARVEST, Do.SALVAGE):
            held, state = claim(f"handover-{action.run_id}")
            if held is None:
                if state:
                    return _summary(state, obs.published, action)
                continue
            confirm = lease.guard(held)
            try:
                result = t.hand_over(backend, run_spec, names, action, obs, local, confirm=confirm)
            except LeaseLost as lost:
                state = wait_or_return(f"hand-over of {action.run_id} stopped: {lost}")
                if state:
                    return _summary(state, obs.published, action)
                continue
            if not result.ok and result.stale and \
                    handoff.pushed_within(backend, names, action.run_id, run_spec.kaggle.status_lag):
                # the lag's signature, not a failed session: even a pinned status/output may answer the previous
                # version for a while after a push. Look again (bounded by kaggle.status_lag); no new attempt
                state = wait_or_return(f"{result.reason} soon after its push: Kaggle's status lag; looking again")
                if state:
                    return _summary(state, obs.published, action)
                continue
            if chain.hit_session_limit(obs.kernel_state, obs.failure_message) and \
                    (result.ok or not budget_lowered(backend, names, run_spec)):
                # not transient: the same budget would hit the limit again; what it saved is handed over
                k = run_spec.kaggle
                advice = chain.session_limit_advice(action.session, session_budget(run_spec, None),
                                                    k.session_timeout, k.startup_overhead)
                saved = (f"Its checkpoint at step {result.step} is handed over." if result.ok else
                         f"Nothing was handed over ({result.reason}).")
                raise RelayFailed(f"{advice}. {saved}\n--- log tail ---\n{result.log_tail}")
            if result.ok:
                lease.took_effect(f"handover-{action.run_id}")
                if mode == "tick":
                    return _summary("handed-over", result.progress, action)
                continue
            corrupt = chain.mounted_checkpoint_corrupt(result.log_tail) if action.do is Do.SALVAGE else None
            if corrupt:  # not the session's fault: make the newest valid checkpoint version current again
                try:
                    confirm()
                    done = restore.restore_newest_valid(backend, names, f"{run_spec.name} checkpoint",
                                                        action.run_id, corrupt, local)
                except restore.NoValidCheckpoint as err:
                    raise RelayFailed(str(err)) from None
                except LeaseLost as lost:
                    done = f"restore after {action.run_id} stopped: {lost}"
                else:
                    lease.took_effect(f"handover-{action.run_id}")
                logger.warning("%s", done)
                if mode == "tick":
                    return _summary("restored", obs.published, action)
                continue
            code_error = chain.looks_like_code_error(result.log_tail) if action.do is Do.SALVAGE else None
            tell("session.failed", f"failed-{action.run_id}",
                 f"{run_spec.name}: session {action.session} ({action.run_id}) failed: {code_error or result.reason}")
            if code_error and not handoff.code_changed(backend, names, run_spec, spec_text):
                raise RelayFailed(f"session {action.session} failed with a code error: {code_error} (the code and"
                                  " spec are unchanged since that push: fix them, then run the relay again)\n"
                                  f"--- log tail ---\n{result.log_tail}")
            action = chain.new_attempt(run_spec.name, action, f"the code changed since: {code_error}") if code_error \
                else chain.retry_action(run_spec.name, action, run_spec.kaggle.max_failed_sessions + 1,
                                        result.reason)
            if action.do is Do.FAILED:
                raise RelayFailed(f"{action.reason}\n--- log tail ---\n{result.log_tail}")

        if action.do is Do.DONE:
            done = obs.published or {}
            tell("finished", "finished", f"{run_spec.name} finished at step {done.get('global_step')}, last eval"
                 f" {done.get('metrics')}; the final model is the Kaggle dataset {names.model_dataset}")
            return _summary("done", obs.published, action)
        if action.do is Do.FAILED:
            raise RelayFailed(action.reason)

        if action.do is Do.PUSH:
            last = ((obs.published or {}).get("sessions") or [{}])[-1]
            if (obs.published or {}).get("stop_reason") == "diverged" and \
                    not handoff.code_changed(backend, names, run_spec, spec_text):
                raise RelayFailed(f"session {len(obs.published['sessions'])} stopped itself: {last.get('diverged')}."
                                  f" Its checkpoint at step {obs.published['global_step']} is handed over. Change the"
                                  " spec or code (learning rate, data) and run the relay again, or set"
                                  " session.stop_on_divergence: false to train on")
            quota = t.read_quota(backend)
            budget = session_budget(run_spec, quota)
            logger.info("plan:\n%s", plan_text(run_spec, obs.published, quota, datetime.now(timezone.utc)))
            if budget <= run_spec.session.safety_margin:
                until = quota.refresh_time if quota is not None else None
                tell("quota-wait", f"quota-{until}", f"{run_spec.name}: the weekly GPU quota is spent; the relay"
                     f" waits until {until} UTC")
                state = wait_or_return(f"weekly GPU quota spent; waiting until {until}", until)
                if state:
                    return _summary(state, obs.published, action)
                continue
            session = handoff.session_kernel(run_spec, spec_text, names, action, budget,
                                             obs.features_published, has_checkpoint=obs.published is not None)
            held, state = claim(f"push-{action.run_id}")  # its act, SaveKernel, follows within seconds
            if held is None:
                if state:
                    return _summary(state, obs.published, action)
                continue
            pushed = t.push_session(backend, session)
            if pushed.refusal is None:
                lease.took_effect(f"push-{action.run_id}")
            else:
                until = quota.refresh_time if (pushed.refusal is Refusal.QUOTA and quota) else None
                state = wait_or_return(f"push refused ({pushed.refusal.value}): {pushed.message}", until)
                if state:
                    return _summary(state, obs.published, action)
                continue
            if mode == "tick":
                return _summary("pushed", obs.published, action)
            continue

        # Do.WAIT: the kernel is queued or running: follow its log and show the running session.
        lock.release()
        live = view.follow(action.run_id)
        if mode == "tick":  # what the stream gives within a bounded time
            live.wait(tick_follow_seconds)
            view.refresh(obs.published, obs.kernel_state or "starting")
            return _summary("running", obs.published, action)
        if time.monotonic() > give_up:
            raise RelayFailed(f"gave up waiting for {action.run_id}: the flow's max_hours have passed")
        waited = time.monotonic() + 600  # look at Kaggle again at least every 10 min
        state = "starting"
        while time.monotonic() < waited and state in ("starting", "queued", "running"):
            state = t.wait_for_kernel(backend, names.kernel, obs.kernel_version, max_seconds=live_seconds,
                                      poll_seconds=poll_seconds)
            view.refresh(obs.published, state)


def _wait_or_return(mode: str, why: str, until, poll_seconds: float, give_up: float, logger,
                    lease_end: Optional[float] = None) -> Optional[str]:
    """In tick mode, report "waiting" and return; in watch mode, sleep (until the quota refresh, if known;
    at most until another orchestrator's claim ends)."""
    logger.warning(why)
    if mode == "tick":
        return "waiting"
    if time.monotonic() > give_up:
        raise RelayFailed(f"gave up: {why}")
    delay = poll_seconds
    if until is not None:
        delay = max(poll_seconds, (utc(until) - datetime.now(timezone.utc)).total_seconds())
    if lease_end is not None:
        delay = min(delay, max(0.05, lease_end - time.time() + 0.05))
    time.sleep(min(delay, 3600))
    return None


def _summary(state: str, progress: Optional[dict], action: chain.Action) -> dict:
    progress = progress or {}
    return {"state": state, "run_id": action.run_id, "step": progress.get("global_step", 0),
            "total_steps": progress.get("total_steps"), "sessions": len(progress.get("sessions", [])),
            "metrics": progress.get("metrics", {}), "weights_sha256": progress.get("weights_sha256")}


if __name__ == "__main__":
    import sys

    print(json.dumps(relay(*sys.argv[1:2]), indent=1))
