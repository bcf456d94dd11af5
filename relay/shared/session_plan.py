"""One session's plan as it crosses the wire: made once by the orchestrator (relay/orchestrator/kaggle/kernel_source.py
builds it from the push), written once into the kernel script as its JSON (`PLAN = ...`), read once by the session
(`relay train --plan FILE` into its settings: relay/kernel/session/settings.py). No dict in between, no flag beside
it: `relay train` refuses `--budget`, `--run-id`, `--resume-from`, ... given with `--plan` (those flags alone build
a plan by hand).

The orchestrator names Kaggle datasets ("owner/slug": `resume`, `data`, `features`); the session finds where Kaggle
mounted them (relay/kernel/session/mounts.py). By hand, the folders are given as they are (`resume_from`, `data_dir`,
`feature_dirs`). The orchestrator reads the plan back from a kernel's source (kernel_source.find_plan: the push time,
the timeout asked for, the failed attempts' charges) by the same keys the plans pushed before it carried.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Optional

from relay.shared.errors import InputError

FORMAT = 2  # 1: the folders only, written by the kernel script of relay versions before the plan was made once

_TUPLES = ("resume_from", "feature_dirs", "resume", "features", "pip", "charges")


@dataclass(frozen=True)
class SessionPlan:
    run_id: Optional[str] = None
    budget: Optional[float] = None                   # seconds of training; None: the spec's session.budget
    deadline: Optional[float] = None                 # unix time the session must end by; None: none
    # folders given as they are (by hand: relay train --resume-from/--data/--features)
    resume_from: tuple[str, ...] = ()                # read-only places with checkpoints
    data_dir: Optional[str] = None                   # the recipe's raw data folder
    feature_dirs: tuple[str, ...] = ()               # read-only feature caches
    # Kaggle datasets the orchestrator mounted ("owner/slug"), found under the kernel's input folder
    resume: tuple[str, ...] = ()                     # the checkpoint dataset
    data: Optional[str] = None                       # the data dataset
    features: tuple[str, ...] = ()                   # the feature-cache datasets
    # the kernel script's: where it writes, what it carries and installs, a `relay doctor` canary's mounts
    workdir: str = "relay"
    code_version: str = ""
    bundle_sha256: str = ""
    spec_sha256: str = ""
    user_code: bool = False
    pip: tuple[str, ...] = ()
    canary: Optional[tuple[str, ...]] = None
    # the orchestrator's, read back from the pushed source: when it was pushed (this machine's clock), the limit
    # asked of Kaggle (a session still running well past it is wedged), the failed attempts since the last
    # hand-over (relay/orchestrator/goodput.py charge records)
    pushed_at: Optional[float] = None
    timeout_s: Optional[float] = None
    charges: tuple[dict, ...] = ()

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **asdict(self)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str = "session plan") -> "SessionPlan":
        try:
            data: Any = json.loads(text)
        except ValueError as err:
            raise InputError(f"{source}: not JSON ({err})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise InputError(f"{source}: not a session plan of format {FORMAT}")
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        for name in _TUPLES:
            if name in values:
                if not isinstance(values[name], list):
                    raise InputError(f"{source}: {name}: expected a list (got {values[name]!r})")
                values[name] = tuple(values[name])
        if isinstance(values.get("canary"), list):
            values["canary"] = tuple(values["canary"])
        budget = values.get("budget")
        if budget is not None and (not isinstance(budget, (int, float)) or isinstance(budget, bool) or budget < 0):
            raise InputError(f"{source}: budget: expected seconds, 0 or more, or null (got {budget!r})")
        if budget is not None:
            values["budget"] = float(budget)
        return cls(**values)

    @classmethod
    def read(cls, path: str | Path) -> "SessionPlan":
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as err:
            raise InputError(f"{path}: cannot read the session plan ({err.strerror})") from None
        return cls.from_json(text, source=str(path))
