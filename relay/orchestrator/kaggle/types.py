"""Typed results of the Kaggle backend: what the orchestrator acts on (never an exception string)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Optional

from relay.shared.progress import Progress


class KaggleError(Exception):
    """A backend call that failed for good (after retries) or got an answer it cannot use."""


class RetriesExhausted(KaggleError):
    """Every retry of a transient failure (429, 5xx, connection error) failed."""


class KaggleUnresponsive(RetriesExhausted):
    """A call that kept failing (no answer, 429s, 5xx) for its whole give-up bound (RELAY_KAGGLE_GIVE_UP_S):
    retrying it at once would only stretch the bound; a watch looks again later, a tick ends."""


class KaggleHTTPError(KaggleError):
    """Kaggle answered a call with an error that retrying does not change (a 4xx other than 408/429); the
    message is one line naming the call, `response` is the HTTP response."""

    def __init__(self, message: str, response: object = None):
        super().__init__(message)
        self.response = response


class NotFound(KaggleError):
    """The kernel or dataset does not exist (HTTP 404; for a kernel, 403 too: see backend.ClientBackend._absent)."""


class CredentialsRefused(KaggleError):
    """Kaggle refuses the account's credentials (a call that names nothing of the account's was refused too)."""


class PublishError(KaggleError):
    """A dataset version could not be created, or came out incomplete."""


class KernelState(str, enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETE = "complete"
    ERROR = "error"
    CANCELLED = "cancelled"
    NEW_SCRIPT = "new_script"  # saved without a run (QUICK_SAVE)

    @property
    def finished(self) -> bool:
        return self in (KernelState.COMPLETE, KernelState.ERROR, KernelState.CANCELLED, KernelState.NEW_SCRIPT)


class Refusal(str, enum.Enum):
    CONCURRENCY = "concurrency"  # "Maximum batch GPU session count of 2 reached."
    QUOTA = "quota"              # weekly accelerator quota spent
    BUSY = "busy"                # the kernel's current version is still queued or running (not pushed)
    OTHER = "other"              # any other error Kaggle put in the SaveKernel response


@dataclass(frozen=True)
class SessionKernel:
    """Everything needed to push one relay session kernel."""

    kernel: str                      # "owner/slug"
    title: str
    spec_text: str                   # the run spec YAML, embedded in the kernel source
    run_id: str                      # chosen by the orchestrator; the idempotency and staleness marker
    budget_s: Optional[float] = None
    checkpoint_dataset: Optional[str] = None  # "owner/slug" mounted and passed as --resume-from
    data_dataset: Optional[str] = None        # mounted and passed as --data
    features_datasets: tuple = ()             # mounted and passed as --features
    extra_datasets: tuple = ()                # mounted, not passed
    competitions: tuple = ()                  # competition slugs, mounted at <input>/<slug>
    enable_gpu: bool = True
    enable_internet: bool = False
    machine_shape: Optional[str] = "NvidiaTeslaT4"
    pin_image: bool = True                    # every version on the Docker image of the kernel's first one
    session_timeout_s: Optional[int] = None
    workdir_name: str = "relay"               # the session workdir under the kernel's working folder
    code_folder: Optional[str] = None         # the user's code (spec code.folder), shipped beside the package
    code_exclude: tuple = ()
    pip: tuple = ()                           # requirements installed at kernel start (internet on)
    canary: Optional[tuple] = None            # `relay doctor`: check these mounts instead of training
    # failed attempts since the last hand-over, as the relay saw them (relay/orchestrator/goodput.py charge
    # records): carried in the plan until the next hand-over lists them in the published `charges`
    charges: tuple = ()


@dataclass(frozen=True)
class PushResult:
    pushed: bool                      # a kernel version for this run id exists (now or from before)
    version: Optional[int] = None
    already_pushed: bool = False      # found by the run id marker: nothing was pushed this time
    refusal: Optional[Refusal] = None
    message: str = ""
    code_version: str = ""


@dataclass(frozen=True)
class KernelStatus:
    state: KernelState
    failure_message: str = ""


@dataclass(frozen=True)
class SessionOutput:
    """What a kernel's output held, and whether it is the output of the push with `expected_run_id`."""

    directory: Path
    files: tuple
    expected_run_id: str
    found_run_id: Optional[str]
    progress: Optional[Progress]
    log_path: Optional[Path] = None

    @property
    def fresh(self) -> bool:
        return self.found_run_id == self.expected_run_id

    @property
    def stale(self) -> bool:
        return not self.fresh


@dataclass(frozen=True)
class Quota:
    used_s: float
    allowed_s: float
    reserved_s: float = 0.0
    refresh_time: Optional[datetime] = None

    @property
    def remaining_s(self) -> float:
        return max(0.0, self.allowed_s - self.used_s - self.reserved_s)


@dataclass(frozen=True)
class DatasetFile:
    name: str
    size: int
    created: Optional[str] = None


@dataclass(frozen=True)
class PublishResult:
    dataset: str
    version: int
    created: bool                     # the dataset did not exist before
    already_published: bool           # this exact content was found already published
    files: dict = field(default_factory=dict)  # relative path -> {"bytes", "sha256"}
