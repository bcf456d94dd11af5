"""The session's books, one format for both session paths (written through session/core.py): the run's book
(RunBook: what a session carries to the next besides tensors), the session's record in progress.json's `sessions`, what resuming on
another world size or thread count costs, the first save's time estimate, and progress.json itself: tables,
plots and the handoff read one format.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from relay.kernel.session.budget import SessionClock
from relay.shared import atomic
from relay.shared.version import code_version

log = logging.getLogger(__name__)

# anything else: the session goes on ("stalled" is recorded by the watchdog alone: write_stalled)
STOP_REASONS = ("budget", "steps", "sigterm", "done", "diverged", "wrong_accelerator", "stalled")
# reached by every process of a session alone, alike, with no agreement between them
RANK_INDEPENDENT = ("done", "wrong_accelerator")


def estimated_save_seconds(model_bytes: int) -> float:
    """Until a save is measured: the model and AdamW's two moments at a pessimistic 200 MB/s."""
    return 0.2 + 3 * model_bytes / 200e6


def current_layout(state: dict) -> dict:
    """A checkpoint's state in the one layout both session paths save: {"objects": {name: state_dict},
    "relay": the run's books, "rng"[, "rng_ranks"]}. The built-in runner's checkpoints written before it saved
    this layout ({"model", "optimizer", "scheduler", "scaler", "trainer", "rng"}) read as it, so they resume."""
    if "trainer" not in state:
        return state
    old = dict(state)
    objects = {name: old.pop(name) for name in ("model", "optimizer", "scheduler", "scaler")}
    return {"objects": objects, "relay": old.pop("trainer"), **old}


def warn_if_threads_changed(saved: Optional[int]) -> None:
    if saved not in (None, torch.get_num_threads()):
        log.warning("resuming with %d threads, saved with %s: results will not be bit-identical",
                    torch.get_num_threads(), saved)


def world_size_change(saved: int, now: int, step: int) -> Optional[dict]:
    """Resumed with another number of processes: the caller keeps the effective batch; from this step the run
    is no longer bit-identical to an uninterrupted one (progress.json's `exactness_lost`)."""
    if saved == now:
        return None
    why = f"world size changed from {saved} to {now} processes"
    log.warning("%s at step %d: the effective batch is kept, but the run is no longer bit-identical to an"
                " uninterrupted one", why, step)
    return {"step": step, "why": why}


def open_record(sessions: list, run_id: Optional[str], clock: SessionClock, step: int, world_size: int,
                **extra: Any) -> dict:
    """This session's entry in progress.json's `sessions`, appended now and updated at every save."""
    record = {"index": len(sessions) + 1, "run_id": run_id, "started": clock.started, "step_start": step,
              "stop_reason": "running", "world_size": world_size, **extra}
    sessions.append(record)
    return record


def update_record(record: dict, clock: SessionClock, step: int, reason: str, samples_per_s: Optional[float],
                  diverged: Optional[str], **extra: Any) -> None:
    record.update(
        ended=time.time(), seconds=round(clock.elapsed(), 3), step_end=step, samples_per_s=samples_per_s, **extra,
        stop_reason=reason if reason in STOP_REASONS else "running",
        **({"diverged": diverged} if diverged else {}),
        # this save's own time is known only after it; the checkpoint carries the last measured one
        save_seconds=record.get("save_seconds", round(clock.save_seconds or 0.0, 3)),
    )


