"""progress.json as a typed document: what a session writes (relay/kernel/session/books.py) and every orchestrator
module reads, one model on both sides of the wire.

`Progress` is where the run stands and what its newest checkpoint is; `SessionRecord` one entry of its `sessions`
(one per session, written by the kernel's clock); `Charge` one entry of `charges`, what the orchestrator observed of
a handed-over or failed attempt (relay/orchestrator/goodput.py adds them before it publishes the document).

One reader (`Progress.from_dict`, `from_json`, `load`, `read`) and one writer (`to_dict`). Versioned by `format`:
documents from before it have none and read as format 0, the same layout. Every field is optional on reading, as
the kernels that wrote them differed (no `charges` before goodput, no `saving_s` before saves were measured...).
Keys this reader does not know (a newer writer's) are kept in `extra` and written back as they were, and a key a
document did not have is not written back (nor a null added): a document read and written again is the same
document, which the hand-over relies on (every orchestrator stages the same progress.json). A malformed one is an
InputError naming the file and the field.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence, Tuple, TypeVar, Union

from relay.shared.errors import InputError

log = logging.getLogger(__name__)
FORMAT = 1  # 0: the documents written before this model (no `format` key), the same layout
_BOOKKEEPING = ("extra", "present")

T = TypeVar("T", bound="_Document")


class _Document:
    """Read from a mapping and written back to one: the known keys as fields, the others in `extra`; `present` is the
    known keys the source had (None: every field, a document made here by the writer)."""

    extra: Mapping[str, Any]
    present: Optional[frozenset]

    @classmethod
    def _known(cls) -> tuple:
        return tuple(f.name for f in fields(cls) if f.name not in _BOOKKEEPING)

    @classmethod
    def _from(cls: type[T], d: Any, where: str, **typed: Any) -> T:
        if not isinstance(d, Mapping):
            raise InputError(f"{where}: expected a JSON object, got {type(d).__name__}")
        known = cls._known()
        values = {k: d[k] for k in known if k in d}
        values.update(typed)
        return cls(**values, extra={k: v for k, v in d.items() if k not in known},
                   present=frozenset(k for k in known if k in d))

    @classmethod
    def written(cls: type[T], **values: Any) -> T:
        """A document made here: exactly `values` are written (a None among them as null)."""
        return cls(**values, present=frozenset(values))

    def to_dict(self) -> dict:
        """The JSON object: the fields the source had or that were set since, then the keys kept unread."""
        out = {}
        for f in fields(self):
            if f.name in _BOOKKEEPING:
                continue
            value = getattr(self, f.name)
            default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
            if self.present is None or f.name in self.present or value != default:
                out[f.name] = _plain(value)
        out.update(self.extra)
        return out

    def has(self, name: str) -> bool:
        """Whether the document had field `name` (one made here by the writer has them all): a reader that tells
        an absent key from a null one."""
        return self.present is None or name in self.present

    def get_extra(self, key: str, default: Any = None) -> Any:
        """A key this model does not know (written by a newer kernel, or a test's own)."""
        return self.extra.get(key, default)


def _plain(value: Any) -> Any:
    if isinstance(value, _Document):
        return value.to_dict()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _int(value: Any, where: str) -> Optional[int]:
    """An integer field (a step, a count), None when absent; a float that is whole reads as one."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (isinstance(value, float) and not (math.isfinite(value) and value.is_integer())):
        raise InputError(f"{where}: expected a whole number, got {value!r}")
    return int(value)


def _objects(value: Any, where: str) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InputError(f"{where}: expected a list of objects, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class SessionRecord(_Document):
    """One session as its kernel recorded it (books.open_record / update_record): unix times by the kernel's clock."""

    index: Optional[int] = None
    run_id: Optional[str] = None
    started: Any = None            # unix seconds (a report's input may give a datetime or an ISO string)
    ended: Any = None              # None while it runs
    seconds: Optional[float] = None
    step_start: Optional[int] = None
    step_end: Optional[int] = None
    stop_reason: Optional[str] = None
    world_size: Optional[int] = None
    samples_per_s: Optional[float] = None
    save_seconds: Optional[float] = None   # the last save's time
    saving_s: Optional[float] = None       # what training waited for in its saves (absent before it was measured)
    saves: Optional[int] = None
    loss_end: Optional[float] = None
    peak_mem_mb: Optional[float] = None
    gpus: Optional[Mapping] = None         # {"count", "names"}
    diverged: Optional[str] = None
    stalled: Optional[str] = None
    accelerator: Optional[str] = None      # another accelerator than asked for
    stage: Optional[str] = None
    memory_rungs: Optional[Sequence] = None
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)  # what it ran on (runtime.py) and the rest
    present: Optional[frozenset] = field(default=None, compare=False, repr=False)

    @classmethod
    def from_dict(cls, d: Any, where: str = "session record") -> "SessionRecord":
        typed = {k: _int(d.get(k), f"{where}: {k}") for k in ("index", "step_start", "step_end")
                 if isinstance(d, Mapping) and k in d}
        return cls._from(d, where, **typed)

    @classmethod
    def read(cls, value: Union["SessionRecord", Mapping]) -> "SessionRecord":
        return value if isinstance(value, SessionRecord) else cls.from_dict(value)

    def as_mapping(self) -> dict:
        """The record as the kernel wrote it, for what reads any mapping of what a session ran on (runtime.py)."""
        return self.to_dict()


