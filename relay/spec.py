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

from relay import recipes
from relay.errors import InputError
from relay.inputs import DuplicateKey, decode_utf8, load_yaml


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
    micro_batch: PositiveInt = 8
    grad_accum: PositiveInt = 1
    precision: Literal["auto", "fp32", "fp16", "bf16"] = "auto"
    tf32: bool = True
    activation_checkpointing: bool = False
    clip_grad_norm: Optional[PositiveFloat] = 1.0
    lr: PositiveFloat = 3e-4
    weight_decay: NonNegativeFloat = 0.01
    schedule: Literal["constant", "linear", "cosine"] = "linear"
    warmup_steps: NonNegativeInt = 0
    epochs: Optional[PositiveInt] = None
    max_steps: Optional[PositiveInt] = None
    eval_batch: PositiveInt = 16
    eval_every_steps: Optional[PositiveInt] = None  # None: at the end of every epoch
    log_every_steps: PositiveInt = 10
    nonfinite_patience: PositiveInt = 3  # skipped non-finite steps in a row before falling back to fp32

    @model_validator(mode="after")
    def _one_length(self) -> "OptimConfig":
        if (self.epochs is None) == (self.max_steps is None):
            raise ValueError("optim: set exactly one of epochs or max_steps")
        return self


class DataConfig(_Section):
    num_workers: NonNegativeInt = 2
    pin_memory: Literal["auto", True, False] = "auto"  # auto: on when training on CUDA
    prefetch_factor: PositiveInt = 2
    persistent_workers: bool = True
    non_blocking: bool = True


class SessionConfig(_Section):
    budget: Optional[float] = None  # seconds of wall time per session; None runs to the end
    max_steps: Optional[PositiveInt] = None  # optimizer steps per session (a count that no machine speed changes)
    save_every: float = 1800.0  # periodic save as insurance against SIGKILL
    safety_margin: float = 60.0  # reserved before the deadline on top of the measured save time
    empty_cache_every_steps: Optional[PositiveInt] = 50
    memory_log_every_steps: PositiveInt = 50
    threads: Optional[PositiveInt] = None  # torch CPU threads; exact resume needs the same count
    # processes training together: "auto" is every visible GPU (both T4s of a T4 x2), 1 on CPU
    devices: Union[Literal["auto"], PositiveInt] = "auto"

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
    keep_last: PositiveInt = 2
    keep_best: bool = True  # also keep the checkpoint with the best recipe metric
    disk_budget_gb: PositiveFloat = 20.0
    digest: Literal["crc32", "sha256"] = "crc32"  # manifest checksum; sha256 costs ~2x a save without SHA-NI

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

    dataset_sources: list[str] = Field(default_factory=list)  # "owner/slug" of the raw data
    competition_sources: list[str] = Field(default_factory=list)  # slugs; point params.data_dir at one
    data_mount: Optional[str] = None  # which mounted source is the recipe's data_dir (default: first)
    machine_shape: Optional[str] = None  # NvidiaTeslaT4 (GPU T4 x2) when enable_gpu and unset, see below
    enable_gpu: bool = True
    enable_internet: bool = False
    session_timeout: float = 12 * 3600.0  # Kaggle's per-session cap
    startup_overhead: float = 120.0  # kernel start + restore, kept out of the training budget
    weekly_gpu_quota: float = 30 * 3600.0
    max_failed_sessions: NonNegativeInt = 2
    pip: list[str] = Field(default_factory=list)  # requirements installed at kernel start (needs enable_internet)

    @field_validator("session_timeout", "startup_overhead", "weekly_gpu_quota", mode="before")
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


class CodeConfig(_Section):
    """The user's own code (relay/usercode.py): a folder shipped with every session kernel, and what to run."""

    folder: str = "."  # relative to the spec file; inside a kernel, where the kernel unpacked it
    entry: Optional[str] = None  # "train.py --lr 3e-4" or "pkg.module:function"; None with a user recipe
    exclude: list[str] = Field(default_factory=list)  # glob patterns left out of the shipped folder


_NAME = r"^[a-z0-9][a-z0-9-]{2,49}$"


class RunSpec(_Section):
    name: str = Field(pattern=_NAME)  # also the Kaggle kernel/dataset slug stem
    recipe: Optional[str] = None  # a built-in name, or "pkg.module:Class" from code.folder
    code: Optional[CodeConfig] = None
    params: dict[str, Any] = Field(default_factory=dict)
    seed: int = Field(0, ge=0, le=2**32 - 1)  # numpy's seed range
    optim: OptimConfig
    data: DataConfig = DataConfig()
    session: SessionConfig = SessionConfig()
    checkpoints: CheckpointConfig = CheckpointConfig()
    kaggle: KaggleConfig = KaggleConfig()

    @model_validator(mode="after")
    def _recipe_params(self) -> "RunSpec":
        from relay import usercode

        deferred = usercode.check_spec(self)  # code:, a user recipe, kaggle.pip (SpecError naming the key)
        if self.recipe is None or deferred:
            return self  # a code.entry runs the user's own loop; a recipe needing kaggle.pip is checked in the kernel
        if ":" not in self.recipe and self.recipe not in recipes.names():
            raise SpecError(f"recipe: unknown recipe {self.recipe!r}; expected one of {', '.join(recipes.names())}")
        # Validated by the recipe's own Params model, reported under `params.`.
        try:
            params = recipes.params_class(self.recipe).model_validate(self.params)
        except ValidationError as err:
            raise SpecError(_first_error(err, prefix="params")) from None
        try:
            params.check_spec(self)
        except ValueError as err:
            raise SpecError(str(err)) from None
        if params.fit_only and self.session.devices not in ("auto", 1):
            raise SpecError(f"session.devices: recipe {self.recipe} is made only of closed-form fits, which run in"
                            f" one process (no batch to split); set 1 or auto (got {self.session.devices})")
        return self

    @model_validator(mode="after")
    def _session_fits_kaggle(self) -> "RunSpec":
        budget, limit = self.session.budget, min(KAGGLE_SESSION_LIMIT_S, self.kaggle.weekly_gpu_quota)
        if budget is not None and budget > limit:
            why = "the longest Kaggle session" if limit == KAGGLE_SESSION_LIMIT_S else "kaggle.weekly_gpu_quota"
            raise ValueError(f"session.budget: must be at most {format_duration(limit)}, {why};"
                             f" 'none' runs to the end (got {format_duration(budget)})")
        return self

    def recipe_params(self):
        return recipes.params_class(self.recipe).model_validate(self.params)


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
        from relay import usercode

        data["code"]["folder"] = str(usercode.resolve_folder(path, data["code"].get("folder", ".")))
    return validate(data, source=str(path))


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for key in parents:
        data = data.setdefault(key, {})
    data[leaf] = value


def to_dict(spec: RunSpec) -> dict[str, Any]:
    """Plain data for YAML/JSON (the inverse of `validate`)."""
    return spec.model_dump(mode="json")
