"""One session: restore the newest valid checkpoint, train until the deadline or the end, save, report.

This is what `relay train` runs, locally or inside a Kaggle kernel. It writes into the workdir:
checkpoints/, metrics.jsonl, progress.json and, when the work is done, export/ (weights only).
"""
from __future__ import annotations

import copy
import inspect
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from relay.kernel import usercode
from relay.kernel.session import books, checkpoint, data, distributed, memory
from relay.kernel.session.budget import SessionClock
from relay.kernel.session.core import SessionCore
from relay.kernel.session.device import configure_backends, pick_device, seed_everything
from relay.kernel.session.loop import Trainer, TrainState, resolve_precision
from relay.kernel.session.settings import SessionSettings
from relay.shared.errors import InputError
from relay.shared.spec import RunSpec

log = logging.getLogger(__name__)


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
    """Run one session and return its progress dict (also written to workdir/progress.json). With
    `session.devices` resolving to N > 1, N processes train together (relay.kernel.session.distributed)."""
    workdir = Path(workdir)
    _check_workdir(workdir)
    args = (spec, workdir, budget, deadline, resume_from, data_dir, feature_dirs, run_id)
    fit_only = usercode.recipe_params(spec).fit_only
    world_size = distributed.world_size_for(spec.session.devices, pick_device().type, fit_only)
    if fit_only and spec.session.devices == "auto":
        log.info("recipe %s is made only of fit stages: one process, whatever session.devices: auto finds",
                 spec.recipe)
    if world_size > 1:
        started = time.time()
        distributed.launch(_rank_main, world_size, (started, *args))
        return json.loads((Path(workdir) / "progress.json").read_text())
    return _session(distributed.SINGLE, time.time(), *args)


def _rank_main(rank: int, world_size: int, port: int, errors, started: float, spec: RunSpec, *args) -> None:
    """One rank of a data-parallel session (a process of its own)."""
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s", datefmt="%H:%M:%S")
    world = distributed.init(rank, world_size, port, pick_device().type)
    try:
        _session(world, started, spec, *args)
    except InputError as err:  # reported once by the launcher, as one line
        errors.put(str(err))
    finally:
        distributed.shutdown(world)


def _session(world, started, spec, workdir, budget, deadline, resume_from, data_dir, feature_dirs, run_id) -> dict:
    # start-up counts against the budget
    clock = SessionClock(budget, deadline, spec.session.safety_margin, now=started, max_steps=spec.session.max_steps)
    clock.install_signal_handlers()
    try:
        return _run(spec, workdir, clock, resume_from, data_dir, feature_dirs, run_id, world)
    finally:
        clock.restore_signal_handlers()


def _check_workdir(workdir: Path) -> None:
    for path in (workdir, *workdir.parents):
        if path.exists():
            if not path.is_dir():
                raise InputError(f"{workdir}: {'it' if path == workdir else path} is a file;"
                                 " --workdir expects a folder (or a path that does not exist yet)")
            return


def _outermost_missing(path: Path) -> Optional[Path]:
    """The folder `path.mkdir(parents=True)` would create first, or None when path exists."""
    missing = None
    for candidate in (path, *path.parents):
        if candidate.exists():
            break
        missing = candidate
    return missing


