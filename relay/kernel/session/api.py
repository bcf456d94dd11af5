"""The Session API: a plain PyTorch loop relayed across quota-sized sessions with exact resume.

    session = relay.open_session(total_steps=1000)        # what the relay passes, or local defaults
    session.register(model=model, optimizer=opt, scheduler=sched)
    session.restore()                                     # newest VALID checkpoint + RNG; returns the step
    for idx in session.batches(len(dataset), batch_size=32):   # step-derived order, until should_stop()
        loss = train_step([dataset[i] for i in idx])
        session.step_done(loss=loss)                      # step time, metrics.jsonl, periodic insurance save
    session.close()                                       # final save, progress.json (done or paused)

Under `relay train` (locally or in a Kaggle kernel) the session reads its settings from the RELAY_SESSION
environment variable (relay.kernel.session.settings.SessionSettings); run by hand it trains in ./relay-run with no deadline,
so the same script runs on a laptop, in the emulator and on Kaggle. A SIGTERM only sets a flag; the save
happens at the next step boundary (never inside the handler: Lightning #21406). The stop is decided from
the measured step and save times (relay.kernel.session.budget.SessionClock), not a fixed lead.

Longer than most modules (~530 lines): the Session class is the API users read, one documented method per
thing a script does; what it writes to the workdir is session/core.py's. The built-in Trainer
(relay/kernel/trainer.py) drives it through these same calls.
"""
from __future__ import annotations

import copy
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from relay.kernel.session import api_distributed, books, checkpoint, data, distributed, rng, trace
from relay.kernel.session.api_data import SessionData
from relay.kernel.session.api_distributed import unwrap
from relay.kernel.session.budget import SessionClock
from relay.kernel.session.core import SessionCore
from relay.kernel.session.device import pick_device, seed_everything
from relay.kernel.session.settings import SessionSettings
from relay.kernel.session.stepbooks import (ClosedWindow, StepBooks,  # noqa: F401 - read_losses: its old home
                                            read_losses)

NonFiniteHook = Callable[[int, float], None]
from relay.shared import environment
from relay.shared.environment import SessionEnvironment
from relay.shared.errors import InputError

log = logging.getLogger(__name__)

ENV = environment.SESSION
_opened: list["Session"] = []


def sessions_opened() -> int:
    return len(_opened)


def close_open_sessions() -> None:
    for s in _opened:
        if not s.closed:
            log.warning("the script did not call session.close(); closing it now")
            s.close()


def open_session(total_steps: Optional[int] = None, **settings: Any) -> "Session":
    """A session from what the relay passes (env RELAY_SESSION), else from these arguments: any field of
    relay.kernel.session.settings.SessionSettings (workdir="relay-run", seed=0, log_every, save_every, ...; their
    defaults are the spec's). Under the relay the spec's values win (optim.max_steps is the run's total_steps,
    `seed` the spec's). Seeds python, numpy and torch from `seed`: build the model after this call. Under several
    processes (WORLD_SIZE > 1, set by `relay train` with session.devices: N) it joins the process group first."""
    given = {k: v for k, v in {"total_steps": total_steps, **settings}.items() if v is not None}
    relayed = {k: v for k, v in (SessionEnvironment.read().session or {}).items() if v is not None}
    if total_steps is not None and relayed.get("total_steps") not in (None, total_steps):
        log.warning("open_session(total_steps=%d): the spec's optim.max_steps (%d) wins",
                    total_steps, relayed["total_steps"])
    config = SessionSettings.from_json({**given, **relayed})
    if config.extra and not relayed:
        raise InputError(f"relay.open_session: unknown setting(s) {sorted(config.extra)}; known:"
                         f" {', '.join(sorted(SessionSettings.__dataclass_fields__))}")
    if not config.total_steps:
        raise InputError("relay.open_session: total_steps is unknown: pass open_session(total_steps=N)"
                         " or set optim.max_steps in the spec")
    world, device = api_distributed.join_world(pick_device())
    session = Session(config, world, device)
    seed_everything(config.seed)  # a fresh run is reproducible; restore() replaces all three RNGs
    _opened.append(session)
    return session


