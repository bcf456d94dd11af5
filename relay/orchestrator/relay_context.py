"""What one relay's steps (relay_step.py) act with and come to: the context built once per flow run
(tasks/relay_host.py open_relay builds it in Prefect), what a step asks of the process it runs in (Host, View,
StepLock: Prefect's are in tasks/, for relay.orchestrator knows nothing of Prefect), and the Step, the one outcome
both flows act on.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Callable, Optional, Protocol

from relay.orchestrator import chain, handoff
from relay.orchestrator.kaggle.backend import KaggleBackend
from relay.orchestrator.kaggle.lease import Lease
from relay.orchestrator.kaggle.types import PushResult, Quota, Refusal, SessionKernel
from relay.orchestrator.live_progress import LiveSession
from relay.orchestrator.relay_state import State, Wait
from relay.shared.progress import Progress
from relay.shared.spec import RunSpec


class RelayFailed(RuntimeError):
    """The relay stopped and needs a person; the first line says why."""


class Host(Protocol):
    """What a step asks of the process it runs in (tasks/relay_host.py PrefectHost: a Prefect flow run's): the
    Kaggle calls (handoff's observe and hand-over, control_record's deleted run and stop line, the backend's push,
    delete and quota), each retried as the host retries them; its log; what a person reads (the report, a stop)."""

    def logger(self) -> logging.Logger | logging.LoggerAdapter: ...
    def observe(self, backend, names: chain.Names, local: Path, grace_s: Optional[float]) -> chain.Observation: ...
    def hand_over(self, backend, spec: RunSpec, names: chain.Names, action: chain.Action, obs: chain.Observation,
                  local: Path, confirm: Callable[[], None]) -> handoff.HandOver: ...
    def note_deleted(self, backend, names: chain.Names, run_id: str, charges: list) -> None: ...
    def delete_kernel(self, backend, kernel: str) -> bool: ...
    def user_stop(self, backend, names: chain.Names) -> str: ...
    def push_session(self, backend, session: SessionKernel) -> PushResult: ...
    def read_quota(self, backend) -> Optional[Quota]: ...
    def publish_report(self, name: str, progress: Progress, local: Path, metrics: Optional[Path], plan_text: str,
                       state: str, links: str, save_every_s: Optional[float]) -> None: ...
    def publish_stop(self, name: str, reason: str) -> None: ...


class View(Protocol):
    """The running session's live view (tasks/live_view.py LiveView: SessionView's figures as Prefect artifacts)."""

    def follow(self, run_id: str, deadline: Optional[float] = None) -> LiveSession: ...
    def refresh(self, progress: Optional[Progress], kernel_state: str, show_progress: bool = True) -> None: ...
    def show_end(self, run_id: str, progress: Optional[Progress], kernel_state: str) -> None: ...
    def show_progress(self, step: int, total: int, text: str) -> None: ...


class StepLock(Protocol):
    """One step at a time per relay (tasks/step_lock.py StepLock, tasks/run_step_locks.py a member of its run's)."""

    def acquire(self) -> None: ...
    def release(self) -> None: ...


@dataclass
class RelayContext:
    """Everything one relay's steps act with, built once per flow run from a spec that was loaded and checked once
    (tasks/relay_host.py open_relay)."""

    spec: RunSpec
    spec_text: str
    backend: KaggleBackend
    names: chain.Names
    local: Path            # a cache only: everything here can be rebuilt from Kaggle
    tell: Callable[..., bool]  # tell a person once per key (kind, key, text): tasks/notify.py Notifier
    lock: StepLock
    lease: Lease           # claims on Kaggle, seen by every orchestrator
    view: View
    host: Host             # the Kaggle calls, the log, the artifacts: tasks/relay_host.py
    links: str = ""                 # where the relay lives on Kaggle, as the summary artifacts link it
    reported: Optional[str] = None  # the handed-over run the artifacts show
    # failed attempts since the last hand-over that handed nothing over (goodput.failed_charge): the next push
    # carries them in its plan, and the hand-over after it lists them in the published `charges`
    unlisted: list = field(default_factory=list)

    def pause(self) -> None:
        """Between steps (waiting, following a session): another flow run of this relay may take a step."""
        self.lock.release()

    def close(self) -> None:
        """Claims whose step took no effect are free for the next tick or run at once, not at their expiry."""
        self.lock.release()
        self.lease.release_open()


@dataclass(frozen=True)
class Step:
    """What one step found or did, the one outcome both flows act on. Its state is one of the relay's states
    (relay/orchestrator/relay_state.py): READY (to push, given a slot and a budget), RUNNING, HANDED_OVER,
    RESTORED, PUSHED, WAITING (Kaggle's status lag, another orchestrator's claim, a refused push, a slot, the
    quota), DONE, STOPPED (by the user: `relay stop`; why says so)."""

    state: State
    action: chain.Action
    obs: chain.Observation
    progress: Optional[Progress] = None   # the newest handed-over progress.json
    why: str = ""                          # what it waits for
    until: Optional[datetime] = None       # the quota refresh it waits for
    lease_end: Optional[float] = None      # when the claim it waits for ends (unix time)
    refusal: Optional[Refusal] = None      # Kaggle refused the push
    deadline: Optional[float] = None       # running: when it is wedged if still running (look again then)
    waits_for: Optional[Wait] = None       # waiting: for what a flow acts on (a slot of the account's cap, the quota)
    stored: Optional[dict] = None          # done: what the relay stores on Kaggle (relay/orchestrator/storage.py)

    def __post_init__(self) -> None:  # a parsed document (tests, old callers) reads as the model
        object.__setattr__(self, "progress", Progress.read(self.progress))

    def summary(self) -> dict:
        p = self.progress or Progress()
        return {"state": self.state.value, "run_id": self.action.run_id, "step": p.global_step,
                "total_steps": p.total_steps, "sessions": len(p.sessions),
                "metrics": p.metrics if p.metrics is not None else {}, "weights_sha256": p.weights_sha256,
                "why": self.why,
                **({"stored": self.stored} if self.stored is not None else {})}