def _run(spec, workdir, clock, resume_from, data_dir, feature_dirs, run_id, world=distributed.SINGLE) -> dict:
    """One session on this rank: prepare, restore, train until a stop, save, finish. (Longer than most
    functions, ~65 lines, because its save closure lives beside the state it snapshots.)"""
    # Nothing is written before the inputs are validated: a data error (a missing column, a file that is
    # not UTF-8) must leave no workdir behind; a later check that fails removes what this session created.
    created = _outermost_missing(workdir)
    device = pick_device()
    if device.type == "cuda" and world.size > 1:
        device = torch.device("cuda", world.rank)
    configure_backends(spec, device)
    recipe, schedule = _prepare(spec, workdir, data_dir, feature_dirs, world, created)
    workdir.mkdir(parents=True, exist_ok=True)

    seed_everything(spec.seed)
    model = recipe.build_model()  # the same initial weights on every rank
    if world.rank:
        torch.manual_seed(distributed.rank_seed(spec.seed, world.rank))  # each rank its own dropout masks
    if spec.optim.activation_checkpointing and not recipe.enable_activation_checkpointing(model):
        log.warning("optim.activation_checkpointing: recipe %s has no checkpointable modules", spec.recipe)
    model.to(device)

    total = data.total_steps(schedule, spec.optim.epochs, spec.optim.max_steps)
    settings = SessionSettings.from_spec(spec, workdir, resume_from=resume_from, data_dir=data_dir,
                                         feature_dirs=feature_dirs, run_id=run_id, total_steps=total)
    core = SessionCore(settings, clock, world)
    restored, state = _restore(core, spec, world, device, created)
    session = core.open(state.sessions, state.global_step, state.tracking, current_step=lambda: state.global_step,
                        model_bytes=sum(p.nbytes for p in model.parameters()))
    state.exactness_lost = state.exactness_lost or core.environment_changed

    def save(reason: str) -> None:
        """Periodic and best saves commit in the background while training goes on; the last is waited for."""
        t0 = time.perf_counter()
        core.update_record(state.global_step, reason, trainer.samples_per_s(), trainer.diverged,
                           peak_mem_mb=round(trainer.monitor.peak_mb() or trainer.monitor.sample()["rss_mb"], 1))
        resume_state = trainer.state_dict()  # every rank takes part (RNG is gathered); rank 0 writes
        keep_best = spec.checkpoints.keep_best and trainer.track_best  # not with several stages (Trainer)
        core.save(resume_state, reason, step=state.global_step, started=t0,
                  meta={"epoch": schedule.epoch_of(max(0, state.global_step - 1)), "best": state.best},
                  # a snapshot: training changes `state` while a background commit runs
                  progress=_progress_fields(copy.deepcopy(state), schedule), model=model,
                  background=reason in ("periodic", "best"), keep_best_mode=recipe.metric_mode if keep_best else None,
                  exports=1 + keep_best)

    trainer = Trainer(spec, recipe, model, device, clock, state, total_steps=total, schedule=schedule,
                      log_metrics=core.log, save=save, stop_reason=core.stop_reason, world=world)
    if restored:
        trainer.load_state_dict(restored[1])
        del restored  # free the loaded copy now: it would hold a second copy of the state all session long
    log.info("session %d on %s: step %d of %d, micro-batch %d x %d x %d processes, %s, budget %s",
             session["index"], memory.describe_device(device), state.global_step, total, state.micro_batch,
             state.grad_accum, world.size, state.precision,
             "none" if clock.limit == float("inf") else f"{clock.limit:.0f}s")

    if not core.wrong_accelerator:  # it stops before its first step: on a P100 the image's torch cannot even run one
        trainer.preflight()
    try:
        reason = trainer.fit()
        trainer.save(reason)
    finally:
        core.close()
    if not world.main:
        distributed.barrier(world)  # wait for rank 0's export: a rank tearing its group down early aborts
        return {}
    progress = _finish(core, spec, recipe, model, trainer, schedule, reason)
    distributed.barrier(world)  # every rank leaves together (gloo aborted a rank that shut down first)
    return progress


def _prepare(spec, workdir: Path, data_dir, feature_dirs, world, created: Optional[Path]):
    """The recipe and its step schedule. Nothing is written before the inputs are validated: prepare()
    writes only its feature cache, and only on success; a refusal removes what this session created."""
    params = usercode.recipe_params(spec)
    if data_dir is None and hasattr(params, "data_dir"):
        data_dir = Path(params.data_dir)
    recipe = usercode.recipe_class(spec.recipe)(params, data_dir=Path(data_dir or "."),
                                                cache_dirs=[workdir / "cache", *feature_dirs], seed=spec.seed)
    if not world.main:
        distributed.barrier(world)  # rank 0 fills the feature cache first; the others then read it
    try:
        recipe.prepare()
        schedule = data.StepSchedule(len(recipe.train_dataset()), spec.optim.micro_batch * spec.optim.grad_accum,
                                     spec.seed)
    except InputError:
        if created is not None and world.main:
            shutil.rmtree(created, ignore_errors=True)
        raise
    finally:
        if world.main:
            distributed.barrier(world)
    return recipe, schedule


