"""The run spec: one validated model, loaded from YAML, shared by the orchestrator and the session runtime.

Every bad input becomes one line naming the key path and what is expected (`SpecError`), e.g.
`spec.yaml: optim.lr: must be greater than 0 (got -0.1)`. Durations accept seconds or "11h30m", "45m", "90s".
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from relay.shared import params as params_mod
from relay.shared.code_folder import MAX_CODE_BYTES, code_files, resolve_folder
from relay.shared.errors import InputError
from relay.shared.inputs import DuplicateKey, decode_utf8, load_yaml
from relay.shared.tracking_spec import TrackingConfig


class SpecError(InputError):
    """A spec problem, already phrased as one line for the user."""


# What Kaggle allows (kaggle-api.md, "More platform facts"): a spec asking for more is refused, not clipped.
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
    log_every_steps: PositiveInt = Field(10, description="A training line in metrics.jsonl every N optimizer steps.")
    nonfinite_patience: PositiveInt = Field(3, description=(
        "Skipped non-finite steps in a row before falling back to fp32 (in fp32: stop with an error)."))

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
    safety_margin: float = Field(60.0, description=(
        "Reserved before the deadline on top of the measured save time (duration)."))
    empty_cache_every_steps: Optional[PositiveInt] = Field(50, description=(
        "Periodic CUDA cache clean-up; null: never."))
    memory_log_every_steps: PositiveInt = Field(50, description="A memory sample in metrics.jsonl every N steps.")
    threads: Optional[PositiveInt] = Field(None, description=(
        "torch CPU threads (default: torch's); exact resume needs the same count in every session."))
    stop_on_divergence: bool = Field(True, description=(
        "Stop the session (saving) when its loss is not finite or over 10x its recent median for 3 steps in a row;"
        " the relay then stops and says why instead of spending quota on a diverged run. One process only."))
    devices: Union[Literal["auto"], PositiveInt] = Field("auto", description=(
        "Processes training together: `auto` is every visible GPU (both T4s of a T4 x2), 1 on CPU; or a "
        "number."))

    @field_validator("budget", "save_every", "safety_margin", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> Optional[float]:
        return parse_duration(value)

    @model_validator(mode="after")
    def _check(self) -> "SessionConfig":
        if self.save_every is None or self.save_every <= 0:
            raise ValueError("session.save_every: must be a positive duration")
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
    session_timeout: float = Field(12 * 3600.0, description="Kaggle's per-session cap (duration, at most 12h).")
    startup_overhead: float = Field(120.0, description=(
        "Kernel start and restore, kept out of the training budget (duration)."))
    weekly_gpu_quota: float = Field(30 * 3600.0, description=(
        "The account's weekly GPU quota (duration), used by the plan."))
    max_failed_sessions: NonNegativeInt = Field(2, description=(
        "Retries of a session that failed transiently, from the same checkpoint."))
    pip: list[str] = Field(default_factory=list, description=(
        "Requirements installed at kernel start (needs enable_internet)."))
    lease: float = Field(1200.0, gt=0, description=(
        "How long one orchestrator's claim on a step (a push, a hand-over) lasts on Kaggle; another takes the "
        "step over only after it, so a killed orchestrator delays the relay by at most this (duration; a "
        "hand-over longer than half of it pauses to renew its claim)."))
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
        # PR #1156): always ask for a shape; warn on an explicit P100
        if not isinstance(data, dict) or not data.get("enable_gpu", True):
            return data
        shape = data.get("machine_shape")
        if shape is None:
            return dict(data, machine_shape=DEFAULT_GPU_SHAPE)
        if isinstance(shape, str) and "p100" in shape.lower():
            logging.getLogger(__name__).warning(
                "kaggle.machine_shape %s: P100s fail on Kaggle's current CUDA 12.8 image; use %s",
                shape, DEFAULT_GPU_SHAPE)
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
        "What a session runs: `train.py --lr 3e-4` or `pkg.module:function`; none with a user recipe."))
    exclude: list[str] = Field(default_factory=list, description="Glob patterns left out of the shipped folder.")


_NAME = r"^[a-z0-9][a-z0-9-]{2,49}$"


class RunSpec(_Section):
    name: str = Field(pattern=_NAME, description=(
        "Run name (`[a-z0-9-]`, 3-50), also the stem of the Kaggle kernel and dataset slugs."))
    recipe: Optional[str] = Field(None, description=(
        "A built-in recipe (`price_model`, `vqa_student`, `legal_bert`, `temporal`, `recsys`, `toy`) or "
        "`pkg.module:Class` from code.folder."))
    code: Optional[CodeConfig] = Field(None, description="Your own training code (docs/your-code.md).")
    params: dict[str, Any] = Field(default_factory=dict, description=(
        "The recipe's own parameters, validated by its Params model (docs/reference/params.md)."))
    seed: int = Field(0, ge=0, le=2**32 - 1, description=(
        "Seeds model init, data order (per epoch) and dropout (numpy's range)."))
    optim: OptimConfig = Field(description="Optimization and the run's length.")
    data: DataConfig = Field(DataConfig(), description="DataLoader settings.")
    session: SessionConfig = Field(SessionConfig(), description=(
        "One Kaggle session: its budget, saves and processes."))
    checkpoints: CheckpointConfig = Field(CheckpointConfig(), description="Retention, disk budget and checksums.")
    kaggle: KaggleConfig = Field(KaggleConfig(), description=(
        "What each session kernel mounts and runs on (used by the orchestrator)."))
    notify: NotifyConfig = Field(NotifyConfig(), description="Notifications through a Prefect block.")
    tracking: TrackingConfig = Field(TrackingConfig(), description=(
        "TensorBoard and Weights & Biases: one run per relay (docs/tracking.md); off unless asked."))

    @model_validator(mode="after")
    def _recipe_params(self) -> "RunSpec":
        _check_code_section(self)
        if self.recipe is None or ":" in self.recipe:
            return self  # the user's own code: relay.kernel.usercode.check_code imports and checks it
        if self.recipe not in params_mod.BUILT_IN:
            names = ", ".join(sorted(params_mod.BUILT_IN))
            raise SpecError(f"recipe: unknown recipe {self.recipe!r}; expected one of {names}")
        validate_params(self, params_mod.BUILT_IN[self.recipe])
        return self

    @model_validator(mode="after")
    def _session_fits_kaggle(self) -> "RunSpec":
        budget, limit = self.session.budget, min(KAGGLE_SESSION_LIMIT_S, self.kaggle.weekly_gpu_quota)
        if budget is not None and budget > limit:
            why = "the longest Kaggle session" if limit == KAGGLE_SESSION_LIMIT_S else "kaggle.weekly_gpu_quota"
            raise ValueError(f"session.budget: must be at most {format_duration(limit)}, {why};"
                             f" 'none' runs to the end (got {format_duration(budget)})")
        return self

    @model_validator(mode="after")
    def _wandb_online_needs_internet(self) -> "RunSpec":
        if self.tracking.wandb and self.tracking.wandb.mode == "online" and not self.kaggle.enable_internet:
            raise ValueError("tracking.wandb.mode: online needs kaggle.enable_internet: true; use offline"
                             " (the orchestrator syncs the run) or auto")
        return self

    def recipe_params(self) -> params_mod.RecipeParams:
        """The built-in recipe's Params (a user recipe's are its own class: relay.kernel.recipes.params_of)."""
        if self.recipe not in params_mod.BUILT_IN:
            raise SpecError(f"recipe: {self.recipe} is not a built-in recipe; its Params live in its own module")
        return params_mod.BUILT_IN[self.recipe].model_validate(self.params)


def validate_params(spec: RunSpec, params_class: type) -> params_mod.RecipeParams:
    """`params:` through the recipe's own Params model, reported under `params.`, and its cross-checks."""
    try:
        params = params_class.model_validate(spec.params)
    except ValidationError as err:
        raise SpecError(_first_error(err, prefix="params")) from None
    try:
        params.check_spec(spec)
    except ValueError as err:
        raise SpecError(str(err)) from None
    if params.fit_only and spec.session.devices not in ("auto", 1):
        raise SpecError(f"session.devices: recipe {spec.recipe} is made only of closed-form fits, which run in"
                        f" one process (no batch to split); set 1 or auto (got {spec.session.devices})")
    return params


