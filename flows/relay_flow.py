"""The relay flow: train a run spec to the end across as many Kaggle sessions as it takes.

Each iteration observes Kaggle, decides one step (relay.chain.decide) and does it. `mode="watch"` loops
until the work is done (a laptop, a self-hosted worker); `mode="tick"` does at most one step and returns
(a 15-minute schedule in Prefect or GitHub Actions: nothing waits 12 h). Both rebuild everything from
Kaggle, so killing the flow anywhere and starting it again continues the relay.
"""
from __future__ import annotations

import json
import math
import os
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal, Optional

from prefect import flow, get_run_logger

from relay import chain, handoff, plan as planner, restore, spec as spec_mod
from relay.chain import Do
from relay.kaggle.types import Refusal
from tasks import artifacts, relay_tasks as t


class RelayFailed(RuntimeError):
    pass


def make_backend(credentials_block: Optional[str] = None):
    """The real Kaggle, or the emulator when RELAY_KAGGLE_ENDPOINT is set; credentials from the
    environment / kaggle.json, or from a Prefect Secret block holding {"username", "key"} JSON."""
    from relay.kaggle import ClientBackend

    creds = None
    if credentials_block:
        from prefect.blocks.system import Secret

        value = Secret.load(credentials_block).get()
        creds = json.loads(value) if isinstance(value, str) else value
    return ClientBackend(creds, os.environ.get("RELAY_KAGGLE_ENDPOINT"))


def session_budget(spec, quota) -> float:
    """Seconds of training to ask of the next session: the spec's budget, within Kaggle's session cap
    (less start-up), and within what is left of the weekly GPU quota."""
    k = spec.kaggle
    budget = min(spec.session.budget or math.inf, k.session_timeout - k.startup_overhead)
    if quota is not None and quota.allowed_s > 0:
        budget = min(budget, quota.remaining_s - k.startup_overhead)
    return budget


def plan_text(spec, progress: Optional[dict], quota, now: datetime) -> str:
    try:
        q = (planner.quota_from_api({"gpuQuota": {"timeUsed": quota.used_s, "totalTimeAllowed": quota.allowed_s,
                                                  "timeReserved": quota.reserved_s},
                                     "quotaRefreshTime": _utc(quota.refresh_time)}, now)
             if quota is not None and quota.refresh_time else
             planner.quota_from_ledger([(s["started"], s.get("seconds", 0)) for s in (progress or {}).get("sessions", [])],
                                       now, total_allowed_s=spec.kaggle.weekly_gpu_quota))
        limits = planner.SessionLimits(session_cap_s=spec.kaggle.session_timeout,
                                       startup_s=spec.kaggle.startup_overhead,
                                       save_s=spec.session.safety_margin + 1, handoff_s=0, min_train_s=0)
        p = planner.plan_from_progress(progress or {}, q, now, limits=limits, step_seconds_estimate=None,
                                       total_steps=(progress or {}).get("total_steps"),
                                       steps_per_epoch=(progress or {}).get("steps_per_epoch"))
        return planner.format_plan(p) + _limit_warning(spec, progress)
    except (planner.PlanError, KeyError, TypeError, ValueError) as err:
        return f"(no plan yet: {err})" + _limit_warning(spec, progress)


def _budget_lowered(backend, names: chain.Names, spec) -> bool:
    """After a session stopped at the limit left nothing to hand over: retry it only once the spec asks for
    a shorter session than the stopped attempt was pushed with (the budget is in the kernel's source)."""
    pushed = (backend.current_plan(names.kernel) or {}).get("budget")
    return pushed is not None and session_budget(spec, None) < float(pushed) - 1


def _limit_warning(spec, progress: Optional[dict]) -> str:
    """The plan says so when the last handed-over session was stopped at Kaggle's session limit."""
    if (progress or {}).get("stop_reason") != handoff.SESSION_LIMIT:
        return ""
    k = spec.kaggle
    session = len(progress.get("sessions", [])) or 1
    return "\nwarning: " + chain.session_limit_advice(session, session_budget(spec, None), k.session_timeout,
                                                      k.startup_overhead)


