"""One session: restore the newest valid checkpoint, train until the deadline or the end, save, report.

This is what `relay train` runs, locally or inside a Kaggle kernel. It writes into the workdir:
checkpoints/, metrics.jsonl, progress.json and, when the work is done, export/ (weights only).
"""
from __future__ import annotations

import inspect
import json
import logging
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch

from relay.kernel import usercode
from relay.kernel.trainer import Trainer
from relay.kernel.session import books, checkpoint, data, distributed, memory
from relay.kernel.session.api import Session
from relay.kernel.session.books import RunBook
from relay.kernel.session.budget import SessionClock
from relay.kernel.session.device import configure_backends, pick_device, seed_everything
from relay.kernel.session.settings import SessionSettings
from relay.shared.errors import InputError
from relay.shared.session_plan import SessionPlan
from relay.shared.spec import RunSpec

log = logging.getLogger(__name__)


def run_session(spec: RunSpec, workdir: Path, plan: Optional[SessionPlan] = None) -> dict:
    """Run one session and return its progress dict (also written to workdir/progress.json). `plan`: the session's
    plan (relay/shared/session_plan.py), read once into its settings here; None: the spec's budget, no folders.
    With `session.devices` resolving to N > 1, N processes train together (relay.kernel.session.distributed)."""
    workdir = Path(workdir)
    _check_workdir(workdir)
    settings = SessionSettings.from_spec(spec, workdir, plan)
    fit_only = usercode.recipe_params(spec).fit_only
    world_size = distributed.world_size_for(spec.session.devices, pick_device().type, fit_only)
    if fit_only and spec.session.devices == "auto":
        log.info("recipe %s is made only of fit stages: one process, whatever session.devices: auto finds",
                 spec.recipe)
    if world_size > 1:
        started = time.time()
        distributed.launch(_rank_main, world_size, (started, spec, workdir, settings))
        return json.loads((Path(workdir) / "progress.json").read_text())
    return _session(distributed.SINGLE, time.time(), spec, workdir, settings)


def _rank_main(rank: int, world_size: int, port: int, errors, started: float, spec: RunSpec, workdir: Path,
               settings: SessionSettings) -> None:
    """One rank of a data-parallel session (a process of its own)."""
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s", datefmt="%H:%M:%S",
                        force=True)  # a forked rank inherits the launcher's handlers
    world = distributed.init(rank, world_size, port, pick_device().type)
    try:
        _session(world, started, spec, workdir, settings)
    except InputError as err:  # reported once by the launcher, as one line
        errors.put(str(err))
    finally:
        distributed.shutdown(world)


def _session(world, started: float, spec: RunSpec, workdir: Path, settings: SessionSettings) -> dict:
    # the settings' budget and deadline, and start-up counts against them
    clock = SessionClock(settings.budget, settings.deadline, settings.safety_margin, now=started,
                         max_steps=settings.max_steps)
    clock.install_signal_handlers()
    try:
        return _run(spec, workdir, settings, clock, world)
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


def _run(spec, workdir: Path, settings: SessionSettings, clock: SessionClock, world=distributed.SINGLE) -> dict:
    """One session on this rank: prepare, restore, train until a stop, save, finish: the Trainer drives a Session
    as a user's loop does."""
    # Nothing is written before the inputs are validated: a data error (a missing column, a file that is
    # not UTF-8) must leave no workdir behind; a later check that fails removes what this session created.
    created = _outermost_missing(workdir)
    device = pick_device()
    if device.type == "cuda" and world.size > 1:
        device = torch.device("cuda", world.rank)
    configure_backends(spec, device)
    recipe, schedule = _prepare(spec, workdir, settings, world, created)
    workdir.mkdir(parents=True, exist_ok=True)

    seed_everything(spec.seed)
    model = recipe.build_model()  # the same initial weights on every rank (the session then seeds each its own)
    if spec.optim.activation_checkpointing and not recipe.enable_activation_checkpointing(model):
        log.warning("optim.activation_checkpointing: recipe %s has no checkpointable modules", spec.recipe)
    model.to(device)

    total = data.total_steps(schedule, spec.optim.epochs, spec.optim.max_steps)
    settings = replace(settings, total_steps=total)
    trainer = Trainer(spec, recipe, model, settings, world, device, clock, schedule)  # and its Session
    session = trainer.session
    try:
        trainer.restore()
    except InputError:  # nothing valid to resume from: leave nothing behind
        if created is not None and world.main:
            shutil.rmtree(created, ignore_errors=True)
        raise
    state = session.book
    session.exporter = _exporter(spec, recipe, model, trainer, session)
    log.info("session %d on %s: step %d of %d, micro-batch %d x %d x %d processes, %s, budget %s",
             state.sessions[-1]["index"], memory.describe_device(device), state.global_step, total, state.micro_batch,
             state.grad_accum, world.size, state.precision,
             "none" if clock.limit == float("inf") else f"{clock.limit:.0f}s")
    with session:  # an error: the last checkpoint stands, nothing more is written
        if not session.core.wrong_accelerator:  # it stops before its first step: on a P100 the image's torch cannot even run one
            trainer.preflight()
        trainer.save(trainer.fit())
        progress = session.close()  # the export when done, progress.json
    return progress if world.main else {}


def _exporter(spec, recipe, model, trainer: Trainer, session: Session):
    """What the final export holds (written into a folder committed at once): the recipe's export of the final
    weights and its predictions, and with checkpoints.keep_best, export/best/ with the best-metric weights."""

    def export(out: Path) -> None:
        recipe.export(model, out)
        _predict(recipe, model, out, batch_size=spec.optim.eval_batch, autocast=trainer._autocast)
        best = _best_weights(session.core.ckpt_root, session.book) \
            if spec.checkpoints.keep_best and trainer.track_best else None
        if best is not None:  # export/ stays the final weights (weights_sha256, hashed before); best/ the best
            model.load_state_dict(best)
            (out / "best").mkdir()
            recipe.export(model, out / "best")

    return export


def _prepare(spec, workdir: Path, settings: SessionSettings, world, created: Optional[Path]):
    """The recipe and its step schedule. Nothing is written before the inputs are validated: prepare()
    writes only its feature cache, and only on success; a refusal removes what this session created."""
    params = usercode.recipe_params(spec)
    data_dir, feature_dirs = settings.data, [Path(p) for p in settings.features]
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


def _predict(recipe, model, out_dir: Path, **settings) -> None:
    """recipe.predict with the run's eval batch and autocast; a user recipe written against the older
    `predict(model, out_dir)` gets only what its signature takes (a TypeError after a long run would lose it)."""
    params = inspect.signature(recipe.predict).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        settings = {k: v for k, v in settings.items() if k in params}
    recipe.predict(model, out_dir, **settings)


def _best_weights(ckpt_root: Path, state: RunBook) -> Optional[dict]:
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