def _check_code_section(spec: RunSpec) -> None:
    """What the spec alone says about the user's code: present where needed, a folder that exists and fits in
    a kernel. Importing it is the second step (relay.preflight.load_spec)."""
    if spec.kaggle.pip and not spec.kaggle.enable_internet:
        raise SpecError("kaggle.pip: installing requirements at kernel start needs kaggle.enable_internet: true"
                        " (offline kernels cannot reach PyPI); turn internet on or vendor the code into code.folder")
    code = spec.code
    if code is None:
        if spec.recipe is None:
            raise SpecError("recipe: required key is missing (a built-in recipe, or 'module:Class' / code.entry"
                            " with a code: section)")
        if ":" in spec.recipe:
            raise SpecError(f"recipe: {spec.recipe} is a user recipe: add a code: section naming its folder")
        return
    folder = Path(code.folder)
    if not folder.is_dir():
        raise SpecError(f"code.folder: {folder} is not a folder")
    size = sum(f.stat().st_size for _, f in code_files(folder, code.exclude))
    if size > MAX_CODE_BYTES:
        raise SpecError(f"code.folder: {folder} holds {size / 1e6:.1f} MB to ship; at most {MAX_CODE_BYTES / 1e6:g} MB"
                        " travel inside the session kernel: put data and weights in a dataset"
                        " (kaggle.dataset_sources) or leave them out with code.exclude")
    if code.entry and spec.recipe:
        raise SpecError("code.entry: set either recipe or code.entry, not both")
    if not code.entry and not spec.recipe:
        raise SpecError("code.entry: required key is missing (a script 'train.py --args' or 'module:function')"
                        " when no recipe is set")


