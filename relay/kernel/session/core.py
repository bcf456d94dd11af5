"""The one session path, whose one client is the Session (session/api.py): a user's loop drives it, and so
does the built-in Trainer (relay/kernel/trainer.py, from relay.kernel.run). What a session does to its workdir happens
here, once: load the newest valid checkpoint, open the session's record, write metrics.jsonl with its progress
lines and trackers, save atomically (waited for, or committed in the background) with progress.json after each
commit, and end with progress.json and the last progress line. The books' formats are in session/books.py. When
the record opens, the session says what it runs on (session/hardware.py), stops at once on the wrong
accelerator when the spec says so, and starts its stall watchdog (session/watchdog.py), whose last act is
`_stalled`.
"""
from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any, Callable, Optional

from relay.kernel.session import books, checkpoint, distributed, hardware
from relay.kernel.session.budget import SessionClock
from relay.kernel.session.checkpoint import disk_besides
from relay.kernel.session.settings import SessionSettings
from relay.kernel.session.tracking import Trackers
from relay.kernel.session.watchdog import STALLED_EXIT, StallWatchdog, stall_limit
from relay.shared import runtime
from relay.shared.environment import SessionEnvironment
from relay.shared.progress_line import ProgressLines
from relay.shared.spec_sections import format_duration
from relay.shared.version import code_version

log = logging.getLogger(__name__)