@flow(name="relay", log_prints=True)
def relay(spec: str = "examples/price-demo.yaml", mode: Literal["watch", "tick"] = "watch",
          credentials_block: Optional[str] = None, poll_seconds: float = 30.0,
          max_hours: float = 24 * 14, state_dir: str = "runs") -> dict:
    """Advance (tick) or run to the end (watch) the relay of `spec`. Returns {"state", "step", ...}."""
    logger = get_run_logger()
    run_spec = spec_mod.load(spec)
    spec_text = Path(spec).read_text()
    backend = make_backend(credentials_block)
    names = chain.Names(backend.username, run_spec.name)
    local = Path(state_dir) / run_spec.name  # a cache only: everything here can be rebuilt from Kaggle
    local.mkdir(parents=True, exist_ok=True)
    give_up = time.monotonic() + max_hours * 3600
    reported = None  # the handed-over run the artifacts show

    while True:
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
            result = t.hand_over(backend, run_spec, names, action, obs, local)
            if chain.hit_session_limit(obs.kernel_state, obs.failure_message) and \
                    (result.ok or not _budget_lowered(backend, names, run_spec)):
                # not transient: the same budget would hit the limit again; what it saved is handed over
                k = run_spec.kaggle
                advice = chain.session_limit_advice(action.session, session_budget(run_spec, None),
                                                    k.session_timeout, k.startup_overhead)
                saved = (f"Its checkpoint at step {result.step} is handed over." if result.ok else
                         f"Nothing was handed over ({result.reason}).")
                raise RelayFailed(f"{advice}. {saved}\n--- log tail ---\n{result.log_tail}")
            if result.ok:
                if mode == "tick":
                    return _summary("handed-over", result.progress, action)
                continue
            corrupt = chain.mounted_checkpoint_corrupt(result.log_tail) if action.do is Do.SALVAGE else None
            if corrupt:  # not the session's fault: make the newest valid checkpoint version current again
                try:
                    done = restore.restore_newest_valid(backend, names, f"{run_spec.name} checkpoint",
                                                        action.run_id, corrupt, local)
                except restore.NoValidCheckpoint as err:
                    raise RelayFailed(str(err)) from None
                logger.warning("%s", done)
                if mode == "tick":
                    return _summary("restored", obs.published, action)
                continue
            code_error = chain.looks_like_code_error(result.log_tail) if action.do is Do.SALVAGE else None
            if code_error:
                raise RelayFailed(f"session {action.session} failed with a code error: {code_error}\n"
                                  f"--- log tail ---\n{result.log_tail}")
            action = chain.retry_action(run_spec.name, action, run_spec.kaggle.max_failed_sessions + 1,
                                        result.reason)
            if action.do is Do.FAILED:
                raise RelayFailed(f"{action.reason}\n--- log tail ---\n{result.log_tail}")

        if action.do is Do.DONE:
            return _summary("done", obs.published, action)
        if action.do is Do.FAILED:
            raise RelayFailed(action.reason)

        if action.do is Do.PUSH:
            quota = t.read_quota(backend)
            budget = session_budget(run_spec, quota)
            logger.info("plan:\n%s", plan_text(run_spec, obs.published, quota, datetime.now(timezone.utc)))
            if budget <= run_spec.session.safety_margin:
                until = quota.refresh_time if quota is not None else None
                state = _wait_or_return(mode, f"weekly GPU quota spent; waiting until {until}", until,
                                        poll_seconds, give_up, logger)
                if state:
                    return _summary(state, obs.published, action)
                continue
            session = handoff.session_kernel(run_spec, spec_text, names, action, budget,
                                             obs.features_published, has_checkpoint=obs.published is not None)
            pushed = t.push_session(backend, session)
            if pushed.refusal is not None:
                until = quota.refresh_time if (pushed.refusal is Refusal.QUOTA and quota) else None
                state = _wait_or_return(mode, f"push refused ({pushed.refusal.value}): {pushed.message}", until,
                                        poll_seconds, give_up, logger)
                if state:
                    return _summary(state, obs.published, action)
                continue
            if mode == "tick":
                return _summary("pushed", obs.published, action)
            continue

        # Do.WAIT: the kernel is queued or running.
        if mode == "tick":
            return _summary("running", obs.published, action)
        if time.monotonic() > give_up:
            raise RelayFailed(f"gave up after {max_hours} h waiting for {action.run_id}")
        t.wait_for_kernel(backend, names.kernel, obs.kernel_version, max_seconds=600, poll_seconds=poll_seconds)


def _utc(value: datetime) -> datetime:
    # the kaggle client parses quotaRefreshTime without a zone; Kaggle's times are UTC
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)


def _wait_or_return(mode: str, why: str, until, poll_seconds: float, give_up: float, logger) -> Optional[str]:
    """In tick mode, report "waiting" and return; in watch mode, sleep (until the quota refresh, if known)."""
    logger.warning(why)
    if mode == "tick":
        return "waiting"
    if time.monotonic() > give_up:
        raise RelayFailed(f"gave up: {why}")
    delay = poll_seconds
    if until is not None:
        delay = max(poll_seconds, (_utc(until) - datetime.now(timezone.utc)).total_seconds())
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