def _first_error(err: ValidationError, prefix: str = "") -> str:
    e = err.errors()[0]
    path = ".".join(str(p) for p in ((prefix,) if prefix else ()) + tuple(e["loc"]))
    msg = e["msg"]
    # pydantic words its errors for developers; say what is expected in the user's terms.
    if e["type"] == "extra_forbidden":
        msg = "unknown key"
    elif e["type"] == "missing":
        msg = "required key is missing"
    else:
        msg = msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
        if "input" in e and e["type"] not in ("value_error", "assertion_error"):
            msg = f"{msg} (got {e['input']!r})"
    if path and msg.startswith((f"{path}:", f"{path}.")):
        return msg  # a cross-field check that already names its key
    return f"{path}: {msg}" if path else msg


def validate(data: Any, source: str = "spec") -> RunSpec:
    """Validate a parsed spec; raise SpecError with one line `source: key.path: what is expected`."""
    if not isinstance(data, dict):
        raise SpecError(f"{source}: expected a mapping of spec keys at the top level")
    try:
        return RunSpec.model_validate(data)
    except SpecError as err:
        raise SpecError(f"{source}: {err}") from None
    except ValidationError as err:
        raise SpecError(f"{source}: {_first_error(err)}") from None


def load(path: str | Path, overrides: dict[str, Any] | None = None) -> RunSpec:
    """Read and validate a YAML spec. `overrides` are dotted keys (`session.budget`) applied first."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise SpecError(f"{path}: cannot read the spec ({err.strerror})") from None
    try:
        text = decode_utf8(raw, path)
        data = load_yaml(text)
    except DuplicateKey as err:
        raise SpecError(f"{path}: {err}") from None
    except InputError as err:
        raise SpecError(str(err)) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}"
        elif isinstance(getattr(err, "position", None), int):  # a ReaderError: a control character
            where = f" at line {text.count(chr(10), 0, err.position) + 1}"
        else:
            where = ""
        raise SpecError(f"{path}: not valid YAML{where}") from None
    for dotted, value in (overrides or {}).items():
        _set_dotted(data if isinstance(data, dict) else {}, dotted, value)
    if isinstance(data, dict) and isinstance(data.get("code"), dict):
        data["code"]["folder"] = str(resolve_folder(path, data["code"].get("folder", ".")))
    return validate(data, source=str(path))


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for key in parents:
        data = data.setdefault(key, {})
    data[leaf] = value


def to_dict(spec: RunSpec) -> dict[str, Any]:
    """Plain data for YAML/JSON (the inverse of `validate`)."""
    return spec.model_dump(mode="json")
