"""What one session of a user's own loop is told, as one typed object.

`relay train` builds it from the spec (`SessionSettings.from_spec`) and hands it to the user's script as JSON in
the RELAY_SESSION environment variable; `relay.open_session()` reads it back. Run by hand, the script gets the
same object from open_session()'s arguments, and every default is the spec's own (read from its sections here,
never written a second time), so a script behaves the same relayed or not.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

from relay.shared.spec_sections import CheckpointConfig, KaggleConfig, OptimConfig, SessionConfig

if TYPE_CHECKING:
    from relay.shared.session_plan import SessionPlan
    from relay.shared.spec import RunSpec


def _spec_default(section: type, name: str) -> Any:
    return section.model_fields[name].default


@dataclass(frozen=True)
class SessionSettings:
    total_steps: Optional[int] = None            # optim.max_steps: the run's length
    workdir: str = "relay-run"
    name: Optional[str] = None
    run_id: Optional[str] = None                 # chosen by the orchestrator; stale output is told by it
    seed: int = 0
    budget: Optional[float] = None               # seconds of this session (None: no limit)
    deadline: Optional[float] = None             # unix time the session must end by
    max_steps: Optional[int] = None              # this session's step cap (session.max_steps)
    log_every: int = _spec_default(OptimConfig, "log_every_steps")
    resume_from: tuple[str, ...] = ()            # read-only checkpoint folders (the mounted checkpoint dataset)
    data: Optional[str] = None
    features: tuple[str, ...] = ()
    save_every: float = _spec_default(SessionConfig, "save_every")
    safety_margin: float = _spec_default(SessionConfig, "safety_margin")
    threads: Optional[int] = None
    stop_on_divergence: bool = _spec_default(SessionConfig, "stop_on_divergence")
    stall_after: Union[str, float, None] = _spec_default(SessionConfig, "stall_after")
    machine_shape: Optional[str] = None          # the accelerator the spec asks for (None: not checked)
    on_other_accelerator: str = _spec_default(KaggleConfig, "on_other_accelerator")
    keep_last: int = _spec_default(CheckpointConfig, "keep_last")
    disk_budget_gb: float = _spec_default(CheckpointConfig, "disk_budget_gb")
    digest: str = _spec_default(CheckpointConfig, "digest")
    tracking: Optional[dict] = None
    internet: bool = False
    extra: dict = field(default_factory=dict)    # keys a newer relay passes that this one does not know

    @classmethod
    def from_spec(cls, spec: "RunSpec", workdir: Path, plan: Optional["SessionPlan"] = None, *,
                  total_steps: Optional[int] = None) -> "SessionSettings":
        """The one spec-to-session translation: what a user's loop is told (`relay train` with code.entry) and
        what the built-in loop's Session and clock are built from (relay.kernel.run, which passes the
        `total_steps` its epochs come to). `plan`: the session's plan (relay/shared/session_plan.py: its run id,
        budget, deadline, and the folders and mounted datasets it reads), read here once; None: a plan of
        nothing (the spec's budget, no deadline, no folders). `total_steps` None: optim.max_steps."""
        from relay.kernel.session.mounts import folders
        from relay.shared.session_plan import SessionPlan

        plan = plan or SessionPlan()
        resume_from, data_dir, feature_dirs = folders(plan)
        s, c, k = spec.session, spec.checkpoints, spec.kaggle
        return cls(total_steps=spec.optim.max_steps if total_steps is None else total_steps, workdir=str(Path(workdir).resolve()), name=spec.name,
                   run_id=plan.run_id, seed=spec.seed, budget=s.budget if plan.budget is None else plan.budget,
                   deadline=plan.deadline, max_steps=s.max_steps,
                   log_every=spec.optim.log_every_steps, resume_from=tuple(str(Path(p).resolve()) for p in resume_from),
                   data=str(Path(data_dir).resolve()) if data_dir else None,
                   features=tuple(str(Path(p).resolve()) for p in feature_dirs), save_every=s.save_every,
                   safety_margin=s.safety_margin, threads=s.threads, stop_on_divergence=s.stop_on_divergence,
                   stall_after=s.stall_after, machine_shape=k.machine_shape if k.enable_gpu else None,
                   on_other_accelerator=k.on_other_accelerator,
                   keep_last=c.keep_last, disk_budget_gb=c.disk_budget_gb, digest=c.digest,
                   tracking=spec.tracking.model_dump(), internet=k.enable_internet)

    @classmethod
    def from_json(cls, values: dict) -> "SessionSettings":
        known = {f.name for f in fields(cls)} - {"extra"}
        given = {k: tuple(v) if k in ("resume_from", "features") else v for k, v in values.items() if k in known}
        return cls(**given, extra={k: v for k, v in values.items() if k not in known})

    def to_json(self) -> dict:
        values = asdict(self)
        values.update(values.pop("extra"))
        return values

    def __getitem__(self, key: str) -> Any:
        """`session.config["seed"]`: scripts written when the settings were a dict read them by key."""
        if key in self.extra:
            return self.extra[key]
        if key == "extra" or key not in self.__dataclass_fields__:
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def checkpoints(self) -> CheckpointConfig:
        return CheckpointConfig(keep_last=self.keep_last, disk_budget_gb=self.disk_budget_gb, digest=self.digest)
