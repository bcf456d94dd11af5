"""One session: restore the newest valid checkpoint, train until the deadline or the end, save, report.

This is what `relay train` runs, locally or inside a Kaggle kernel. It writes into the workdir:
checkpoints/, metrics.jsonl, progress.json and, when the work is done, export/ (weights only).
"""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from relay import recipes
from relay.session import atomic, checkpoint, data, memory
from relay.session.budget import SessionClock
from relay.session.loop import Trainer, TrainState, resolve_precision
from relay.spec import RunSpec
from relay.version import code_version

log = logging.getLogger(__name__)


def pick_device() -> torch.device:
    return torch.device(os.environ.get("RELAY_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu"))


def configure_backends(spec: RunSpec, device: torch.device) -> None:
    if spec.session.threads:
        torch.set_num_threads(spec.session.threads)
    if device.type == "cuda":
        # One TF32 API only: mixing it with fp32_precision makes later reads raise (torch-offline.md).
        torch.backends.cuda.matmul.allow_tf32 = spec.optim.tf32
        torch.backends.cudnn.allow_tf32 = spec.optim.tf32
        torch.backends.cudnn.benchmark = True


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class MetricsLog:
    """metrics.jsonl: one line per record, appended and flushed so a kill loses at most one line."""

    def __init__(self, path: Path, session: int):
        self.path, self.session = path, session
        self.last_train_loss: Optional[float] = None

    def __call__(self, record: dict) -> None:
        record = {"session": self.session, "time": round(time.time(), 3), **record}
        if record.get("kind") == "train":
            self.last_train_loss = record.get("loss")
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def run_session(
    spec: RunSpec,
    workdir: Path,
    *,
    budget: Optional[float] = None,
    deadline: Optional[float] = None,
    resume_from: Sequence[Path] = (),
    data_dir: Optional[Path] = None,
    feature_dirs: Sequence[Path] = (),
    run_id: Optional[str] = None,
) -> dict:
    """Run one session and return its progress dict (also written to workdir/progress.json)."""
    # start-up counts against the budget
    clock = SessionClock(budget, deadline, spec.session.safety_margin, max_steps=spec.session.max_steps)
    clock.install_signal_handlers()
    try:
        return _run(spec, Path(workdir), clock, resume_from, data_dir, feature_dirs, run_id)
    finally:
        clock.restore_signal_handlers()


def _besides(workdir: Path, ckpt_root: Path, model, reason: str) -> int:
    """What shares the output's disk budget with the checkpoints: the cache and export already there, and
    at the final save of a finished run the export about to be written (about the weights' size)."""
    used = checkpoint.bytes_besides(workdir, ckpt_root)
    if reason == "done":
        used += sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return used


