"""The Session API: a plain PyTorch loop relayed across quota-sized sessions with exact resume.

    session = relay.open_session(total_steps=1000)        # what the relay passes, or local defaults
    session.register(model=model, optimizer=opt, scheduler=sched)
    session.restore()                                     # newest VALID checkpoint + RNG; returns the step
    for idx in session.batches(len(dataset), batch_size=32):   # step-derived order, until should_stop()
        loss = train_step([dataset[i] for i in idx])
        session.step_done(loss=loss)                      # step time, metrics.jsonl, periodic insurance save
    session.close()                                       # final save, progress.json (done or paused)

Under `relay train` (locally or in a Kaggle kernel) the session reads its settings from the RELAY_SESSION
environment variable (relay.usercode.session_config); run by hand it trains in ./relay-run with no deadline,
so the same script runs on a laptop, in the emulator and on Kaggle. A SIGTERM only sets a flag; the save
happens at the next step boundary (never inside the handler: Lightning #21406). The stop is decided from
the measured step and save times (relay.session.budget.SessionClock), not a fixed lead.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from relay.errors import InputError
from relay.session import atomic, checkpoint, data
from relay.session.budget import SessionClock
from relay.session.loop import rng_state, set_rng_state
from relay.session.run import seed_everything
from relay.version import code_version

log = logging.getLogger(__name__)

ENV = "RELAY_SESSION"
_opened: list["Session"] = []


def sessions_opened() -> int:
    return len(_opened)


def close_open_sessions() -> None:
    for s in _opened:
        if not s.closed:
            log.warning("the script did not call session.close(); closing it now")
            s.close()


def open_session(total_steps: Optional[int] = None, *, workdir: Optional[str] = None, seed: int = 0,
                 log_every: int = 10, save_every: float = 1800.0, **overrides) -> "Session":
    """A session from what the relay passes (env RELAY_SESSION), else from these arguments.
    Under the relay the spec's values win (optim.max_steps is the run's total_steps, `seed` the spec's).
    Seeds python, numpy and torch from `seed`: build the model after this call."""
    config = {"workdir": workdir or "relay-run", "total_steps": total_steps, "seed": seed,
              "log_every": log_every, "save_every": save_every, "safety_margin": 60.0, "keep_last": 2,
              "disk_budget_gb": 20.0, "digest": "crc32", "resume_from": [], "features": [], **overrides}
    if os.environ.get(ENV):
        relayed = {k: v for k, v in json.loads(os.environ[ENV]).items() if v is not None}
        if total_steps is not None and relayed.get("total_steps") not in (None, total_steps):
            log.warning("open_session(total_steps=%d): the spec's optim.max_steps (%d) wins",
                        total_steps, relayed["total_steps"])
        config.update(relayed)
    if not config.get("total_steps"):
        raise InputError("relay.open_session: total_steps is unknown: pass open_session(total_steps=N)"
                         " or set optim.max_steps in the spec")
    session = Session(config)
    seed_everything(int(config["seed"]))  # a fresh run is reproducible; restore() replaces all three RNGs
    _opened.append(session)
    return session


class Session:
    def __init__(self, config: dict):
        self.config = config
        self.workdir = Path(config["workdir"])
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.total_steps = int(config["total_steps"])
        self.run_id = config.get("run_id")
        self.data_dir = Path(config["data"]) if config.get("data") else None
        self.feature_dirs = [Path(p) for p in config.get("features", [])]
        if config.get("threads"):
            torch.set_num_threads(int(config["threads"]))
        self.clock = SessionClock(config.get("budget"), config.get("deadline"), float(config["safety_margin"]),
                                  max_steps=config.get("max_steps"))
        self.clock.install_signal_handlers()
        self.objects: dict[str, Any] = {}
        self.weights_model: Optional[torch.nn.Module] = None  # whose weights_sha256/export (default: registered)
        self.step = 0
        self.stop_reason: Optional[str] = None
        self.closed = False
        self._book = {"sessions": [], "best": None, "last_eval": {}}
        self._record: dict = {}
        self._losses: list = []
        self._mark = time.perf_counter()
        self._last_save = time.monotonic()
        self._saved_step: Optional[int] = None
        self._schedule: Optional[data.StepSchedule] = None
        self._session_samples = 0
        self._train_seconds = 0.0
        self._metrics = self.workdir / "metrics.jsonl"

    # -- state ------------------------------------------------------------------------------------------
    def register(self, **objects: Any) -> None:
        """Objects saved and restored by name: anything with state_dict() / load_state_dict()."""
        for name, obj in objects.items():
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise TypeError(f"session.register({name}=...): {type(obj).__name__} has no state_dict/load_state_dict")
            self.objects[name] = obj

    def restore(self) -> int:
        """Load the newest valid checkpoint (own workdir, then the relay's resume folders) into the registered
        objects and the RNGs; start this session's record. Returns the step to continue from (0 when fresh)."""
        restored = checkpoint.load_latest(self.workdir / "checkpoints", *map(Path, self.config["resume_from"]))
        self._carry_metrics()
        if restored:
            ckpt, state = restored
            saved, here = set(state["objects"]), set(self.objects)
            if saved != here:  # lesson 6 of the anchors: say what changed rather than resume half a state
                raise InputError(f"{ckpt.path}: holds {sorted(saved)} but the script registered {sorted(here)}")
            for name, obj in self.objects.items():
                saved_state = state["objects"][name]
                if not (isinstance(saved_state, dict) and not saved_state):  # a disabled GradScaler saves {}
                    obj.load_state_dict(saved_state)  # and refuses to load it
            set_rng_state(state["rng"], self._device())
            self._book = dict(state["relay"])
            self.step = self._saved_step = int(self._book["global_step"])
            if self._book.get("threads") not in (None, torch.get_num_threads()):
                log.warning("resuming with %d threads, saved with %s: results will not be bit-identical",
                            torch.get_num_threads(), self._book.get("threads"))
            log.info("resumed from %s (step %d)", ckpt.path, self.step)
            del restored, state
        model_bytes = sum(p.nbytes for o in self.objects.values() if isinstance(o, torch.nn.Module)
                          for p in o.parameters())
        self.clock.estimated_save_seconds = 0.2 + 3 * model_bytes / 200e6  # until a save is measured
        sessions = self._book["sessions"]
        self.run_id = self.run_id or (sessions[-1].get("run_id") if sessions else None)
        self._record = {"index": len(sessions) + 1, "run_id": self.run_id, "started": self.clock.started,
                        "step_start": self.step, "stop_reason": "running"}
        sessions.append(self._record)
        self._mark = time.perf_counter()
        return self.step

    # -- data -------------------------------------------------------------------------------------------
    def batch_indices(self, n_samples: int, batch_size: int, seed: Optional[int] = None) -> list[int]:
        """The sample indices of the current step: epoch e is a permutation seeded by (seed, e), so any step's
        batch costs one permutation (O(1) in the step), never a replay of the batches before it."""
        seed = self.config["seed"] if seed is None else seed
        s = self._schedule
        if s is None or (s.n_samples, s.effective_batch, s.seed) != (n_samples, batch_size, seed):
            self._schedule = s = data.StepSchedule(n_samples, batch_size, seed)
        return s.indices(self.step)

    def batches(self, n_samples: int, batch_size: int, seed: Optional[int] = None) -> Iterator[list[int]]:
        """The current step's indices, until should_stop(); call step_done() after each."""
        while not self.should_stop():
            yield self.batch_indices(n_samples, batch_size, seed)

    def batch_sampler(self, n_samples: int, batch_size: int, seed: Optional[int] = None) -> "RunBatchSampler":
        """A DataLoader batch_sampler for trainers that own the loop (Lightning): each iteration starts at the
        session's current step, in the same step-derived order as batches(); its length is the whole run, so
        a trainer that resumes mid-"epoch" counts the remaining batches right and never starts a second pass."""
        self.batch_indices(n_samples, batch_size, seed)  # builds the schedule
        return RunBatchSampler(self, self._schedule)

    @property
    def epoch(self) -> int:
        return self._schedule.epoch_of(self.step) if self._schedule else 0

    # -- the loop ---------------------------------------------------------------------------------------
    def should_stop(self) -> bool:
        """True when the work is done, the session's step cap is reached, a SIGTERM came, or one more step
        plus the final save would not fit before the deadline."""
        if self.step >= self.total_steps:
            self.stop_reason = "done"
        else:
            self.stop_reason = self.clock.should_stop()
        return self.stop_reason is not None

    def step_done(self, loss: Any = None, *, save: bool = True, **metrics: float) -> None:
        """Count one optimizer step: its time (from the previous step_done, data loading included),
        its loss into metrics.jsonl every `log_every` steps, and a periodic insurance save."""
        now = time.perf_counter()
        self.clock.record_step(now - self._mark)
        self._train_seconds += now - self._mark
        self.step += 1
        if self._schedule is not None:
            self._session_samples += self._schedule.effective_batch
        if loss is not None:
            self._losses.append(loss)
        if (self._losses or metrics) and (self.step % int(self.config["log_every"]) == 0
                                          or self.step == self.total_steps):
            losses = [float(x) for x in self._losses]
            self._losses.clear()
            self.log("train", loss=sum(losses) / len(losses) if losses else None, **metrics)
        if save and self.insurance_due():
            self.save("periodic")
        self._mark = time.perf_counter()

    def insurance_due(self) -> bool:
        """A periodic save is due (session.save_every since the last one): insurance against a SIGKILL."""
        return time.monotonic() - self._last_save >= float(self.config["save_every"])

    def log(self, kind: str = "train", **values: Any) -> None:
        """One metrics.jsonl record at the current step; `kind="eval"` records become progress metrics."""
        record = {"session": self._record.get("index"), "time": round(time.time(), 3), "kind": kind,
                  "step": self.step, "epoch": self.epoch, **values}
        if kind == "train":
            self._record["loss_end"] = values.get("loss")
        elif kind == "eval":
            self._book["last_eval"] = {"step": self.step, **values}
        with open(self._metrics, "a") as f:
            f.write(json.dumps(record) + "\n")

    # -- saving -----------------------------------------------------------------------------------------
    def save(self, reason: str = "manual") -> checkpoint.Checkpoint:
        """An atomic checkpoint of the registered objects, the RNGs and the relay's bookkeeping."""
        t0 = time.perf_counter()
        self._update_record(reason)
        self._book.update(global_step=self.step, threads=torch.get_num_threads())
        state = {"objects": {n: o.state_dict() for n, o in self.objects.items()},
                 "rng": rng_state(self._device()), "relay": self._book}
        c = self.config
        ckpt = checkpoint.save(self.workdir / "checkpoints", state, step=self.step,
                               meta={"run_id": self.run_id, "code_version": code_version(), "reason": reason,
                                     "epoch": self.epoch, "best": self._book.get("best")},
                               disk_budget_bytes=int(float(c["disk_budget_gb"]) * 1e9),
                               keep_last=int(c["keep_last"]), digest=c["digest"])
        seconds = time.perf_counter() - t0
        self.clock.record_save(seconds)
        self._record["save_seconds"] = round(seconds, 3)
        self._last_save, self._saved_step = time.monotonic(), self.step
        self._write_progress(ckpt, "paused", reason)
        return ckpt

    def close(self) -> dict:
        """Final save (unless this step is saved already), export when done, progress.json. Returns it."""
        if self.closed:
            return json.loads((self.workdir / "progress.json").read_text())
        try:
            reason = self.stop_reason or ("done" if self.step >= self.total_steps else "stopped")
            if not self._record:
                raise InputError("session.close() before session.restore(): call restore() once after register()")
            if self._saved_step != self.step or not checkpoint.list_valid(self.workdir / "checkpoints"):
                self.save(reason)
            else:
                self._update_record(reason)
            done = self.step >= self.total_steps
            model = self._model()
            weights = checkpoint.weights_sha256(model.state_dict()) if model is not None else None
            if done and model is not None:
                checkpoint.export_atomic(self.workdir / "export", lambda out: _export(model, out))
            checkpoint.wait_for_deletions()
            return self._write_progress(checkpoint.list_valid(self.workdir / "checkpoints")[0],
                                        "done" if done else "paused", reason, weights)
        finally:
            self.closed = True
            self.clock.restore_signal_handlers()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # mid-step state is not worth saving; the last checkpoint stands
            self.closed = True
            self.clock.restore_signal_handlers()

    # -- helpers ----------------------------------------------------------------------------------------
    def _model(self) -> Optional[torch.nn.Module]:
        if self.weights_model is not None:
            return self.weights_model
        if isinstance(self.objects.get("model"), torch.nn.Module):
            return self.objects["model"]
        return next((o for o in self.objects.values() if isinstance(o, torch.nn.Module)), None)

    def _device(self) -> torch.device:
        model = self._model()
        p = next(model.parameters(), None) if model is not None else None
        return p.device if p is not None else torch.device("cpu")

    def _carry_metrics(self) -> None:
        """A fresh kernel workdir starts with the run's metrics so far (the loss curve spans all sessions)."""
        if self._metrics.exists():
            return
        for source in self.config["resume_from"]:
            if (Path(source) / "metrics.jsonl").is_file():
                shutil.copyfile(Path(source) / "metrics.jsonl", self._metrics)
                return

    def _update_record(self, reason: str) -> None:
        self._record.update(
            ended=time.time(), seconds=round(self.clock.elapsed(), 3), step_end=self.step,
            samples_per_s=round(self._session_samples / max(1e-9, self._train_seconds), 2),
            stop_reason=reason if reason in ("budget", "steps", "sigterm", "done") else "running",
            save_seconds=self._record.get("save_seconds", round(self.clock.save_seconds or 0.0, 3)))

    def _write_progress(self, ckpt, status: str, reason: str, weights: Optional[str] = None) -> dict:
        """progress.json in the format relay.session.run writes, so tables, plots and handoff work unchanged."""
        sessions = self._book["sessions"]
        progress = {
            "status": status, "stop_reason": reason, "run_id": self.run_id, "name": self.config.get("name"),
            "code_version": code_version(), "global_step": self.step, "total_steps": self.total_steps,
            "epoch": self.epoch,
            "steps_per_epoch": self._schedule.steps_per_epoch if self._schedule else None,
            "metrics": self._book.get("last_eval") or {}, "best": self._book.get("best"),
            "micro_batch": self._schedule.effective_batch if self._schedule else None, "grad_accum": 1,
            "precision": None,
            "checkpoint": (str(ckpt.path.relative_to(self.workdir)) if ckpt.path.is_relative_to(self.workdir)
                           else str(ckpt.path)),
            "weights_sha256": weights, "sessions": sessions,
            "total_seconds": round(sum(s.get("seconds", 0.0) for s in sessions), 3),
        }
        atomic.write_json(self.workdir / "progress.json", progress)
        return progress


class RunBatchSampler(torch.utils.data.Sampler):
    def __init__(self, session: Session, schedule: data.StepSchedule):
        self.session, self.schedule = session, schedule

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.session.step, self.session.total_steps):
            yield self.schedule.indices(step)

    def __len__(self) -> int:
        return self.session.total_steps


def _export(model: torch.nn.Module, out: Path) -> None:
    from safetensors.torch import save_model

    save_model(model, str(out / "model.safetensors"))