@dataclass(frozen=True)
class Charge(_Document):
    """What the orchestrator observed of one attempt (goodput.charge_record / failed_charge), unix times."""

    run_id: Optional[str] = None
    wedged: Optional[bool] = None
    pushed_at: Optional[float] = None         # from the pushed plan, when it was this run's
    process_end: Optional[float] = None       # its `end` progress line
    last_line: Optional[float] = None         # its newest progress line, when it has no `end` line
    last_step: Optional[int] = None
    kaggle_end_seen: Optional[float] = None   # when the relay saw it end (or deleted it)
    kaggle_start: Optional[float] = None      # Kaggle's own (the emulator's quota ledger, in tests)
    kaggle_end: Optional[float] = None
    failed: Optional[str] = None              # it handed nothing over: why
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)
    present: Optional[frozenset] = field(default=None, compare=False, repr=False)

    @classmethod
    def from_dict(cls, d: Any, where: str = "charge") -> "Charge":
        return cls._from(d, where)

    @classmethod
    def read(cls, value: Union["Charge", Mapping]) -> "Charge":
        return value if isinstance(value, Charge) else cls.from_dict(value)


@dataclass(frozen=True)
class Progress(_Document):
    """progress.json: where the run stands (books.write_progress), its sessions, and, once published, its charges."""

    format: int = 0
    status: Optional[str] = None           # "paused" | "done" | ...
    stop_reason: Optional[str] = None
    run_id: Optional[str] = None
    name: Optional[str] = None
    code_version: Optional[str] = None
    global_step: int = 0
    total_steps: Optional[int] = None
    epoch: Optional[int] = None
    world_size: Optional[int] = None
    steps_per_epoch: Optional[int] = None
    metrics: Optional[Mapping] = None      # the last eval
    best: Optional[Mapping] = None         # {"metric", "value", "step", "mode"}
    micro_batch: Optional[int] = None
    grad_accum: Optional[int] = None
    precision: Optional[str] = None
    exactness_lost: Optional[Mapping] = None  # {"step", "why"}
    tracking: Optional[Mapping] = None     # {"wandb_run_id", "wandb_mode"}
    memory_rungs: Optional[Sequence] = None
    checkpoint: Optional[str] = None
    weights_sha256: Optional[str] = None
    sessions: Tuple[SessionRecord, ...] = ()
    total_seconds: Optional[float] = None
    charges: Tuple[Charge, ...] = ()
    # a corrupt version was replaced by an older valid one (relay/orchestrator/restore.py): {"bad_version",
    # "from_version", "after_run", "attempt", "why"}
    restored: Optional[Mapping] = None
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)
    present: Optional[frozenset] = field(default=None, compare=False, repr=False)

    # -- reading ----------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Any, source: str = "progress.json") -> "Progress":
        """The document of `source` (a path or a name, for the error). A newer format is read for what this model
        knows, its other keys kept: an orchestrator older than the kernel still hands its sessions over."""
        if not isinstance(d, Mapping):
            raise InputError(f"{source}: expected a JSON object, got {type(d).__name__}")
        typed: dict = {k: _int(d[k], f"{source}: {k}") for k in ("format", "global_step", "total_steps")
                       if k in d}
        if typed.get("global_step", 0) is None:  # a null step is no step yet
            typed["global_step"] = 0
        if "sessions" in d:
            typed["sessions"] = tuple(SessionRecord.from_dict(s, f"{source}: sessions[{i}]")
                                      for i, s in enumerate(_objects(d["sessions"], f"{source}: sessions")))
        if "charges" in d:
            typed["charges"] = tuple(Charge.from_dict(c, f"{source}: charges[{i}]")
                                     for i, c in enumerate(_objects(d["charges"], f"{source}: charges")))
        return cls._from(d, source, **typed)

    @classmethod
    def from_json(cls, text: Union[str, bytes], source: str = "progress.json") -> "Progress":
        try:
            d = json.loads(text)
        except ValueError as err:
            raise InputError(f"{source}: unreadable progress.json, not JSON ({err})") from None
        return cls.from_dict(d, source)

    @classmethod
    def load(cls, path: Union[str, Path]) -> "Progress":
        try:
            text = Path(path).read_bytes()
        except OSError as err:
            raise InputError(f"{path}: unreadable progress.json ({err.strerror or err})") from None
        return cls.from_json(text, str(path))

    @classmethod
    def from_output(cls, value: Any, source: str = "progress.json") -> Optional["Progress"]:
        """A session output's document, where a malformed one is none at all (the output holds nothing to hand
        over, as with an unreadable file): None, and why in the log."""
        if value is None:
            return None
        try:
            return cls.from_dict(value, source)
        except InputError as err:
            log.warning("%s", err)
            return None

    @classmethod
    def read(cls, value: Union["Progress", Mapping, None], source: str = "progress.json") -> Optional["Progress"]:
        """A document as the caller has it: the model, a parsed JSON object, or None (none yet)."""
        if value is None or isinstance(value, Progress):
            return value
        return cls.from_dict(value, source)

    # -- derived ----------------------------------------------------------------------------------------
    @property
    def last_session(self) -> Optional[SessionRecord]:
        return self.sessions[-1] if self.sessions else None

    def charge_of(self, run_id: Optional[str]) -> Optional[Charge]:
        return next((c for c in self.charges if c.run_id == run_id), None)

    def with_sessions(self, sessions: Iterable[Union[SessionRecord, Mapping]]) -> "Progress":
        return replace(self, sessions=tuple(SessionRecord.read(s) for s in sessions))

    def with_charges(self, charges: Iterable[Union[Charge, Mapping]]) -> "Progress":
        return replace(self, charges=tuple(Charge.read(c) for c in charges))


def sessions_of(progress: Union[Progress, Mapping, None]) -> Tuple[SessionRecord, ...]:
    """The sessions of a document that may not be there yet (None: none)."""
    read = Progress.read(progress)
    return read.sessions if read is not None else ()
