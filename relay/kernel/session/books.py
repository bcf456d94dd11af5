"""The session's books, one format for both session paths (written through session/core.py): what a fresh
workdir carries from the run so far, the session's record in progress.json's `sessions`, what resuming on
another world size or thread count costs, the first save's time estimate, and progress.json itself: tables,
plots and the handoff read one format.
"""
from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from relay.kernel.session.budget import SessionClock
from relay.shared import atomic
from relay.shared.version import code_version

log = logging.getLogger(__name__)

STOP_REASONS = ("budget", "steps", "sigterm", "done", "diverged")  # anything else: the session goes on


def estimated_save_seconds(model_bytes: int) -> float:
    """Until a save is measured: the model and AdamW's two moments at a pessimistic 200 MB/s."""
    return 0.2 + 3 * model_bytes / 200e6


def carry_metrics(metrics: Path, resume_from: Sequence[Path]) -> None:
    """A fresh kernel workdir starts with the metrics of the sessions before it, so the published
    metrics.jsonl always covers the whole run (the loss curve across sessions is drawn from it)."""
    if metrics.exists():
        return
    for source in resume_from:
        if (Path(source) / "metrics.jsonl").is_file():
            shutil.copyfile(Path(source) / "metrics.jsonl", metrics)
            return


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


def write_progress(workdir: Path, ckpt, *, status: str, reason: str, run_id: Optional[str], name: Optional[str],
                   step: int, total: Optional[int], epoch: int, steps_per_epoch: Optional[int], metrics: dict,
                   best: Optional[dict], micro_batch: Optional[int], grad_accum: int, precision: Optional[str],
                   world_size: int, exactness_lost: Optional[dict], tracking: Optional[dict], sessions: list,
                   weights: Optional[str] = None, **extra: Any) -> dict:
    """progress.json, atomically: where the run stands, what the newest checkpoint is, every session so far."""
    progress = {
        "status": status, "stop_reason": reason, "run_id": run_id, "name": name, "code_version": code_version(),
        "global_step": step, "total_steps": total, "epoch": epoch, "steps_per_epoch": steps_per_epoch,
        "metrics": metrics, "best": best, "micro_batch": micro_batch, "grad_accum": grad_accum,
        "precision": precision, "world_size": world_size, "exactness_lost": exactness_lost, **extra,
        "tracking": tracking,
        "checkpoint": str(ckpt.path.relative_to(workdir)) if ckpt.path.is_relative_to(workdir) else str(ckpt.path),
        "weights_sha256": weights, "sessions": sessions,
        "total_seconds": round(sum(s.get("seconds", 0.0) for s in sessions), 3),
    }
    atomic.write_json(workdir / "progress.json", progress)
    return progress