class SessionCore:
    """One session's workdir: checkpoints/, metrics.jsonl, progress.json. Rank 0 alone writes; every rank
    calls save() (the others wait at its barrier)."""

    def __init__(self, settings: SessionSettings, clock: SessionClock, world: distributed.World):
        """`settings` (SessionSettings.from_spec, or what a user's loop was told) gives the workdir, the run's
        length and names, the resume folders, the checkpoint limits, the trackers, `stall_after` (None: no
        watchdog), `machine_shape` (the accelerator the spec asks for; None: not checked) and
        `on_other_accelerator`; the budget is the clock's."""
        self.settings, self.clock, self.world = settings, clock, world
        self.workdir = Path(settings.workdir)
        self.total_steps, self.name, self.run_id = int(settings.total_steps), settings.name, settings.run_id
        self.resume_from = [Path(p) for p in settings.resume_from]
        self.ckpt_root = self.workdir / "checkpoints"
        self.metrics_path = self.workdir / "metrics.jsonl"
        self.checkpoints = settings.checkpoints()  # keep_last, disk_budget_gb, digest
        self.writer = checkpoint.CheckpointWriter()  # this session's saves: the one in flight, the deletions
        self.trackers = Trackers(settings.tracking, self.workdir, main=world.main, internet=bool(settings.internet))
        self.record: dict = {}  # this session's entry in progress.json's `sessions`, from open() on
        self.lines: Optional[ProgressLines] = None
        self.stall_after, self.machine_shape = settings.stall_after, settings.machine_shape
        self.on_other_accelerator = settings.on_other_accelerator
        self.wrong_accelerator = False  # stop at once: another accelerator than asked for, and the spec says stop
        self.environment_changed: Optional[dict] = None  # {"step", "why"}: ran elsewhere than the session before
        self.watchdog: Optional[StallWatchdog] = None
        self._current_step: Callable[[], int] = lambda: 0  # the client's step counter, from open()
        self._restored: Optional[checkpoint.Checkpoint] = None
        self._sessions: list = []
        self._written: Optional[dict] = None  # the last progress.json written, which a stall record amends
        self._books = threading.Lock()  # progress.json: a background commit's or the watchdog's, one at a time
        self._ended = False  # the watchdog recorded a stall: nothing writes progress.json after it
        self._metrics: Optional[IO[str]] = None  # metrics.jsonl, opened for appending at the first line

    # -- start ------------------------------------------------------------------------------------------
    def load(self) -> Optional[tuple[checkpoint.Checkpoint, dict]]:
        """The newest valid checkpoint, own workdir first, then the relay's resume folders (None when fresh;
        InputError when a resume folder holds only corrupt ones). A fresh workdir's metrics.jsonl holds this
        session's lines only: the orchestrator keeps the run's whole history (relay/orchestrator/history.py)."""
        restored = checkpoint.load_resume(self.ckpt_root, self.resume_from)
        self._restored = restored[0] if restored else None
        return (restored[0], books.current_layout(restored[1])) if restored else None

    def open(self, sessions: list, step: int, tracking_state: dict, current_step: Callable[[], int],
             model_bytes: int, **record: Any) -> dict:
        """Start this session's record (appended to `sessions`) with what it runs on, its progress lines, its
        trackers and its stall watchdog; until a save is measured, the clock plans the final save from the
        model's size."""
        self.clock.estimated_save_seconds = books.estimated_save_seconds(model_bytes)
        self.run_id = self.run_id or (sessions[-1].get("run_id") if sessions else None)
        env = SessionEnvironment.read()
        seen = hardware.observe(env)
        self.record = books.open_record(sessions, self.run_id, self.clock, step, self.world.size, **seen, **record)
        self._sessions, self._current_step = sessions, current_step
        self._check_environment(sessions, step, hardware.accelerator_mismatch(self.machine_shape, seen["gpus"], env))
        self.lines = ProgressLines(self.record["index"], step, self.total_steps, self.clock.remaining,
                                   run_id=self.run_id)
        self.trackers.start(step, tracking_state, name=self.name, current_step=current_step)
        self.clock.alive()  # the restore is behind: the watchdog counts from here
        if self.world.main:  # the other ranks are ended by their launcher (torchrun, distributed.launch)
            self.watchdog = StallWatchdog(self.clock, self.stall_after, self._stalled).start()
        return self.record

    def _check_environment(self, sessions: list, step: int, wrong: Optional[str]) -> None:
        """Say what this session runs on; another accelerator than asked for, and another environment than
        the session before (exact resume is unproven from this step: progress.json's `exactness_lost`)."""
        r = self.record
        log.info("session %d runs on %s (%s)", r["index"], hardware.describe_gpus(r["gpus"]["names"]),
                 runtime.describe(r))
        if wrong:
            r["accelerator"] = wrong
            self.wrong_accelerator = self.on_other_accelerator == "stop"
            log.warning("accelerator: %s: %s", wrong, "stopping at once to save quota (kaggle.on_other_accelerator:"
                        " stop)" if self.wrong_accelerator else "training on at the speed it measures"
                        " (kaggle.on_other_accelerator: continue)")
        changed = runtime.changes(sessions[-2], r) if len(sessions) > 1 else []
        if changed:
            why = f"session {r['index']} ran on another environment than session {sessions[-2].get('index')}:" \
                  f" {', '.join(changed)}"
            log.warning("%s: exact resume is unproven from step %d", why, step)
            self.environment_changed = {"step": step, "why": why}

    # -- during -----------------------------------------------------------------------------------------
    def stop_reason(self, step: int, diverged: Optional[str], eval_due: bool = False) -> Optional[str]:
        """This process's answer to "stop before the next step?" ("done", "wrong_accelerator", "diverged", the
        clock's "budget", "steps" or "sigterm"), or None; with several processes the caller agrees on it with the
        others (but for books.RANK_INDEPENDENT)."""
        if step >= self.total_steps:
            return "done"
        if self.wrong_accelerator:
            return "wrong_accelerator"
        return "diverged" if diverged else self.clock.should_stop(eval_due=eval_due)

    def log(self, record: dict, shown: Optional[dict] = None) -> None:
        """One metrics.jsonl line (appended and flushed: a kill loses at most that line), then its progress
        line and the trackers; `shown` (samples/s, lr) goes to those two only."""
        record = {"session": self.record.get("index"), "time": round(time.time(), 3), **record}
        if record.get("kind") == "train":
            self.record["loss_end"] = record.get("loss")
        if not self.world.main:
            return
        if self._metrics is None:  # held open: a line is one write, not an open, append and close (a log step's I/O)
            self._metrics = open(self.metrics_path, "a", buffering=1)  # line-buffered: each line is written whole
        self._metrics.write(json.dumps(record) + "\n")
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
        self.clock.alive()
        if not self.world.main:
            distributed.barrier(self.world)
            return None
        self.trackers.flush()  # what this checkpoint covers is on disk before it commits

        def committed(ckpt: checkpoint.Checkpoint) -> None:
            self.clock.alive()
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
        # what training waited for, measured (a background commit runs on beside it): the goodput ledger's
        # "saving" (relay/orchestrator/goodput.py), summed over the session's saves. This save's own wait lands
        # in the record after its state was packed, so a checkpoint's record counts the saves before it.
        self.record["saving_s"] = round(self.record.get("saving_s", 0.0) + time.perf_counter() - t0, 3)
        self.record["saves"] = self.record.get("saves", 0) + 1
        distributed.barrier(self.world)
        return ckpt

    # -- end --------------------------------------------------------------------------------------------
    def write_progress(self, ckpt: checkpoint.Checkpoint, status: str, reason: str, progress: books.RunFields,
                       weights: Optional[str] = None) -> dict:
        with self._books:
            if not self._ended:
                self._written = books.write_progress(self.workdir, ckpt, progress, status=status, reason=reason,
                                                     run_id=self.run_id, name=self.name, total=self.total_steps,
                                                     weights=weights)
            return self._written

    def finish(self, status: str, reason: str, progress: books.RunFields, weights: Optional[str]) -> dict:
        """Rank 0 after the last save (and the export): progress.json and the session's last progress line."""
        self.writer.wait_for_deletions()
        result = self.write_progress(checkpoint.list_valid(self.ckpt_root)[0], status, reason, progress, weights)
        if self.lines is not None:
            why = {"diverged": self.record.get("diverged"), "wrong_accelerator": self.record.get("accelerator")}
            self.lines.end(progress.step, result["status"], reason, why=why.get(reason))
        return result

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        self.trackers.close()
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None

    # -- stalled ----------------------------------------------------------------------------------------
    def _stalled(self, idle: float) -> None:
        """The watchdog's last act, on its own thread (the stuck one never comes back): where every thread
        hangs, the session's record and progress.json saying "stalled at step N after M" (atomically; the
        newest checkpoint stays what it is), the last progress line the relay reads, and exit STALLED_EXIT.
        Nothing here waits on what may hang (trackers, a collective); progress.json's lock for a few seconds."""
        step = self._current_step()
        why = f"stalled at step {step} after {format_duration(max(1, round(idle)))}"
        limit = format_duration(round(stall_limit(self.stall_after, self.clock), 1))
        setting = f"auto, {limit} now" if self.stall_after == "auto" else limit
        print(f"relay: session {self.record['index']} {why} without progress (session.stall_after: {setting});"
              " where each thread was:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        locked = self._books.acquire(timeout=10)  # a commit mid-write of progress.json finishes it first
        try:
            self._ended = True
            self.record.update(stop_reason="stalled", stalled=why, ended=time.time(),
                               seconds=round(self.clock.elapsed(), 3), step_end=step)
            newest = checkpoint.list_valid(self.ckpt_root)
            books.write_stalled(self.workdir, self._written, self.record, newest[0] if newest else self._restored,
                                run_id=self.run_id, name=self.name, total=self.total_steps, sessions=self._sessions)
        finally:
            if locked:
                self._books.release()
        print(f"relay: {why}; the last checkpoint stands; exit status {STALLED_EXIT}", flush=True)
        if self.lines is not None:
            self.lines.end(step, "paused", "stalled", why=why)
        sys.stdout.flush()
        os._exit(STALLED_EXIT)
