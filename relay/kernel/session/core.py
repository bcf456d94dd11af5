"""The one session path. Both ways in are its clients: the built-in runner (relay.kernel.run, stepping with the
Trainer of session/loop.py) and the Session API (session/api.py, users' own loops). What a session does to
its workdir happens here, once: load the newest valid checkpoint, open the session's record, write
metrics.jsonl with its progress lines and trackers, save atomically (waited for, or committed in the
background) with progress.json after each commit, and end with progress.json and the last progress line.
The two clients differ only in what they save (the Trainer's state_dict, the objects a script registered)
and in how they step; the books' formats are in session/books.py.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from relay.kernel.session import books, checkpoint, distributed
from relay.kernel.session.budget import SessionClock
from relay.kernel.session.checkpoint import disk_besides
from relay.kernel.session.tracking import Trackers
from relay.shared.progress_line import ProgressLines
from relay.shared.spec_sections import CheckpointConfig
from relay.shared.version import code_version


class SessionCore:
    """One session's workdir: checkpoints/, metrics.jsonl, progress.json. Rank 0 alone writes; every rank
    calls save() (the others wait at its barrier)."""

    def __init__(self, workdir: Path, clock: SessionClock, world: distributed.World, *, total_steps: int,
                 name: Optional[str], run_id: Optional[str], resume_from: Sequence[Path],
                 checkpoints: CheckpointConfig, tracking: Optional[dict], internet: bool):
        self.workdir, self.clock, self.world = Path(workdir), clock, world
        self.total_steps, self.name, self.run_id = total_steps, name, run_id
        self.resume_from = [Path(p) for p in resume_from]
        self.ckpt_root = self.workdir / "checkpoints"
        self.metrics_path = self.workdir / "metrics.jsonl"
        self.checkpoints = checkpoints  # keep_last, disk_budget_gb, digest
        self.writer = checkpoint.CheckpointWriter()  # this session's saves: the one in flight, the deletions
        self.trackers = Trackers(tracking, self.workdir, main=world.main, internet=internet)
        self.record: dict = {}  # this session's entry in progress.json's `sessions`, from open() on
        self.lines: Optional[ProgressLines] = None

    # -- start ------------------------------------------------------------------------------------------
    def load(self) -> Optional[tuple[checkpoint.Checkpoint, dict]]:
        """The newest valid checkpoint, own workdir first, then the relay's resume folders (None when fresh;
        InputError when a resume folder holds only corrupt ones). A fresh workdir gets the run's metrics so far."""
        restored = checkpoint.load_resume(self.ckpt_root, self.resume_from)
        if self.world.main:
            books.carry_metrics(self.metrics_path, self.resume_from)
        return (restored[0], books.current_layout(restored[1])) if restored else None

    def open(self, sessions: list, step: int, tracking_state: dict, current_step: Callable[[], int],
             model_bytes: int, **record: Any) -> dict:
        """Start this session's record (appended to `sessions`), its progress lines and its trackers; until a
        save is measured, the clock plans the final save from the model's size."""
        self.clock.estimated_save_seconds = books.estimated_save_seconds(model_bytes)
        self.run_id = self.run_id or (sessions[-1].get("run_id") if sessions else None)
        self.record = books.open_record(sessions, self.run_id, self.clock, step, self.world.size, **record)
        self.lines = ProgressLines(self.record["index"], step, self.total_steps, self.clock.remaining,
                                   run_id=self.run_id)
        self.trackers.start(step, tracking_state, self.resume_from, name=self.name, current_step=current_step)
        return self.record

    # -- during -----------------------------------------------------------------------------------------
    def stop_reason(self, step: int, diverged: Optional[str], eval_due: bool = False) -> Optional[str]:
        """This process's answer to "stop before the next step?" ("done", "diverged", the clock's "budget",
        "steps" or "sigterm"), or None; with several processes the caller agrees on it with the others."""
        if step >= self.total_steps:
            return "done"
        return "diverged" if diverged else self.clock.should_stop(eval_due=eval_due)

    def log(self, record: dict, shown: Optional[dict] = None) -> None:
        """One metrics.jsonl line (appended and flushed: a kill loses at most that line), then its progress
        line and the trackers; `shown` (samples/s, lr) goes to those two only."""
        record = {"session": self.record.get("index"), "time": round(time.time(), 3), **record}
        if record.get("kind") == "train":
            self.record["loss_end"] = record.get("loss")
        if not self.world.main:
            return
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        shown_record = {**record, **shown} if shown else record
        if self.lines is not None:
            self.lines(shown_record)
        if self.trackers.enabled:
            self.trackers.log(shown_record)

    def update_record(self, step: int, reason: str, samples_per_s: Optional[float], diverged: Optional[str],
                      **extra: Any) -> None:
        speed = None if samples_per_s is None else round(samples_per_s, 2)
        books.update_record(self.record, self.clock, step, reason, speed, diverged, **extra)

    def save(self, state: Optional[dict], reason: str, *, step: int, meta: dict, progress: books.RunFields, model: Any,
             background: bool = False, keep_best_mode: Optional[str] = None, exports: int = 1,
             started: Optional[float] = None) -> Optional[checkpoint.Checkpoint]:
        """An atomic checkpoint of `state` (None off rank 0), then progress.json ("paused") from `progress`.
        In the background (periodic and best saves) the commit runs while training goes on and the previous
        checkpoint stays the newest valid one until then; otherwise it is waited for and returned. The time
        to the commit goes on the clock: it is what the session's final save will cost. `started`: when the
        caller began writing what `state` packs (a trainer's own checkpoint). For a background save, `progress`
        must be a copy the caller no longer changes: it is written when the commit lands."""
        t0 = time.perf_counter() if started is None else started
        if not self.world.main:
            distributed.barrier(self.world)
            return None
        self.trackers.flush()  # what this checkpoint covers is on disk before it commits

        def committed(ckpt: checkpoint.Checkpoint) -> None:
            seconds = time.perf_counter() - t0
            self.clock.record_save(seconds)
            self.record["save_seconds"] = round(seconds, 3)
            self.write_progress(ckpt, "paused", reason, progress)

        c = self.checkpoints
        pending = self.writer.start_save(
            self.ckpt_root, state, step=step,
            meta={"run_id": self.run_id, "code_version": code_version(), "reason": reason, **meta},
            disk_budget_bytes=int(c.disk_budget_gb * 1e9), keep_last=c.keep_last,
            keep_best_mode=keep_best_mode, digest=c.digest,
            besides_bytes=disk_besides(self.workdir, self.ckpt_root, model, reason, exports),
            background=background, on_commit=committed)
        ckpt = None if background else pending.result()
        distributed.barrier(self.world)
        return ckpt

    # -- end --------------------------------------------------------------------------------------------
    def write_progress(self, ckpt: checkpoint.Checkpoint, status: str, reason: str, progress: books.RunFields,
                       weights: Optional[str] = None) -> dict:
        return books.write_progress(self.workdir, ckpt, progress, status=status, reason=reason, run_id=self.run_id,
                                    name=self.name, total=self.total_steps, weights=weights)

    def finish(self, status: str, reason: str, progress: books.RunFields, weights: Optional[str]) -> dict:
        """Rank 0 after the last save (and the export): progress.json and the session's last progress line."""
        self.writer.wait_for_deletions()
        result = self.write_progress(checkpoint.list_valid(self.ckpt_root)[0], status, reason, progress, weights)
        if self.lines is not None:
            self.lines.end(progress.step, result["status"], reason)
        return result

    def close(self) -> None:
        self.trackers.close()
