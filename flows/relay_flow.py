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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

from prefect import flow, get_run_logger

from relay.orchestrator import chain, handoff, restore
from relay.orchestrator.chain import Do
from relay.orchestrator.kaggle.lease import Lease, LeaseBusy, LeaseLost, NotALease
from relay.orchestrator.kaggle.types import KaggleUnresponsive, Refusal
from relay.orchestrator.policy import budget_lowered, plan_text, session_budget, utc
from relay.preflight import load_spec
from tasks import artifacts, relay_tasks as t
from tasks.live_view import LiveView
from tasks.notify import Notifier
from tasks.step_lock import StepLock


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
    view = LiveView(backend, names, local, curve_every_s=6 * live_seconds,  # 3 min by default
                    notify=lambda key, text: tell("warning", key, text))
    lease = Lease(backend, run_spec.name, run_spec.kaggle.lease)
    driver = _Driver(run_spec, spec_text, backend, names, local, mode, tell, poll_seconds, give_up, live_seconds,
                     tick_follow_seconds, lock, get_run_logger(), view, lease)
    try:
        return driver.run()
    finally:  # claims of steps that took no effect: free for the next tick or run at once, not at expiry
        lease.release_open()


@dataclass
class _Driver:
    """The relay's loop: observe, decide, act; in tick mode one step. Observing, deciding and acting hold the
    step lock; waiting does not. Each act returns the summary the flow ends with, or None: look again."""
    run_spec: Any
    spec_text: str
    backend: Any
    names: chain.Names
    local: Path
    mode: str
    tell: Notifier
    poll_seconds: float
    give_up: float
    live_seconds: float
    tick_follow_seconds: float
    lock: StepLock
    logger: Any
    view: LiveView
    lease: Lease
    reported: Optional[str] = None  # the handed-over run the artifacts show

    def run(self) -> dict:
        while True:
            try:
                return self._run()
            except KaggleUnresponsive as err:  # a watch outlives an outage: every step is rebuilt from Kaggle
                if self.mode == "tick" or time.monotonic() > self.give_up:
                    raise
                self.lock.release()
                self.logger.warning("%s; looking again in %.0f s", err, self.poll_seconds)
                time.sleep(self.poll_seconds)

    def _run(self) -> dict:
        while True:
            self.lock.acquire()
            obs = t.observe(self.backend, self.names, self.local)
            action = chain.decide(self.run_spec.name, obs)
            self.logger.info("decide: %s %s (%s)", action.do.value, action.run_id or "", action.reason)
            self._report(obs, action)
            if action.do in (Do.HARVEST, Do.SALVAGE):
                outcome = self._hand_over(obs, action)
                if not isinstance(outcome, chain.Action):
                    if outcome is None:
                        continue
                    return outcome
                action = outcome  # the session failed: its new attempt (or the relay's failure) follows
            if action.do is Do.DONE:
                done = obs.published or {}
                self.tell("finished", "finished", f"{self.run_spec.name} finished at step {done.get('global_step')},"
                          f" last eval {done.get('metrics')}; the final model is the Kaggle dataset"
                          f" {self.names.model_dataset}")
                return _summary("done", obs.published, action)
            if action.do is Do.FAILED:
                raise RelayFailed(action.reason)
            summary = self._push(obs, action) if action.do is Do.PUSH else self._follow(obs, action)
            if summary is not None:
                return summary

    # -- acts ------------------------------------------------------------------------------------------------
    def _report(self, obs, action) -> None:
        """The session table, curves and plan as artifacts, once per handed-over session."""
        if obs.published and obs.published.get("run_id") != self.reported:
            metrics = handoff.published_metrics(self.backend, self.names, self.local, obs.published)
            plan = plan_text(self.run_spec, obs.published, t.read_quota(self.backend), datetime.now(timezone.utc))
            artifacts.publish_report(self.run_spec.name, obs.published, self.local, metrics, plan_text=plan,
                                     state=action.do.value)
            self.reported = obs.published.get("run_id")

    def _hand_over(self, obs, action):
        """Harvest or salvage a finished session: a summary, None (look again), or the failed session's next
        action (a new attempt, or the relay's failure)."""
        run_spec, key = self.run_spec, f"handover-{action.run_id}"
        held, stop = self._claim(key, obs, action)
        if held is None:
            return stop
        confirm = self.lease.guard(held)
        try:
            result = t.hand_over(self.backend, run_spec, self.names, action, obs, self.local, confirm=confirm)
        except LeaseLost as lost:
            return self._wait(f"hand-over of {action.run_id} stopped: {lost}", obs, action)
        if not result.ok and result.stale and \
                handoff.pushed_within(self.backend, self.names, action.run_id, run_spec.kaggle.status_lag):
            # the lag's signature, not a failed session: even a pinned status/output may answer the previous
            # version for a while after a push. Look again (bounded by kaggle.status_lag); no new attempt
            return self._wait(f"{result.reason} soon after its push: Kaggle's status lag; looking again", obs, action)
        if chain.hit_session_limit(obs.kernel_state, obs.failure_message) and \
                (result.ok or not budget_lowered(self.backend, self.names, run_spec)):
            # not transient: the same budget would hit the limit again; what it saved is handed over
            k = run_spec.kaggle
            advice = chain.session_limit_advice(action.session, session_budget(run_spec, None),
                                                k.session_timeout, k.startup_overhead)
            saved = (f"Its checkpoint at step {result.step} is handed over." if result.ok else
                     f"Nothing was handed over ({result.reason}).")
            raise RelayFailed(f"{advice}. {saved}\n--- log tail ---\n{result.log_tail}")
        if result.ok:
            self.lease.took_effect(key)
            return _summary("handed-over", result.progress, action) if self.mode == "tick" else None
        corrupt = chain.mounted_checkpoint_corrupt(result.log_tail) if action.do is Do.SALVAGE else None
        if corrupt:
            return self._restore(obs, action, corrupt, confirm)
        return self._after_failure(action, result)

    def _restore(self, obs, action, corrupt: str, confirm):
        """Not the session's fault: make the newest valid checkpoint version current again."""
        try:
            confirm()
            done = restore.restore_newest_valid(self.backend, self.names, f"{self.run_spec.name} checkpoint",
                                                action.run_id, corrupt, self.local)
        except restore.NoValidCheckpoint as err:
            raise RelayFailed(str(err)) from None
        except LeaseLost as lost:
            done = f"restore after {action.run_id} stopped: {lost}"
        else:
            self.lease.took_effect(f"handover-{action.run_id}")
        self.logger.warning("%s", done)
        return _summary("restored", obs.published, action) if self.mode == "tick" else None

    def _after_failure(self, action, result) -> chain.Action:
        """A failed session: tell, then a new attempt; a code error is pushed again only once the code or
        spec changed."""
        run_spec = self.run_spec
        code_error = chain.looks_like_code_error(result.log_tail) if action.do is Do.SALVAGE else None
        self.tell("session.failed", f"failed-{action.run_id}", f"{run_spec.name}: session {action.session}"
                  f" ({action.run_id}) failed: {code_error or result.reason}")
        if code_error and not handoff.code_changed(self.backend, self.names, run_spec, self.spec_text):
            raise RelayFailed(f"session {action.session} failed with a code error: {code_error} (the code and"
                              " spec are unchanged since that push: fix them, then run the relay again)\n"
                              f"--- log tail ---\n{result.log_tail}")
        action = chain.new_attempt(run_spec.name, action, f"the code changed since: {code_error}") if code_error \
            else chain.retry_action(run_spec.name, action, run_spec.kaggle.max_failed_sessions + 1, result.reason)
        if action.do is Do.FAILED:
            raise RelayFailed(f"{action.reason}\n--- log tail ---\n{result.log_tail}")
        return action

    def _push(self, obs, action) -> Optional[dict]:
        run_spec, published = self.run_spec, obs.published or {}
        last = (published.get("sessions") or [{}])[-1]
        if published.get("stop_reason") == "diverged" and \
                not handoff.code_changed(self.backend, self.names, run_spec, self.spec_text):
            raise RelayFailed(f"session {len(published['sessions'])} stopped itself: {last.get('diverged')}."
                              f" Its checkpoint at step {published['global_step']} is handed over. Change the"
                              " spec or code (learning rate, data) and run the relay again, or set"
                              " session.stop_on_divergence: false to train on")
        quota = t.read_quota(self.backend)
        budget = session_budget(run_spec, quota)
        self.logger.info("plan:\n%s", plan_text(run_spec, obs.published, quota, datetime.now(timezone.utc)))
        if budget <= run_spec.session.safety_margin:
            until = quota.refresh_time if quota is not None else None
            self.tell("quota-wait", f"quota-{until}", f"{run_spec.name}: the weekly GPU quota is spent; the relay"
                      f" waits until {until} UTC")
            return self._wait(f"weekly GPU quota spent; waiting until {until}", obs, action, until)
        session = handoff.session_kernel(run_spec, self.spec_text, self.names, action, budget,
                                         obs.features_published, has_checkpoint=obs.published is not None)
        held, stop = self._claim(f"push-{action.run_id}", obs, action)  # its act, SaveKernel, follows within seconds
        if held is None:
            return stop
        pushed = t.push_session(self.backend, session)
        if pushed.refusal is not None:
            until = quota.refresh_time if (pushed.refusal is Refusal.QUOTA and quota) else None
            return self._wait(f"push refused ({pushed.refusal.value}): {pushed.message}", obs, action, until)
        self.lease.took_effect(f"push-{action.run_id}")
        return _summary("pushed", obs.published, action) if self.mode == "tick" else None

    def _follow(self, obs, action) -> Optional[dict]:
        """Do.WAIT: the kernel is queued or running: follow its log and show the running session."""
        self.lock.release()
        live = self.view.follow(action.run_id)
        if self.mode == "tick":  # what the stream gives within a bounded time
            live.wait(self.tick_follow_seconds)
            self.view.refresh(obs.published, obs.kernel_state or "starting")
            return _summary("running", obs.published, action)
        if time.monotonic() > self.give_up:
            raise RelayFailed(f"gave up waiting for {action.run_id}: the flow's max_hours have passed")
        waited = time.monotonic() + 600  # look at Kaggle again at least every 10 min
        state = "starting"
        while time.monotonic() < waited and state in ("starting", "queued", "running"):
            state = t.wait_for_kernel(self.backend, self.names.kernel, obs.kernel_version,
                                      max_seconds=self.live_seconds, poll_seconds=self.poll_seconds)
            self.view.refresh(obs.published, state)
        return None

    # -- waiting ---------------------------------------------------------------------------------------------
    def _claim(self, key: str, obs, action):
        """(our claim on the step, None), or (None, the summary to end with or None to look again)."""
        try:
            return self.lease.acquire(key), None
        except LeaseBusy as busy:
            return None, self._wait(str(busy), obs, action, lease_end=busy.claim.expires)
        except NotALease as err:
            raise RelayFailed(str(err)) from None
        except Exception as err:  # noqa: BLE001 - Kaggle failing past the retries: look again later
            return None, self._wait(f"could not claim {key} on Kaggle: {err}", obs, action)

    def _wait(self, why: str, obs, action, until=None, lease_end: Optional[float] = None) -> Optional[dict]:
        """In tick mode, end with "waiting"; in watch mode, sleep (until the quota refresh, if known; at most
        until another orchestrator's claim ends) and look again."""
        self.lock.release()
        self.logger.warning(why)
        if self.mode == "tick":
            return _summary("waiting", obs.published, action)
        if time.monotonic() > self.give_up:
            raise RelayFailed(f"gave up: {why}")
        delay = self.poll_seconds
        if until is not None:
            delay = max(self.poll_seconds, (utc(until) - datetime.now(timezone.utc)).total_seconds())
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