@dataclass
class RunBook:
    """What a run carries across sessions besides tensors, one book for both session paths (the checkpoint's
    `relay` dict, with the step books' window and guard beside it). Plain data: JSON and weights_only safe.
    The built-in loop fills the batch split, the precision and its guards' counts; a user's loop picks its
    own, so those stay None there."""

    global_step: int = 0
    sessions: list = field(default_factory=list)
    best: Optional[dict] = None  # {"metric", "value", "step", "mode"}
    last_eval: dict = field(default_factory=dict)
    threads: Optional[int] = None
    world_size: int = 1  # processes training together
    exactness_lost: Optional[dict] = None  # {"step", "why"}: from that step on, not bit-identical to one run
    tracking: dict = field(default_factory=dict)  # {"wandb_run_id", "wandb_mode"}: one tracker run per relay
    # the built-in loop's: micro_batch x grad_accum x world_size is the spec's batch (the micro-batch may shrink
    # after an OOM, carried to the next session); precision falls back to fp32 after repeated non-finite losses
    micro_batch: Optional[int] = None
    grad_accum: Optional[int] = None
    precision: Optional[str] = None
    nonfinite_streak: int = 0
    skipped_steps: int = 0
    memory_rungs: list = field(default_factory=list)  # names of the recipe's OOM rungs taken, in order

    @classmethod
    def from_dict(cls, d: dict) -> "RunBook":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    def score(self, metric: str, mode: str, value: Optional[float]) -> bool:
        """An eval's `metric` at this step against the best so far ("min" or "max" is better); True when it is
        the new best (kept in `best`). A missing or non-finite value never is."""
        if value is None or not math.isfinite(value):
            return False
        best = self.best
        if best is not None and not (value < best["value"] if mode == "min" else value > best["value"]):
            return False
        self.best = {"metric": metric, "value": value, "step": self.global_step, "mode": mode}
        return True

    def to_dict(self) -> dict:
        """The checkpoint's form. A key the built-in loop alone fills is left out while unset, so a user loop's
        checkpoint reads as before."""
        d = asdict(self)
        for key in ("micro_batch", "grad_accum", "precision"):
            if d[key] is None:
                del d[key]
        return d

    def run_fields(self, schedule, world_size: int) -> "RunFields":
        """What progress.json says of the run besides its checkpoint. `schedule` (data.StepSchedule, None when
        unknown): the epoch of the last step taken, and the micro-batch of a loop that does not split its own."""
        micro = self.micro_batch
        if micro is None and schedule is not None:
            micro = schedule.effective_batch // world_size
        return RunFields(step=self.global_step, epoch=schedule.epoch_of(max(0, self.global_step - 1)) if schedule
                         else 0, sessions=self.sessions, world_size=world_size,
                         steps_per_epoch=schedule.steps_per_epoch if schedule else None, metrics=self.last_eval,
                         best=self.best, micro_batch=micro, grad_accum=self.grad_accum, precision=self.precision,
                         exactness_lost=self.exactness_lost, tracking=self.tracking, memory_rungs=self.memory_rungs)


@dataclass
class RunFields:
    """What progress.json says of the run besides its checkpoint, filled by both session paths alike. None is
    "not the relay's to know": a user's own loop picks its micro-batch split and precision itself."""

    step: int
    epoch: int
    sessions: list
    world_size: int
    steps_per_epoch: Optional[int] = None
    metrics: dict = field(default_factory=dict)  # the last eval
    best: Optional[dict] = None
    micro_batch: Optional[int] = None
    grad_accum: Optional[int] = None
    precision: Optional[str] = None
    exactness_lost: Optional[dict] = None
    tracking: Optional[dict] = None
    memory_rungs: list = field(default_factory=list)


def write_progress(workdir: Path, ckpt, run: RunFields, *, status: str, reason: str, run_id: Optional[str],
                   name: Optional[str], total: Optional[int], weights: Optional[str] = None) -> dict:
    """progress.json, atomically: where the run stands, what the newest checkpoint is, every session so far."""
    fields = asdict(run)
    sessions = fields.pop("sessions")
    progress = {
        "status": status, "stop_reason": reason, "run_id": run_id, "name": name, "code_version": code_version(),
        "global_step": fields.pop("step"), "total_steps": total, **fields,
        "checkpoint": str(ckpt.path.relative_to(workdir)) if ckpt.path.is_relative_to(workdir) else str(ckpt.path),
        "weights_sha256": weights, "sessions": sessions,
        "total_seconds": round(sum(s.get("seconds", 0.0) for s in sessions), 3),
    }
    atomic.write_json(workdir / "progress.json", progress)
    return progress


def write_stalled(workdir: Path, written: Optional[dict], record: dict, newest, *, run_id: Optional[str],
                  name: Optional[str], total: Optional[int], sessions: list) -> dict:
    """progress.json of a stalled session, atomically: the last one this session wrote (it describes the newest
    checkpoint, which stands) with this session's record replaced by `record` (stop_reason "stalled"); before
    any save, what is known: the checkpoint it resumed from (`newest`, None when fresh) and the sessions so far."""
    progress = dict(written) if written else {
        "run_id": run_id, "name": name, "code_version": code_version(), "total_steps": total,
        "global_step": newest.step if newest is not None else 0,
        "checkpoint": None if newest is None else (str(newest.path.relative_to(workdir))
                                                   if newest.path.is_relative_to(workdir) else str(newest.path))}
    before = progress.get("sessions", [dict(s) for s in sessions])
    progress.update(status="paused", stop_reason="stalled",
                    sessions=[s for s in before if s.get("index") != record["index"]] + [dict(record)])
    atomic.write_json(workdir / "progress.json", progress)
    return progress