class Session(SessionData):
    def __init__(self, config: SessionSettings, world: distributed.World = distributed.SINGLE,
                 device: Optional[torch.device] = None, *, clock: Optional[SessionClock] = None,
                 schedule: Optional[data.StepSchedule] = None, on_nonfinite: Optional[NonFiniteHook] = None):
        """`clock` and `schedule` are the built-in loop's (relay.kernel.run): a clock started when the process
        did, and its step schedule; a script's session makes its own. `on_nonfinite(step, loss)`: for a loop that
        skips a step whose loss is not finite (the Trainer: its fused optimizer or GradScaler skip it on the
        device). Such a loss, when its window is read (the step after a log step; at the log step with several
        processes), is counted in the book (`skipped_steps`; `nonfinite_streak`, which a finite loss resets) and
        given to the hook with its 0-based step, where the loop acts on a streak; it stays out of the train line's
        mean and the divergence guard."""
        self.config = config
        self.world = world  # rank 0 alone writes checkpoints, metrics.jsonl, progress.json and the export
        self.device = device or pick_device()  # where this rank trains (cuda:LOCAL_RANK under several GPUs)
        self._agreement = distributed.StepAgreement(world, self.device if self.device.type == "cuda"
                                                    else torch.device("cpu"))
        self.workdir = Path(config.workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.total_steps = int(config.total_steps)
        self.data_dir = Path(config.data) if config.data else None
        self.feature_dirs = [Path(p) for p in config.features]
        if config.threads:
            torch.set_num_threads(int(config.threads))
        self._owns_clock = clock is None  # its signal handlers are then this session's to install and restore
        self.clock = clock or SessionClock(config.budget, config.deadline, float(config.safety_margin),
                                           max_steps=config.max_steps)
        if self._owns_clock:
            self.clock.install_signal_handlers()
        self.objects: dict[str, Any] = {}
        self._optimizer: Optional[torch.optim.Optimizer] = None
        self.weights_model: Optional[torch.nn.Module] = None  # whose weights_sha256/export (default: registered)
        self.export_extras: list = []  # objects with save_pretrained() exported beside it (a tokenizer)
        self.stop_reason: Optional[str] = None
        self.closed = False
        self.book = books.RunBook()  # the run's book: the step, the sessions, the last eval and best, ...
        # the loss window (device tensors read once a window), samples/s, the insurance timer, the divergence guard
        self._on_nonfinite = on_nonfinite
        self.step_books = StepBooks(self.clock, config.save_every, guard=config.stop_on_divergence,
                                    on_loss=self._count_skip if on_nonfinite else None)
        self._eval_next = False  # the next step ends with an eval: a stop decided now keeps time for it
        self._mark = time.perf_counter()
        self._saved_step: Optional[int] = None  # a save at this step holds the session's final state
        self._schedule = schedule
        # what a driver that tracks a best checkpoint sets (the built-in loop): the retention of the best
        # checkpoint and the exports counted against the disk budget; `exporter(out)` writes the final export
        self._keep_best_mode: Optional[str] = None
        self._exports = 1
        self.exporter: Optional[Callable[[Path], None]] = None
        self._trace = trace.StepTrace.from_env()  # per-step fingerprints, under `relay verify-resume` only
        # the workdir's books: checkpoints, metrics.jsonl, progress.json, trackers (started by restore())
        self.core = SessionCore(config, self.clock, world)
        self.trackers = self.core.trackers

    @property
    def step(self) -> int:
        """Optimizer steps taken in the run so far (the book's global_step)."""
        return self.book.global_step

    @step.setter
    def step(self, value: int) -> None:
        self.book.global_step = value

    @property
    def run_id(self) -> Optional[str]:
        """The relay run this session belongs to: the orchestrator's, else the one the checkpoint carries."""
        return self.core.run_id

    @property
    def tensorboard_dir(self) -> Path:
        """Where your own SummaryWriter / Lightning TensorBoardLogger writes, to be one run with the relay's."""
        return self.trackers.tensorboard_dir

    def track_writer(self, writer: Any) -> Any:
        """Your own SummaryWriter (on session.tensorboard_dir): flushed before every checkpoint commits, so a
        SIGKILL after a save loses none of the steps the checkpoint covers. Returns it."""
        self.trackers.writers.append(writer)
        return writer

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def world_size(self) -> int:
        return self.world.size

    # -- state ------------------------------------------------------------------------------------------
    def register(self, **objects: Any) -> None:
        """Objects saved and restored by name: anything with state_dict() / load_state_dict()."""
        for name, obj in objects.items():
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise TypeError(f"session.register({name}=...): {type(obj).__name__} has no state_dict/load_state_dict")
            self.objects[name] = obj
        # the first registered optimizer: its lr goes with each train line (looked up once, not at every line)
        self._optimizer = next((o for o in self.objects.values() if isinstance(o, torch.optim.Optimizer)), None)

    def restore(self) -> int:
        """Load the newest valid checkpoint (own workdir, then the relay's resume folders) into the registered
        objects and the RNGs; start this session's record. Returns the step to continue from (0 when fresh)."""
        restored = self.core.load()
        resumed = restored is not None
        if restored:
            ckpt, state = restored
            saved, here = set(state["objects"]), set(self.objects)
            if saved != here:  # say what changed rather than resume half a state
                raise InputError(f"{ckpt.path}: holds {sorted(saved)} but the script registered {sorted(here)}")
            for name, obj in self.objects.items():
                saved_state = state["objects"][name]
                if not (isinstance(saved_state, dict) and not saved_state):  # a disabled GradScaler saves {}
                    unwrap(obj).load_state_dict(saved_state)  # and refuses to load it
            self.book = books.RunBook.from_dict(state["relay"])
            # the logging window a resume cut and the guard's history: it stops, or not, at the uninterrupted
            # run's step
            self.step_books.load_state_dict(state["relay"])
            self._saved_step = self.step
            rng.restore(state, self.world, self._device(), self.config.seed, self.step)
            books.warn_if_threads_changed(self.book.threads)
            log.info("resumed from %s (step %d)", ckpt.path, self.step)
            del restored, state
        elif self.world.rank:  # the same initial weights on every rank (seeded alike), then each its own RNG
            seed_everything(distributed.rank_seed(self.config.seed, self.world.rank))
        self._check_world_size(resumed)
        model_bytes = sum(p.nbytes for o in self.objects.values() if isinstance(o, torch.nn.Module)
                          for p in o.parameters())
        self.core.open(self.book.sessions, self.step, self.book.tracking,
                       current_step=lambda: self.step, model_bytes=model_bytes)
        if self.core.environment_changed and not self.book.exactness_lost:
            self.book.exactness_lost = self.core.environment_changed
        if self._trace:
            self._trace.start(self, resumed=resumed)
        self._mark = time.perf_counter()
        return self.step

    def _check_world_size(self, resumed: bool) -> None:
        """Resumed with another number of processes: the effective batch (what batches() is given) is kept;
        progress.json says from which step the run is no longer bit-identical to an uninterrupted one."""
        if resumed:
            lost = books.world_size_change(int(self.book.world_size or 1), self.world.size, self.step)
            if lost and not self.book.exactness_lost:  # set only once lost: the book is compared
                self.book.exactness_lost = lost         # between runs by `relay verify-resume`
        self.book.world_size = self.world.size

    # -- the loop ---------------------------------------------------------------------------------------
    def should_stop(self) -> bool:
        """True when the work is done, the session's step cap is reached, a SIGTERM came, or one more step
        plus the final save would not fit before the deadline. With several processes every rank gets the
        same answer: a SIGTERM to any rank, rank 0's clock for the budget."""
        reason = self.core.stop_reason(self.book.global_step, self.step_books.diverged,  # every step: no properties
                                       eval_due=self._eval_next)
        if reason not in books.RANK_INDEPENDENT and self.world.size > 1:  # the same on every rank
            reason = self._agreed(reason).reason
        self.stop_reason = reason
        return reason is not None

    def step_done(self, loss: Any = None, *, save: bool = True, samples: Optional[int] = None,
                  phase: Optional[str] = None, started: Optional[float] = None, eval_next: bool = False,
                  measured: Optional[dict] = None, **metrics: Any) -> None:
        """Count one optimizer step: its time (from the previous step_done, data loading included),
        its loss into metrics.jsonl every `log_every` steps (with `metrics`, given at that step), and a periodic
        insurance save. `samples`: the step's batch, for samples/s, when the script does not take its batches from
        session.batches(). For a loop that does more between steps (the built-in Trainer): `save=False` leaves the
        insurance save to the loop (insurance_due(), then save("periodic"), after its own work at this step);
        `phase` names what the divergence guard compares this loss within (a stage; a new phase starts a new
        history); `started` (time.perf_counter()) is when the step began, so an eval or a save between steps is
        not counted as the step's time; `eval_next`: the next step ends with an eval, which a stop decided before
        it keeps time for (the session's longest eval so far, clock.eval_seconds); `measured`: what this process
        measured for the log step's line (samples/s, memory), written with it but not carried in a checkpoint
        with the window, as `metrics` are: the resumed run's books stay the uninterrupted run's."""
        if samples is None and self._schedule is not None:
            samples = self._schedule.effective_batch
        self._eval_next = eval_next
        self.step_books.count(time.perf_counter() - (self._mark if started is None else started), samples)
        if self._trace:
            self._trace.step_done(self, loss, sys._getframe(1))
        self.book.global_step = step = self.book.global_step + 1  # self.step, without its property's call
        if loss is not None:
            # Kept as given: a CUDA tensor is not read here (float() would make the CPU wait for the GPU every
            # step instead of queueing the next), but with its window, all at once, its copy started at a log step.
            self.step_books.add_loss(step, loss, phase)
        if self.world.size > 1:
            return self._step_done_together(save, {**metrics, **(measured or {})})
        if self.step_books.closed is not None:  # the last log step's window: its copy is done by now
            self._judge_closed_window()
        if step % self.config.log_every == 0 or step == self.total_steps:
            self.step_books.close_window(step, metrics, measured)
            if step == self.total_steps:  # no next step to judge it at
                self._judge_closed_window()
        # not at the step the session stops after: close() saves then, with what the loop runs after step_done
        # (an eval's RNG draws)
        if save and self.step_books.insurance_due() and self.step_books.insure_now(
                stopping=self.core.stop_reason(self.step, self.diverged) is not None):
            self.save("periodic")
        self._mark = time.perf_counter()

    def _judge_closed_window(self) -> None:
        """The step after a log step: the window closed there, read off the device (its copy started at the log
        step, so the host did not wait for the step it had just queued), judged by the divergence guard, and
        logged at its log step. The guard judges only here, at steps that do not depend on where sessions are cut
        (one after each multiple of log_every, the last step); a save carries the unjudged windows and the guard's
        history, so a split run stops, or not, at the uninterrupted run's step."""
        self._write_window_line(self.step_books.take_closed())

    def _write_window_line(self, window: Optional[ClosedWindow]) -> None:
        """A closed window's train line, at its log step, unless it is written already (once per window: the next
        step, a save or an explicit log, whichever comes first, writes it)."""
        if window is None or window.logged:
            return
        losses, step = self.step_books.kept(window.read()), window.at
        if losses or window.metrics:
            values = {"loss": sum(losses) / len(losses) if losses else None, **window.metrics, **window.measured}
            self.core.log({"kind": "train", "step": step, "epoch": self._schedule.epoch_of(step) if self._schedule
                           else 0, **values}, shown=self._train_extras(self.step_books.samples_per_s()))
        window.logged = True

    def _step_done_together(self, save: bool, metrics: dict) -> None:
        """step_done's logging and insurance save, agreed by every rank in one all-reduce."""
        if self.step_books.closed is not None:  # closed by one process before a resume with several: logged only
            self._write_window_line(self.step_books.take_closed(judge=False))
        log_due = self.step % self.config.log_every == 0 or self.step == self.total_steps
        clock_reason = None if self.step >= self.total_steps else self.clock.should_stop(eval_due=self._eval_next)
        insure = self.step < self.total_steps and self.step_books.insurance_due()  # at a stop: close() saves
        _, save_now, mean = self._agreement.decide(self.step, clock_reason, insure,
                                                   self.step_books.end_window(judge=False) if log_due else None)
        if log_due:
            if mean is not None or metrics:
                self.log("train", loss=mean, **metrics)
        if save and save_now:
            self.save("periodic")
        self._mark = time.perf_counter()

    def _agreed(self, reason: Optional[str]) -> distributed.StepAgreement:
        """Several processes: the agreement at this step (made by step_done, else now from `reason`)."""
        if self._agreement.step != self.step:
            self._agreement.decide(self.step, reason, self.step < self.total_steps
                                   and self.step_books.insurance_due())
        return self._agreement

    def _count_skip(self, step: int, loss: float) -> None:
        """A loss judged, for a loop that skips a step whose loss is not finite: the book's count of skips."""
        if math.isfinite(loss):
            self.book.nonfinite_streak = 0
            return
        self.book.nonfinite_streak += 1
        self.book.skipped_steps += 1
        self._on_nonfinite(step - 1, loss)  # the window holds the step count after it

    def heartbeat(self) -> None:
        """A sign of progress between steps, for the stall watchdog (session.stall_after): call it in a long
        phase without step_done(), such as an eval over a large set (the integrations call it per eval batch)."""
        self.clock.alive()

    def insurance_due(self) -> bool:
        """A periodic save is due (session.save_every since the last one): insurance against a SIGKILL. With
        several processes, agreed (rank 0's timer) and asked after should_stop(); not due once the session stops."""
        if self.world.size > 1:
            return self._agreed(self.stop_reason).save
        return self.step_books.insurance_due()

    def keep_best(self, metric_mode: Optional[str]) -> None:
        """For a loop that saves its best checkpoint (save("best") when its metric improved): keep that checkpoint
        apart from the newest ones (`metric_mode` "min" or "max", how the metric compares; None: none kept), and
        count the second export it makes (export/best/) against the disk budget."""
        self._keep_best_mode, self._exports = metric_mode, 1 + (metric_mode is not None)

    def note(self, **fields: Any) -> None:
        """Fields of this session's record in progress.json's `sessions` (a peak memory, a curriculum stage),
        written with the record at the next save and at close()."""
        self.core.record.update(fields)

    @property
    def samples_per_s(self) -> Optional[float]:
        """This session's training speed so far (None until a step counted its samples)."""
        return self.step_books.samples_per_s()

    @property
    def diverged(self) -> Optional[str]:
        """Why the session stopped itself on a diverging loss (session.stop_on_divergence), else None."""
        return self.step_books.diverged

    def log(self, kind: str = "train", **values: Any) -> None:
        """One metrics.jsonl record at the current step; `kind="eval"` records become progress metrics. A window
        closed at a log step and not yet written goes first: an eval after that step (its own reads waited for the
        GPU) shows its train line before its own, not after it."""
        self._write_window_line(self.step_books.closed)
        if kind == "eval":
            self.book.last_eval = {"step": self.step, **values}
        self.core.log({"kind": kind, "step": self.step, "epoch": self.epoch, **values},
                      shown=self._train_extras(self.step_books.samples_per_s()) if kind == "train" else None)

    def _train_extras(self, speed: Optional[float]) -> dict:
        """What a tracker shows beside a train record: samples/s and the first registered optimizer's lr."""
        extras = {"samples_per_s": speed} if speed else {}
        if self._optimizer is not None:
            extras["lr"] = float(self._optimizer.param_groups[0]["lr"])
        return extras

    # -- saving -----------------------------------------------------------------------------------------
    def save(self, reason: str = "manual", started: Optional[float] = None, *,
             background: bool = False) -> Optional[checkpoint.Checkpoint]:
        """An atomic checkpoint of the registered objects, the RNGs and the relay's bookkeeping. With several
        processes every rank calls it: rank 0 writes it, with every rank's RNG (`rng_ranks`), while the
        others wait at a barrier and get None. `started` (time.perf_counter()): when a trainer began writing
        its own checkpoint that this one packs; the clock plans the final save with both phases. `background`:
        the state is serialized now and committed while training goes on (None is returned)."""
        t0 = time.perf_counter() if started is None else started
        # a save reads the device anyway: a closed window's line goes before the checkpoint (a resume writes only
        # lines after its step)
        self._write_window_line(self.step_books.closed)
        self._update_record(reason)
        self.book.threads = torch.get_num_threads()
        rngs = rng.capture(self.world, self._device())
        state = None
        if self.world.main:  # the book with the window not yet logged and judged, and the guard's history
            state = {"objects": {n: unwrap(o).state_dict() for n, o in self.objects.items()},
                     "relay": {**self.book.to_dict(), **self.step_books.state_dict()}, **rngs}
        progress = self.book.run_fields(self._schedule, self.world.size)
        ckpt = self.core.save(state, reason, step=self.step, meta={"epoch": progress.epoch, "best": self.book.best},
                              # a background commit writes progress.json later: from a copy training won't change
                              progress=copy.deepcopy(progress) if background else progress, model=self._model(),
                              started=t0, background=background, keep_best_mode=self._keep_best_mode,
                              exports=self._exports)
        # only a save taken once the session decided to stop (an integration's, at its trainer's stop) holds
        # the state the next session starts from: after an insurance save the loop may still run code (an eval
        # whose DataLoader draws from the global RNG) before it asks should_stop(), and close() must save that
        self.step_books.saved()
        self._agreement.save = False  # taken: a loop asking insurance_due() again at this step is told no
        self._saved_step = self.step if self.stop_reason is not None else None
        return ckpt

    def close(self) -> dict:
        """Final save (unless a save at this step was taken once the session decided to stop, or nothing
        ran since restore()), export when done, progress.json. Returns it."""
        if self.closed:
            return json.loads((self.workdir / "progress.json").read_text())
        try:
            reason = self.stop_reason or ("done" if self.step >= self.total_steps else "stopped")
            if not self.core.record:
                raise InputError("session.close() before session.restore(): call restore() once after register()")
            unsaved = self._saved_step != self.step or not checkpoint.list_valid(self.workdir / "checkpoints")
            if distributed.broadcast(self.world, unsaved):  # rank 0's view: every rank must take part
                self.save(reason)
            else:
                self._update_record(reason)
            done = self.step >= self.total_steps
            if not self.world.main:  # rank 0 exports and writes progress.json; every rank leaves together
                distributed.barrier(self.world)
                return json.loads((self.workdir / "progress.json").read_text())
            model = self._model()
            weights = checkpoint.weights_sha256(model.state_dict()) if model is not None else None
            if done and model is not None:
                checkpoint.export_atomic(self.workdir / "export",
                                         self.exporter or (lambda out: _export(model, out, self.export_extras)))
            progress = self.core.finish("done" if done else "paused", reason,
                                        self.book.run_fields(self._schedule, self.world.size), weights)
            distributed.barrier(self.world)
            return progress
        finally:
            self._release()

    def _release(self) -> None:
        self.closed = True
        if self._owns_clock:
            self.clock.restore_signal_handlers()
        self.core.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # mid-step state is not worth saving; the last checkpoint stands
            self._release()

    # -- helpers ----------------------------------------------------------------------------------------
    def _model(self) -> Optional[torch.nn.Module]:
        if self.weights_model is not None:
            return unwrap(self.weights_model)
        if isinstance(self.objects.get("model"), torch.nn.Module):
            return unwrap(self.objects["model"])
        return next((unwrap(o) for o in self.objects.values() if isinstance(o, torch.nn.Module)), None)

    def _device(self) -> torch.device:
        model = self._model()
        p = next(model.parameters(), None) if model is not None else None
        return p.device if p is not None else torch.device("cpu")


    def _update_record(self, reason: str) -> None:
        self.core.update_record(self.step, reason, self.step_books.samples_per_s(), self.diverged)


def _export(model: torch.nn.Module, out: Path, extras: list = ()) -> None:
    """Weights only. A transformers model exports as its save_pretrained() writes it (config.json + safetensors)
    with the extras (its tokenizer or processor), so `from_pretrained(export)` loads the final model."""
    if callable(getattr(model, "save_pretrained", None)):
        model.save_pretrained(str(out), safe_serialization=True)
    else:
        from safetensors.torch import save_model

        save_model(model, str(out / "model.safetensors"))
    for extra in extras:
        extra.save_pretrained(str(out))
