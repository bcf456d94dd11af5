"""The sections of a run spec (optim, data, session, checkpoints, kaggle, notify, code): each key with its
type, default and the description the reference page prints. relay.shared.spec assembles them into RunSpec."""
from __future__ import annotations

import re
from typing import Any, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)

from relay.shared import accelerators

# What Kaggle allows (docs/kaggle.md: session limit, output cap): a spec asking for more is refused, not clipped.
KAGGLE_SESSION_LIMIT_S = 12 * 3600.0  # the longest a GPU session runs
KAGGLE_OUTPUT_LIMIT_GB = 20.0  # /kaggle/working kept as a session's output
WEEK_S = 7 * 24 * 3600.0  # the weekly GPU quota cannot exceed the week itself

_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?$")


def parse_duration(value: Any) -> Optional[float]:
    """Seconds from 90, 90.5, "90s", "45m", "11h30m"; None/"none" means no limit."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "none"):
        return None
    if isinstance(value, bool):
        raise ValueError("expected seconds or a duration like '11h30m'")
    if isinstance(value, (int, float)):
        return float(value)
    if not isinstance(value, str):  # a list or mapping: float() would raise TypeError, a traceback
        raise ValueError(f"expected seconds or a duration like '11h30m' (got {value!r})")
    try:
        return float(value)
    except ValueError:
        pass
    match = _DURATION.match(str(value).strip().lower())
    if not match or not any(match.groups()):
        raise ValueError(f"expected seconds or a duration like '11h30m' (got {value!r})")
    h, m, s = (float(g) if g else 0.0 for g in match.groups())
    return h * 3600 + m * 60 + s


def format_duration(seconds: float) -> str:
    """12h, 12h30m, 90s: the way durations are written in a spec."""
    if seconds < 60:
        return f"{seconds:g}s"
    h, rest = divmod(round(seconds), 3600)
    m, s = divmod(rest, 60)
    return "".join(f"{v}{unit}" for v, unit in ((h, "h"), (m, "m"), (s, "s")) if v)


class _Section(BaseModel):
    # strict: `micro_batch: true` or `lr: "0.1"` is a wrong type, not something to coerce
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class OptimConfig(_Section):
    micro_batch: PositiveInt = Field(8, description="Samples per forward/backward pass (per process).")
    grad_accum: PositiveInt = Field(1, description=(
        "Micro-batches accumulated per optimizer step; effective batch = micro_batch x grad_accum x "
        "processes."))
    precision: Literal["auto", "fp32", "fp16", "bf16"] = Field("auto", description=(
        "`auto`: bf16 where the GPU supports it, else fp16 with a GradScaler; fp32 on CPU."))
    tf32: bool = Field(True, description="TF32 matmuls and convolutions on Ampere and newer GPUs.")
    activation_checkpointing: bool = Field(False, description=(
        "Recompute activations in backward (the recipe decides which modules): less memory, more time."))
    clip_grad_norm: Optional[PositiveFloat] = Field(1.0, description="Gradient norm clipping; null turns it off.")
    lr: PositiveFloat = Field(3e-4, description="AdamW peak learning rate.")
    weight_decay: NonNegativeFloat = Field(0.01, description="AdamW weight decay (none on biases and norms).")
    schedule: Literal["constant", "linear", "cosine"] = Field("linear", description=(
        "Learning-rate schedule after warm-up: a pure function of the optimizer step."))
    warmup_steps: NonNegativeInt = Field(0, description="Linear warm-up steps.")
    epochs: Optional[PositiveInt] = Field(None, description=(
        "Length of the whole run (all sessions) in epochs; set exactly one of epochs and max_steps."))
    max_steps: Optional[PositiveInt] = Field(None, description=(
        "Length of the whole run (all sessions) in optimizer steps."))
    eval_batch: PositiveInt = Field(16, description="Evaluation batch (larger than training: no gradients are kept).")
    eval_every_steps: Optional[PositiveInt] = Field(None, description=(
        "Evaluation cadence in optimizer steps; null: at the end of every epoch."))
    log_every_steps: PositiveInt = Field(50, description=(
        "A training line in metrics.jsonl every N optimizer steps; 50, as in Lightning: at 10, a 2-ms step wrote 50"
        " lines a second, and reading each window cost a launch-bound GPU loop ~2 % (bench/bench_step_overhead.py)."))
    nonfinite_patience: PositiveInt = Field(3, description=(
        "Skipped non-finite steps in a row before falling back to fp32 (in fp32: stop with an error); counted"
        " when the losses are read, at the next log step (optim.log_every_steps)."))

    @model_validator(mode="after")
    def _one_length(self) -> "OptimConfig":
        if (self.epochs is None) == (self.max_steps is None):
            raise ValueError("optim: set exactly one of epochs or max_steps")
        return self


class DataConfig(_Section):
    num_workers: NonNegativeInt = Field(2, description="DataLoader worker processes.")
    pin_memory: Literal["auto", True, False] = Field("auto", description=(
        "Pinned host memory; `auto`: on when training on CUDA."))
    prefetch_factor: PositiveInt = Field(2, description="Batches each DataLoader worker loads ahead.")
    persistent_workers: bool = Field(True, description="Keep DataLoader workers between epochs.")
    non_blocking: bool = Field(True, description="Asynchronous host-to-GPU copies.")


class SessionConfig(_Section):
    budget: Optional[float] = Field(None, description=(
        "Wall time of training per session (seconds or `11h30m`); none runs to the end. `relay train "
        "--budget` overrides."))
    max_steps: Optional[PositiveInt] = Field(None, description=(
        "Optimizer steps per session (stop reason `steps`): a bound no machine speed changes. `relay train "
        "--max-steps N|none` overrides."))
    save_every: float = Field(1800.0, description="Periodic save, insurance against a SIGKILL (duration).")
    step_seconds: Optional[float] = Field(None, description=(
        "Your estimate of one optimizer step on the pushed accelerator (a duration: `0.4s`), until a session has"
        " measured one: the first push asks Kaggle for the steps it needs at this pace (with the slack a"
        " measured one gets), and `relay plan` and `relay status` plan from it; none: the first session of"
        " a relay bounded by steps asks for 2 h. `relay plan --step-seconds` overrides it."))
    safety_margin: float = Field(60.0, description=(
        "Reserved before the deadline on top of the measured save time (duration)."))
    empty_cache_every_steps: Optional[PositiveInt] = Field(50, description=(
        "Periodic CUDA cache clean-up; null: never."))
    memory_log_every_steps: PositiveInt = Field(50, description="A memory sample in metrics.jsonl every N steps.")
    threads: Optional[PositiveInt] = Field(None, description=(
        "torch CPU threads (default: torch's); exact resume needs the same count in every session."))
    stop_on_divergence: bool = Field(True, description=(
        "Stop the session (saving) when its 20-step average loss has given back half of what training gained"
        " (or rose 3 noise deviations) for 20 steps in a row, or the loss is not finite 3 steps in a row; the"
        " relay then stops and says why instead of spending quota on a diverged run. Part of the exact resume"
        " state. One process only."))
    emulate: Optional[Literal["t4"]] = Field(None, description=(
        "Run each session as if on this GPU, on a bigger one (a lent H100 standing in for Kaggle's T4): CUDA"
        " memory capped at the T4's 15102 MiB (torch.cuda.set_per_process_memory_fraction), so the pre-flight"
        " and the OOM ladder meet Kaggle's memory, and `optim.precision: auto` resolves to fp16 + GradScaler"
        " (a T4 has no native bf16). Speed is not emulated. The environment variable RELAY_EMULATE_GPU=t4 (or"
        " none) overrides it. Nothing off CUDA."))
    devices: Union[Literal["auto"], PositiveInt] = Field("auto", description=(
        "Processes training together: `auto` is every visible GPU (both T4s of a T4 x2), 1 on CPU; or a "
        "number."))
    stall_after: Union[Literal["auto"], float, None] = Field("auto", description=(
        "A session whose training makes no progress (no step, eval batch or save) for this long is stuck (a"
        " hung data loader, a collective that never returns, a deadlock): it records `stalled at step N`,"
        " leaves its last checkpoint as it is and exits with status 75, and the relay retries it like a"
        " failed session. `auto`: max(10m, 20 x the slowest step seen, 3 x the save time); a duration (before the"
        " session's first step, 10m at least: it compiles, starts workers); none"
        " turns the watchdog off (Kaggle's session timeout is then the only bound)."))

    @field_validator("budget", "save_every", "step_seconds", "safety_margin", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> Optional[float]:
        return parse_duration(value)

    @field_validator("stall_after", mode="before")
    @classmethod
    def _stall_after(cls, value: Any) -> Any:
        if value == "auto":
            return value
        seconds = parse_duration(value)
        if seconds is not None and seconds <= 0:
            raise ValueError(f"must be `auto`, a duration > 0 or none (got {value!r})")
        return seconds

    @model_validator(mode="after")
    def _check(self) -> "SessionConfig":
        if self.save_every is None or self.save_every <= 0:
            raise ValueError("session.save_every: must be a positive duration")
        if self.step_seconds is not None and self.step_seconds <= 0:
            raise ValueError("session.step_seconds: must be a duration > 0 or none")
        if self.safety_margin is None or self.safety_margin < 0:
            raise ValueError("session.safety_margin: must be a duration >= 0")
        if self.budget is not None and self.budget <= self.safety_margin:
            raise ValueError(
                f"session.budget: must be longer than session.safety_margin ({self.safety_margin:g}s),"
                f" the time reserved to save (got {self.budget:g}s)"
            )
        return self


class CheckpointConfig(_Section):
    keep_last: PositiveInt = Field(2, description="Checkpoints kept (retention runs only after a successful save).")
    keep_best: bool = Field(True, description=(
        "Also keep the checkpoint with the best recipe metric (one-model recipes)."))
    disk_budget_gb: PositiveFloat = Field(20.0, description=(
        "Disk the checkpoints may use, at most Kaggle's 20 GB of kept output; older ones are pruned first."))
    digest: Literal["crc32", "sha256"] = Field("crc32", description=(
        "Checksum of every file in the manifest; sha256 costs about 2x a save without SHA-NI."))

    @field_validator("disk_budget_gb")
    @classmethod
    def _kaggle_output(cls, value: float) -> float:
        if value > KAGGLE_OUTPUT_LIMIT_GB:
            raise ValueError(f"must be at most {KAGGLE_OUTPUT_LIMIT_GB:g}, the GB of output Kaggle keeps"
                             f" (got {value:g})")
        return value


DEFAULT_GPU_SHAPE = "NvidiaTeslaT4"  # "GPU T4 x2"


class KaggleConfig(_Section):
    """What each session kernel mounts and runs on (used by the orchestrator only)."""

    dataset_sources: list[str] = Field(default_factory=list, description=(
        "`owner/slug` of the datasets every session mounts (the raw data)."))
    competition_sources: list[str] = Field(default_factory=list, description=(
        "Competition slugs every session mounts; point params.data_dir at one."))
    data_mount: Optional[str] = Field(None, description=(
        "Which mounted source is the recipe's data_dir (default: the first dataset source)."))
    machine_shape: Optional[str] = Field(None, description=(
        "Kaggle accelerator shape; `NvidiaTeslaT4` (GPU T4 x2) when enable_gpu and unset (without a shape "
        "Kaggle gives a P100, which fails on its current image)."))
    enable_gpu: bool = Field(True, description="Run sessions on a GPU (spends the weekly quota).")
    enable_internet: bool = Field(False, description=(
        "Internet inside the session (needs a phone-verified account); required by kaggle.pip."))
    pin_image: bool = Field(True, description=(
        "Push every session on the Docker image of the relay's first session (the kernel's first version:"
        " `docker_image_pinning_type: original`), not on the latest one Kaggle rolls out every few weeks; each"
        " session records the image it ran on and a change is flagged (docs/kaggle.md)."))
    session_timeout: float = Field(12 * 3600.0, description="Kaggle's per-session cap (duration, at most 12h).")
    startup_overhead: float = Field(120.0, description=(
        "Kernel start and restore, kept out of the training budget (duration)."))
    weekly_gpu_quota: float = Field(30 * 3600.0, description=(
        "The account's weekly GPU quota (duration), used by the plan."))
    max_failed_sessions: NonNegativeInt = Field(2, description=(
        "Retries of a session that failed transiently (a crash, a stall), from the same checkpoint."))
    on_other_accelerator: Literal["continue", "stop"] = Field("continue", description=(
        "A session that gets other GPUs than machine_shape asks for (a P100 for a T4 x2, one T4 of two) says"
        " so in its first seconds, then `continue`s at the speed it measures, or `stop`s at once (stop reason"
        " `wrong_accelerator`, before any training) to save quota; the relay then retries it like a failed"
        " session."))
    on_wedged: Literal["delete", "wait"] = Field("delete", description=(
        "A session Kaggle still reports running after its deadline (its push, plus the timeout the push asked"
        " for, plus startup_overhead) is wedged, spending quota: the relay tells you, then `delete`s its kernel"
        " (Kaggle's only way to stop a session) after harvesting what it can and goes on from the last published"
        " checkpoint (a failed attempt, retried within max_failed_sessions), or `wait`s for Kaggle to end it."))
    pip: list[str] = Field(default_factory=list, description=(
        "Requirements installed at kernel start (needs enable_internet)."))
    lease: float = Field(1200.0, gt=0, description=(
        "How long one orchestrator's claim on a step (a push, a hand-over) lasts on Kaggle; another takes the "
        "step over only after it, so a killed orchestrator delays the relay by at most this (duration; a "
        "hand-over longer than half of it pauses to renew its claim)."))
    credentials_block: Optional[str] = Field(None, pattern=r"^[a-z0-9][a-z0-9-]*$", description=(
        "The Prefect Secret block holding this relay's Kaggle account as {\"username\", \"key\"} JSON; a run's"
        " own credentials_block (`relay run --credentials-block`, a deployment's parameter) wins. Unset: the"
        " worker's environment (KAGGLE_USERNAME/KAGGLE_KEY, kaggle.json). The key never appears in the spec."))
    account_sessions: int = Field(2, ge=1, description=(
        "GPU sessions the account may run at once (Kaggle: 2). On a Prefect server the `relay` flow takes a"
        " slot of the global concurrency limit `kaggle-account-<username>` (created with this many slots) for"
        " each session, from before its push until its hand-over, so relays of one account wait their turn"
        " instead of pushing into Kaggle's refusal."))
    checkpoint_versions: int = Field(4, ge=1, description=(
        "Versions of the checkpoint dataset kept on Kaggle, whose private storage quota counts every version"
        " (past it a create reports success and the dataset 404s: kaggle-cli #284). Kaggle has no per-version"
        " delete: the publish that would keep one more asks Kaggle to delete the older versions"
        " (delete_old_versions), so the relay keeps at most this many checkpoints' bytes."))
    status_lag: float = Field(300.0, ge=0, description=(
        "For this long after a push, output of another run is read as Kaggle's status lag (look again), not as "
        "a failed session (duration)."))

    @field_validator("session_timeout", "startup_overhead", "weekly_gpu_quota", "lease", "status_lag",
                     mode="before")
    @classmethod
    def _duration(cls, value: Any) -> Optional[float]:
        return parse_duration(value)

    @model_validator(mode="before")
    @classmethod
    def _gpu_shape(cls, data: Any) -> Any:
        # enable_gpu without a shape gets a P100, which fails on Kaggle's current CUDA 12.8 image (#821,
        # PR #1156): always ask for a shape, and one Kaggle runs as asked (relay/shared/accelerators.py)
        if not isinstance(data, dict) or not data.get("enable_gpu", True):
            return data
        shape = data.get("machine_shape")
        if shape is None:
            return dict(data, machine_shape=DEFAULT_GPU_SHAPE)
        problem = accelerators.shape_problem(shape) if isinstance(shape, str) else f"expected a string (got {shape!r})"
        if problem:
            raise ValueError(f"kaggle.machine_shape: {problem}")
        return data

    @field_validator("dataset_sources")
    @classmethod
    def _slugs(cls, value: list[str]) -> list[str]:
        for slug in value:
            if slug.count("/") != 1 or not all(slug.split("/")):
                raise ValueError(f"expected 'owner/slug' (got {slug!r})")
        return value

    @model_validator(mode="after")
    def _within_kaggle_limits(self) -> "KaggleConfig":
        timeout, quota, startup = self.session_timeout, self.weekly_gpu_quota, self.startup_overhead
        if not 0 < timeout <= KAGGLE_SESSION_LIMIT_S:
            raise ValueError("kaggle.session_timeout: must be a duration > 0 and at most 12h, the longest"
                             f" Kaggle session (got {format_duration(timeout)})")
        if not 0 < quota <= WEEK_S:
            raise ValueError("kaggle.weekly_gpu_quota: must be a duration > 0 and at most 168h, one week"
                             f" (got {format_duration(quota)})")
        if timeout > quota:
            raise ValueError(f"kaggle.session_timeout: must be at most kaggle.weekly_gpu_quota"
                             f" ({format_duration(quota)}) (got {format_duration(timeout)})")
        if not 0 <= startup < timeout:
            raise ValueError(f"kaggle.startup_overhead: must be a duration >= 0 and shorter than"
                             f" kaggle.session_timeout ({format_duration(timeout)}) (got {format_duration(startup)})")
        return self


class NotifyConfig(_Section):
    """Who is told when the relay needs them (docs/prefect.md, "Notifications")."""

    block: Optional[str] = Field(None, pattern=r"^[a-z0-9-]+/[A-Za-z0-9_-]+$", description=(
        "A Prefect notification block as `<block-type>/<name>` (`slack-webhook/team`, `custom-webhook/hook`,"
        " `ms-teams-webhook/...`, `discord-webhook/...`, `sendgrid-email/...`), told once each when a session"
        " fails, the relay stops or finishes, a quota wait begins or an early warning fires."))


class CodeConfig(_Section):
    """The user's own code (relay/kernel/usercode.py): a folder shipped with every session kernel, and what to run."""

    folder: str = Field(".", description="Your code's folder, relative to the spec file; shipped with every session.")
    entry: Optional[str] = Field(None, description=(
        "What a session runs: `train.py --lr 3e-4`, a notebook `train.ipynb` (its code cells in order) or"
        " `pkg.module:function`; none with a user recipe."))
    exclude: list[str] = Field(default_factory=list, description="Glob patterns left out of the shipped folder.")
