"""One session's plan as it crosses the wire: what the orchestrator decided for this session (its run id, its
budget, the checkpoints to resume from and the data and feature mounts, as the kernel found them), one typed JSON
object the session trusts as it is, instead of flags written back into a re-parsed spec.

The kernel script (relay/orchestrator/kaggle/kernel_source.py) writes it beside the spec and runs
`python -m relay train SPEC --workdir DIR --plan FILE`; the flags (`--budget`, `--run-id`, `--resume-from`, ...) keep
working, by hand and in the kernels pushed before the plan (their script passes flags), and a flag given beside
`--plan` wins over the plan's field.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from relay.shared.errors import InputError

FORMAT = 1


@dataclass(frozen=True)
class SessionPlan:
    run_id: Optional[str] = None
    budget: Optional[float] = None                   # seconds of training; None: the spec's session.budget
    deadline: Optional[float] = None                 # unix time the session must end by; None: none
    resume_from: tuple[str, ...] = ()                # read-only places with checkpoints (the mounted dataset)
    data: Optional[str] = None                       # the recipe's raw data folder (the data mount)
    features: tuple[str, ...] = field(default=())    # read-only feature caches (the features mount)

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
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        try:
            plan = cls(**known)
        except TypeError as err:
            raise InputError(f"{source}: {err}") from None
        budget = plan.budget
        if budget is not None and (not isinstance(budget, (int, float)) or isinstance(budget, bool) or budget < 0):
            raise InputError(f"{source}: budget: expected seconds, 0 or more, or null (got {budget!r})")
        return cls(**{**known, "resume_from": tuple(plan.resume_from), "features": tuple(plan.features),
                      "budget": None if budget is None else float(budget)})

    @classmethod
    def read(cls, path: str | Path) -> "SessionPlan":
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as err:
            raise InputError(f"{path}: cannot read the session plan ({err.strerror})") from None
        return cls.from_json(text, source=str(path))
