"""The run spec: one validated model, loaded from YAML, shared by the orchestrator and the session runtime.

Every bad input becomes one line naming the key path and what is expected (`SpecError`), e.g.
`spec.yaml: optim.lr: must be greater than 0 (got -0.1)`. Durations accept seconds or "11h30m", "45m", "90s".
"""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import yaml
from pydantic import Field, ValidationError, model_validator

from relay.shared import params as params_mod
from relay.shared.code_folder import (MAX_CODE_BYTES, accelerate_states, code_files, outputs_holding,
                                      resolve_folder)
from relay.shared.errors import InputError
from relay.shared.inputs import DuplicateKey, decode_utf8, load_yaml
from relay.shared.spec_sections import (  # noqa: F401 (re-exported: the spec's sections and duration helpers)
    DEFAULT_GPU_SHAPE, KAGGLE_OUTPUT_LIMIT_GB, KAGGLE_SESSION_LIMIT_S, WEEK_S, CheckpointConfig, CodeConfig,
    DataConfig, KaggleConfig, NotifyConfig, OptimConfig, SessionConfig, _Section, format_duration, parse_duration)
from relay.shared.tracking_spec import TrackingConfig


class SpecError(InputError):
    """A spec problem, already phrased as one line for the user."""


# a name that is its own slug: Kaggle names a kernel after its title (`<name> session`), so a name python-slugify
# changes (a double or trailing hyphen) would push to a kernel the relay never reads back (kaggle_api_extended.py)
_NAME = r"^[a-z0-9]+(?:-[a-z0-9]+)*$"


class RunSpec(_Section):
    name: str = Field(pattern=_NAME, min_length=3, max_length=50, description=(
        "Run name (`[a-z0-9-]`, 3-50, no double or trailing hyphen), also the stem of the Kaggle kernel and"
        " dataset slugs."))
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
        """The built-in recipe's Params (a user recipe's: relay.kernel.usercode.recipe_params)."""
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
    a kernel. Importing it is the second step (relay.front_door.load_spec)."""
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
    outputs = outputs_holding(folder)
    if outputs is not None:  # it would ship the relay's outputs, and grow with every session
        raise SpecError(f"code.folder: {folder} is inside the relay's output folder {outputs}; point it at"
                        " the folder of your code")
    left_out = accelerate_states(folder, code.exclude)
    if left_out:
        logging.getLogger(__name__).warning(
            "code.folder: %s/ %s Accelerate's save_state output, left out of what ships (the relay's checkpoint"
            " carries that state): save it under session.workdir, or delete it", "/, ".join(left_out),
            "is" if len(left_out) == 1 else "are")
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


@dataclass(frozen=True)
class LoadedSpec:
    """A spec read and parsed once, where a process that runs a relay takes it in (`relay run`, a flow's `spec`
    parameter: relay.front_door): the text a push ships and the spec parsed from that same text (they cannot
    differ), and the file it was read from (None for a spec given as its text). What the orchestrator passes down
    instead of a path."""

    path: Optional[Path]
    text: str       # the spec's text as shipped in a session kernel (UTF-8, universal newlines: `read_text()`'s)
    spec: RunSpec

    @property
    def name(self) -> str:
        return self.spec.name

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        """As a flow's parameter (Prefect validates them with pydantic): taken as it is, never rebuilt from a
        dict, and no form of its own in a deployment's parameters (a deployment run gives a path or the text)."""
        from pydantic_core import core_schema

        return core_schema.is_instance_schema(cls)

    @classmethod
    def __get_pydantic_json_schema__(cls, schema: Any, handler: Any) -> dict:
        return {}


def shipped_text(text: str) -> str:
    """The text a session kernel carries: universal newlines, as `Path.read_text()` gave it (the spec_sha256 the
    kernels pushed before compare against)."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


def read(path: str | Path, overrides: dict[str, Any] | None = None) -> LoadedSpec:
    """Read a YAML spec file and parse it (`parse`). `overrides` as in `load`."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise SpecError(f"{path}: cannot read the spec ({err.strerror})") from None
    try:
        text = shipped_text(decode_utf8(raw, path))
    except InputError as err:
        raise SpecError(str(err)) from None
    return parse(text, source=str(path), path=path, overrides=overrides)


def parse(text: str, source: str = "spec", path: Optional[Path] = None, overrides: dict[str, Any] | None = None,
          folder: str | Path = ".") -> LoadedSpec:
    """The one parse of a spec's text (YAML, then the types): every spec a relay runs comes through here once.
    Its relative paths (code.folder) are relative to the folder of `path`, the file it was read from, else to
    `folder`; `source` names it in errors."""
    text = shipped_text(text)
    try:
        data = load_yaml(text)
    except DuplicateKey as err:
        raise SpecError(f"{source}: {err}") from None
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
        raise SpecError(f"{source}: not valid YAML{where}") from None
    if isinstance(data, dict) and overrides:
        data = override(data, overrides)
    if isinstance(data, dict) and isinstance(data.get("code"), dict):
        where = path if path is not None else Path(folder) / "spec.yaml"  # resolve_folder takes the spec file's path
        data["code"]["folder"] = str(resolve_folder(where, data["code"].get("folder", ".")))
    return LoadedSpec(path, text, validate(data, source=source))


def load(path: str | Path, overrides: dict[str, Any] | None = None) -> RunSpec:
    """Read and validate a YAML spec. `overrides` are dotted keys (`session.budget`) applied first."""
    return read(path, overrides).spec


def override(data: dict, overrides: Mapping[str, Any], none_deletes: bool = False) -> dict:
    """A copy of spec data with `overrides`: dotted keys (`session.budget`) or nested dicts ({"optim": {"lr": 1}}),
    a dict merged into the dict it lands on. None is YAML's null (`--budget none`: no budget), or with
    `none_deletes` removes the key (back to the spec's default)."""
    out = copy.deepcopy(data)
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        node = out
        for key in parents:
            node = node.setdefault(key, {})
        if value is None and none_deletes:
            node.pop(leaf, None)
        elif isinstance(value, dict) and isinstance(node.get(leaf), dict):
            node[leaf] = override(node[leaf], value, none_deletes)
        else:
            node[leaf] = copy.deepcopy(value)
    return out


def to_dict(spec: RunSpec) -> dict[str, Any]:
    """Plain data for YAML/JSON (the inverse of `validate`)."""
    return spec.model_dump(mode="json")
