"""Kaggle-facing tasks. Each is safe to retry: push and publish are idempotent by run id / content."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from relay.orchestrator import handoff
from relay.orchestrator.chain import Action, Names, Observation
from relay.orchestrator.kaggle import control_record
from relay.orchestrator.kaggle.lease import LeaseLost
from relay.orchestrator.kaggle.selective_output import DiskSpaceError
from relay.orchestrator.kaggle.types import KaggleUnresponsive, PushResult, Quota, SessionKernel


def _retry_unless(*final: type):
    """A retry condition: retry a failed task unless its exception is one of `final`. KaggleUnresponsive is
    always final: the call retried for its whole give-up bound already, and retrying it here would stretch a
    tick's bound fourfold (the next tick, or the watch's next look, tries again)."""
    def condition(task, task_run, state) -> bool:
        try:
            state.result(raise_on_failure=True)
        except final + (KaggleUnresponsive,):
            return False
        except BaseException:  # noqa: BLE001
            return True
        return True

    return condition


RETRY = dict(retries=3, retry_delay_seconds=[2, 10, 30], retry_jitter_factor=0.5, cache_policy=NO_CACHE,
             retry_condition_fn=_retry_unless())


@task(name="observe", **RETRY)
def observe(backend, names: Names, local: Path, grace_s: Optional[float] = None) -> Observation:
    return handoff.observe(backend, names, local, grace_s)


@task(name="delete-kernel", **RETRY)
def delete_kernel(backend, kernel: str) -> bool:
    """Delete a wedged session's kernel: the only way Kaggle offers to stop it (False: it was gone already)."""
    return backend.delete_kernel(kernel)


@task(name="note-deleted", **RETRY)
def note_deleted(backend, names: Names, run_id: str, charges: list) -> None:
    """The wedged run whose kernel is about to be deleted and the charges its retry carries, recorded on Kaggle
    (control_record.note_deleted)."""
    control_record.note_deleted(backend, names.owner, names.name, run_id, charges)


@task(name="user-stop", **RETRY)
def user_stop(backend, names: Names) -> str:
    """Who stopped the relay (`relay stop`), read right before a push; "" while it is not stopped."""
    return control_record.stop_line(control_record.read(backend, names.owner, names.name))


@task(name="quota", **RETRY)
def read_quota(backend) -> Optional[Quota]:
    try:
        return backend.quota()
    except Exception as err:  # noqa: BLE001 - the planner falls back to the relay's own ledger
        get_run_logger().warning("quota unavailable (%s); planning from the session ledger", err)
        return None


@task(name="push-session", **RETRY)
def push_session(backend, session: SessionKernel) -> PushResult:
    result = backend.push_session(session)
    logger = get_run_logger()
    if result.refusal:
        logger.warning("push of %s refused (%s): %s", session.run_id, result.refusal.value, result.message)
    else:
        logger.info("pushed %s as version %s%s", session.run_id, result.version,
                    " (already there)" if result.already_pushed else "")
    return result


# a short disk is not transient within a tick: fail at once with its one-line message (the next tick retries,
# after someone freed space); LeaseLost: another orchestrator has the step now
@task(name="hand-over", **{**RETRY, "retry_condition_fn": _retry_unless(DiskSpaceError, LeaseLost)})
def hand_over(backend, spec, names: Names, action: Action, obs: Observation, local: Path,
              confirm=None) -> handoff.HandOver:
    result = handoff.hand_over(backend, spec, names, action, obs, local, wandb_key=lambda: wandb_api_key(spec),
                               **({"confirm": confirm} if confirm else {}))
    if result.ok:  # one that is not is said once by the flow, with what follows and the steps it lost
        get_run_logger().info("session %d handed over at step %d: %s", action.session, result.step,
                              ", ".join(result.published))
    return result


def wandb_api_key(spec) -> Optional[str]:
    """The W&B key for `wandb sync`: the spec's Prefect Secret block (tracking.wandb.api_key_block), else
    WANDB_API_KEY of this process. Read only when a sync runs; it goes into the sync's environment alone."""
    import os

    from prefect.blocks.system import Secret

    try:
        return Secret.load(spec.tracking.wandb.api_key_block).get()
    except Exception as err:  # noqa: BLE001 - no such block: wandb's own login (env, ~/.netrc) may still work
        get_run_logger().warning("W&B: Prefect Secret block %r not loaded (%s); using WANDB_API_KEY or wandb's"
                                 " own login", spec.tracking.wandb.api_key_block, type(err).__name__)
        return os.environ.get("WANDB_API_KEY")
