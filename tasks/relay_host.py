"""A relay in a Prefect flow run: the context its steps (relay/orchestrator/relay_step.py, the relay's algorithm)
act with, built once per flow run, and the host they run in: each Kaggle call a Prefect task with retries
(tasks/relay_tasks.py), the log the flow run's (or the task run's it is called in), the report and a stop as
artifacts, a person told through Prefect's events and blocks, the step lock, the live view's artifacts."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from prefect import get_run_logger

from relay.orchestrator import chain
from relay.orchestrator.kaggle.backend import KaggleBackend
from relay.orchestrator.kaggle.lease import Lease
from relay.orchestrator.policy import view_forecasts
from relay.orchestrator.relay_context import RelayContext
from relay.orchestrator.session_view import SessionView
from relay.shared.code_folder import mark_outputs
from relay.shared.spec import RunSpec
from tasks import artifacts, quiet_logs, relay_tasks
from tasks.live_view import LiveView, TickMarks
from tasks.notify import Notifier
from tasks.step_lock import StepLock


def make_backend(credentials_block: Optional[str] = None) -> KaggleBackend:
    """The real Kaggle, or the emulator when RELAY_KAGGLE_ENDPOINT is set; credentials from the environment /
    kaggle.json, or from a Prefect Secret block holding {"username", "key"} JSON."""
    from relay.orchestrator.kaggle import from_env

    creds = None
    if credentials_block:
        from prefect.blocks.system import Secret

        value = Secret.load(credentials_block).get()
        creds = json.loads(value) if isinstance(value, str) else value
    return from_env(credentials=creds)


class PrefectHost:
    """relay_step.Host in a Prefect flow run: the tasks of tasks/relay_tasks.py and the artifacts of
    tasks/artifacts.py, looked up when called (a test may replace one)."""

    def logger(self):
        return get_run_logger()

    def observe(self, *args, **kwargs):
        return relay_tasks.observe(*args, **kwargs)

    def hand_over(self, *args, **kwargs):
        return relay_tasks.hand_over(*args, **kwargs)

    def note_deleted(self, *args, **kwargs):
        return relay_tasks.note_deleted(*args, **kwargs)

    def delete_kernel(self, *args, **kwargs):
        return relay_tasks.delete_kernel(*args, **kwargs)

    def user_stop(self, *args, **kwargs):
        return relay_tasks.user_stop(*args, **kwargs)

    def push_session(self, *args, **kwargs):
        return relay_tasks.push_session(*args, **kwargs)

    def read_quota(self, *args, **kwargs):
        return relay_tasks.read_quota(*args, **kwargs)

    def publish_report(self, *args, **kwargs):
        artifacts.publish_report(*args, **kwargs)

    def publish_stop(self, *args, **kwargs):
        artifacts.publish_stop(*args, **kwargs)


def open_relay(spec: RunSpec, spec_text: str, backend: KaggleBackend, state_dir: str | Path,
               step_lock_wait_s: float = 0.0, tick: bool = False, lock=None) -> RelayContext:
    """The context of one relay's steps in this flow run. `lock`: the relay's step lock when its flow run holds its
    relays' locks together (the `relays` flow: tasks/run_step_locks.py); else a StepLock of its own, waiting at
    most `step_lock_wait_s`."""
    quiet_logs.install()  # no "Finished in state Completed()" line per task run in the relay's flows
    local = Path(state_dir) / spec.name
    local.mkdir(parents=True, exist_ok=True)
    mark_outputs(Path(state_dir))  # never shipped as code when it lies in a code folder
    # the orchestrator's parts: the relay's names on Kaggle, its forecasts, its running session's view, its claims
    names = chain.Names(backend.username, spec.name)
    plan, finish = view_forecasts(spec, backend)
    links = names.links(getattr(backend, "endpoint", None))
    session = SessionView(backend, names, local, session_max_steps=spec.session.max_steps, plan=plan,
                          finish=finish, links=links)
    lease = Lease(backend, spec.name, spec.kaggle.lease)
    # Prefect's: a person told, the live view's artifacts (and a tick's marks), the step lock
    tell = Notifier(spec.name, spec.notify.block)
    view = LiveView(session, notify=lambda key, text: tell("warning", key, text),
                    marks=TickMarks(spec.name) if tick else None)
    lock = lock or StepLock(spec.name, step_lock_wait_s)
    return RelayContext(spec, spec_text, backend, names, local, tell, lock, lease, view, PrefectHost(), links)