def _run(spec, workdir, clock, resume_from, data_dir, feature_dirs, run_id) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    ckpt_root = workdir / "checkpoints"
    device = pick_device()
    configure_backends(spec, device)

    params = spec.recipe_params()
    if data_dir is None and hasattr(params, "data_dir"):
        data_dir = Path(params.data_dir)
    recipe = recipes.get(spec.recipe)(params, data_dir=Path(data_dir or "."),
                                      cache_dirs=[workdir / "cache", *feature_dirs], seed=spec.seed)
    recipe.prepare()

    seed_everything(spec.seed)
    model = recipe.build_model()
    if spec.optim.activation_checkpointing and not recipe.enable_activation_checkpointing(model):
        log.warning("optim.activation_checkpointing: recipe %s has no checkpointable modules", spec.recipe)
    model.to(device)
    # Until a save is measured: model + AdamW's two moments at a pessimistic 200 MB/s.
    clock.estimated_save_seconds = 0.2 + 3 * sum(p.nbytes for p in model.parameters()) / 200e6

    restored = checkpoint.load_latest(ckpt_root, *resume_from)
    _carry_metrics(workdir, resume_from)
    if restored:
        state = TrainState.from_dict(restored[1]["trainer"])
        log.info("resuming from %s (step %d)", restored[0].path, state.global_step)
        if state.threads != torch.get_num_threads():
            log.warning("resuming with %d threads, saved with %d: results will not be bit-identical",
                        torch.get_num_threads(), state.threads)
    else:
        state = TrainState(micro_batch=spec.optim.micro_batch, grad_accum=spec.optim.grad_accum,
                           precision=resolve_precision(spec.optim.precision, device))
    state.threads = torch.get_num_threads()

    train_len = len(recipe.train_dataset())
    schedule = data.StepSchedule(train_len, spec.optim.micro_batch * spec.optim.grad_accum, spec.seed)
    total = data.total_steps(schedule, spec.optim.epochs, spec.optim.max_steps)
    metrics_log = MetricsLog(workdir / "metrics.jsonl", session=len(state.sessions) + 1)
    run_id = run_id or (state.sessions[-1].get("run_id") if state.sessions else None)

    session = {"index": len(state.sessions) + 1, "run_id": run_id, "started": clock.started,
               "step_start": state.global_step, "stop_reason": "running"}
    state.sessions.append(session)

    def save(reason: str) -> None:
        t0 = time.perf_counter()
        _update_session(session, trainer, clock, metrics_log, reason)
        ckpt = checkpoint.save(
            ckpt_root, trainer.state_dict(), step=state.global_step,
            meta={"run_id": run_id, "code_version": code_version(), "reason": reason,
                  "epoch": schedule.epoch_of(max(0, state.global_step - 1)), "best": state.best},
            disk_budget_bytes=int(spec.checkpoints.disk_budget_gb * 1e9), keep_last=spec.checkpoints.keep_last,
            keep_best_mode=recipe.metric_mode if spec.checkpoints.keep_best else None,
            digest=spec.checkpoints.digest, besides_bytes=_besides(workdir, ckpt_root, model, reason))
        session["save_seconds"] = round(time.perf_counter() - t0, 3)
        _write_progress(workdir, spec, state, total, schedule, ckpt, status="paused", reason=reason,
                        run_id=run_id)

    trainer = Trainer(spec, recipe, model, device, clock, state, total_steps=total, schedule=schedule,
                      log_metrics=metrics_log, save=save)
    if restored:
        trainer.load_state_dict(restored[1])
        del restored  # free the loaded copy before training (seed 002's "load to CPU, then del")
    log.info("session %d on %s: step %d of %d, micro-batch %d x %d, %s, budget %s", session["index"],
             memory.describe_device(device), state.global_step, total, state.micro_batch, state.grad_accum,
             state.precision, "none" if clock.limit == float("inf") else f"{clock.limit:.0f}s")

    trainer.preflight()
    reason = trainer.fit()
    trainer.save(reason)
    status = "done" if reason == "done" else "paused"
    weights = checkpoint.weights_sha256(model.state_dict())
    if status == "done":
        checkpoint.export_atomic(workdir / "export", lambda out: recipe.export(model, out))
        recipe.predict(model, workdir / "export")
    checkpoint.wait_for_deletions()
    return _write_progress(workdir, spec, state, total, schedule, checkpoint.list_valid(ckpt_root)[0],
                           status=status, reason=reason, run_id=run_id, weights=weights)


def _carry_metrics(workdir: Path, resume_from: Sequence[Path]) -> None:
    """A fresh kernel workdir starts with the metrics of the sessions before it, so the published
    metrics.jsonl always covers the whole run (the loss curve across sessions is drawn from it)."""
    target = workdir / "metrics.jsonl"
    if target.exists():
        return
    for source in resume_from:
        if (Path(source) / "metrics.jsonl").is_file():
            shutil.copyfile(Path(source) / "metrics.jsonl", target)
            return


def _update_session(session: dict, trainer: Trainer, clock: SessionClock, metrics_log: MetricsLog,
                    reason: str) -> None:
    session.update(
        ended=time.time(), seconds=round(clock.elapsed(), 3), step_end=trainer.state.global_step,
        samples_per_s=round(trainer.session_samples / max(1e-9, trainer.train_seconds), 2),
        peak_mem_mb=round(trainer.monitor.peak_mb() or trainer.monitor.sample()["rss_mb"], 1),
        loss_end=metrics_log.last_train_loss,
        stop_reason=reason if reason in ("budget", "steps", "sigterm", "done") else "running",
        # this save's own time is known only after it; the checkpoint carries the last measured one
        save_seconds=session.get("save_seconds", round(clock.save_seconds or 0.0, 3)),
    )


def _write_progress(workdir: Path, spec: RunSpec, state: TrainState, total: int, schedule, ckpt, *,
                    status: str, reason: str, run_id: Optional[str], weights: Optional[str] = None) -> dict:
    progress = {
        "status": status,
        "stop_reason": reason,
        "run_id": run_id,
        "name": spec.name,
        "code_version": code_version(),
        "global_step": state.global_step,
        "total_steps": total,
        "epoch": schedule.epoch_of(max(0, state.global_step - 1)),
        "steps_per_epoch": schedule.steps_per_epoch,
        "metrics": state.last_eval,
        "best": state.best,
        "micro_batch": state.micro_batch,
        "grad_accum": state.grad_accum,
        "precision": state.precision,
        "checkpoint": str(ckpt.path.relative_to(workdir)) if ckpt.path.is_relative_to(workdir) else str(ckpt.path),
        "weights_sha256": weights,
        "sessions": state.sessions,
        "total_seconds": round(sum(s.get("seconds", 0.0) for s in state.sessions), 3),
    }
    atomic.write_json(workdir / "progress.json", progress)
    return progress