def _restore(core: SessionCore, spec, world, device, created: Optional[Path]):
    """(the loaded checkpoint or None, the trainer's state): resumed, or fresh for this world."""
    try:
        restored = core.load()
    except InputError:  # nothing valid to resume from: leave nothing behind
        if created is not None and world.main:
            shutil.rmtree(created, ignore_errors=True)
        raise
    if restored:
        state = TrainState.from_dict(restored[1]["relay"])
        log.info("resuming from %s (step %d)", restored[0].path, state.global_step)
        books.warn_if_threads_changed(state.threads)
    else:
        micro, accum = distributed.split_batch(spec.optim.micro_batch * spec.optim.grad_accum, world.size,
                                               spec.optim.micro_batch)
        state = TrainState(micro_batch=micro, grad_accum=accum, world_size=world.size,
                           precision=resolve_precision(spec.optim.precision, device))
    state.threads = torch.get_num_threads()
    if state.world_size != world.size:
        _change_world(state, world.size)
    return restored, state


def _finish(core: SessionCore, spec, recipe, model, trainer: Trainer, schedule, reason: str) -> dict:
    """Rank 0 after the last save: the export (and export/best/) when the work is done, progress.json."""
    state, workdir, ckpt_root = trainer.state, core.workdir, core.ckpt_root
    status = "done" if reason == "done" else "paused"
    weights = checkpoint.weights_sha256(model.state_dict())
    if status == "done":
        checkpoint.export_atomic(workdir / "export", lambda out: recipe.export(model, out))
        _predict(recipe, model, workdir / "export", batch_size=spec.optim.eval_batch, autocast=trainer._autocast)
        best = _best_weights(ckpt_root, state) if spec.checkpoints.keep_best and trainer.track_best else None
        if best is not None:  # export/ stays the final weights (weights_sha256); export/best/ the best-metric ones
            model.load_state_dict(best)  # the final weights are saved and hashed above
            checkpoint.export_atomic(workdir / "export" / "best", lambda out: recipe.export(model, out))
    return core.finish(status, reason, _progress_fields(state, schedule), weights)


def _predict(recipe, model, out_dir: Path, **settings) -> None:
    """recipe.predict with the run's eval batch and autocast; a user recipe written against the older
    `predict(model, out_dir)` gets only what its signature takes (a TypeError after a long run would lose it)."""
    params = inspect.signature(recipe.predict).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        settings = {k: v for k, v in settings.items() if k in params}
    recipe.predict(model, out_dir, **settings)


def _best_weights(ckpt_root: Path, state: TrainState) -> Optional[dict]:
    """The model weights of the checkpoint that scored the run's best metric, or None when there is none (no
    eval) or the disk budget deleted it (that is logged)."""
    if not state.best:
        return None
    for ckpt in checkpoint.list_valid(ckpt_root):
        if ckpt.metric is not None and ckpt.step == state.best["step"]:
            return books.current_layout(checkpoint.load(ckpt))["objects"]["model"]
    log.warning("no export/best: the best checkpoint (step %d) was deleted to fit checkpoints.disk_budget_gb",
                state.best["step"])
    return None


def _change_world(state: TrainState, world_size: int) -> None:
    """Resumed on another number of processes: the same effective batch, split over the new world."""
    effective = state.micro_batch * state.grad_accum * state.world_size
    lost = books.world_size_change(state.world_size, world_size, state.global_step)
    state.micro_batch, state.grad_accum = distributed.split_batch(effective, world_size, state.micro_batch)
    state.world_size = world_size
    state.exactness_lost = state.exactness_lost or lost


def _progress_fields(state: TrainState, schedule: data.StepSchedule) -> books.RunFields:
    """What progress.json says of this run besides the checkpoint (SessionCore.write_progress)."""
    return books.RunFields(step=state.global_step, epoch=schedule.epoch_of(max(0, state.global_step - 1)),
                           steps_per_epoch=schedule.steps_per_epoch, metrics=state.last_eval, best=state.best,
                           micro_batch=state.micro_batch, grad_accum=state.grad_accum, precision=state.precision,
                           world_size=state.world_size, exactness_lost=state.exactness_lost,
                           tracking=state.tracking, sessions=state.sessions, memory_rungs=state.memory_rungs)
