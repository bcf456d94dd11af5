"""The built-in training loop of one session: optimizer steps until the session says stop or the work is done.

The Trainer drives a Session (session/api.py) through its public calls, as a user's loop does (should_stop,
step_done, insurance_due, save, log): the session holds the run's book
(books.RunBook), restores and saves the model, optimizer, scheduler and scaler with the RNGs, decides when to
stop and to save, logs and exports. What changes during training is in that book or derived from
`global_step` (data position, epoch, stage, learning rate), so a checkpoint taken at any optimizer-step
boundary resumes bit-identically: the same next batch, the same states. Saves happen only at optimizer-step
boundaries, so no half-accumulated gradient is ever lost.

The Trainer adds what a recipe's training needs: the stages (session/stages.py), the step over micro-batches
with the non-finite guard, the OOM ladder, eval and the best checkpoint; the pre-flight is session/preflight.py,
the optimizer and precision session/optim.py.

It sits beside recipes/, above session/: it runs any Recipe, and the session runtime imports neither.
Longer than most modules (~440 lines): the step and the OOM ladder that retries it (the same batches, the same
dropout masks) share one step's state, the Trainer's; cut apart they would pass it back and forth.
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch
from torch import nn
from tqdm.auto import tqdm

from relay.kernel.session import data, distributed, memory, rng, stages
from relay.kernel.session.api import Session
from relay.kernel.session.books import RunBook
from relay.kernel.session.budget import SessionClock
from relay.kernel.session.optim import build_optimizer, lr_lambda, resolve_precision
from relay.kernel.session.preflight import PreFlight
from relay.kernel.session.settings import SessionSettings
from relay.kernel.session.stages import StageSlot
from relay.shared.spec import RunSpec

if TYPE_CHECKING:
    from relay.kernel.recipes.base import Recipe

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    pass


class Trainer:
    """The built-in loop, the driver of its own Session (session/api.py), as a user's loop is: the session holds
    the run's book, restores and saves the registered model, optimizer, scheduler and scaler with the RNGs, keeps
    the loss window and the divergence guard, decides when to stop and to save, logs and exports. The Trainer adds
    what a recipe's training needs: the stages, the step over micro-batches, the pre-flight and the OOM ladder, the
    non-finite skips and the fp32 fallback, eval and the best."""

    def __init__(self, spec: RunSpec, recipe: Recipe, model: nn.Module, settings: SessionSettings,
                 world: distributed.World, device: torch.device, clock: SessionClock, schedule: data.StepSchedule):
        # a non-finite loss skips its step (the fused optimizer, the GradScaler): the session counts it when it
        # reads the window, and _non_finite acts on the streak
        self.session = session = Session(settings, world, device, clock=clock, schedule=schedule,
                                         on_nonfinite=self._non_finite)
        self.spec, self.recipe, self.model = spec, recipe, model
        self.device, self.clock, self.world = session.device, session.clock, session.world
        self.total_steps, self.schedule = session.total_steps, schedule
        self.span: Optional[stages.Span] = None
        self.spans = stages.plan(recipe.stages(), self.total_steps)
        for span in self.spans:  # a stage's scaled batch larger than the training set: an error now, not mid-run
            schedule.scaled(span.stage.batch_scale, span.stage.name)
        # A best checkpoint compares one metric over the run; with several stages (models trained one after
        # another, fits) an untrained later model would be scored against a trained earlier one, so the best is
        # not tracked and keep_best does not apply: each stage's last eval is in metrics.jsonl, the export is final.
        self.track_best = len(self.spans) == 1
        session.keep_best(recipe.metric_mode if spec.checkpoints.keep_best and self.track_best else None)
        # the optimizer, its schedule and the scaler change with the stage (and the precision): registered as
        # slots that save what the stage holds, and keep a loaded state until the stage is entered (restore)
        self.slots = {name: StageSlot() for name in ("optimizer", "scheduler", "scaler")}
        session.register(model=model, **self.slots)
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.scheduler = None
        self.monitor = memory.MemoryMonitor(self.device)
        self.monitor.peaks.step_of = lambda: self.state.global_step  # a phase past the pre-flight: at which step
        self.train_set = recipe.train_dataset()
        self._batches: Optional[Iterator] = None
        self._shown: Optional[dict] = None  # what recipe.on_step last reported (e.g. the curriculum stage)
        self._noted: dict = {}  # what this session's record says of those reports ("A -> B" across a change)
        self._rungs: list[str] = []  # the memory rungs taken in this session, for its record
        self._started = 0.0  # when the current step began (time.perf_counter())

    @property
    def state(self) -> RunBook:
        return self.session.book

    def restore(self) -> None:
        """The session's restore (the newest valid checkpoint into the model, the book and the RNGs, or a fresh
        start), the batch split and precision of a fresh run or a new world size, then the stage the step is in
        with its optimizer, schedule and scaler state."""
        self.session.restore()
        st, spec = self.state, self.spec
        effective = spec.optim.micro_batch * spec.optim.grad_accum
        if st.micro_batch is None:  # a fresh run
            st.micro_batch, st.grad_accum = distributed.split_batch(effective, self.world.size, spec.optim.micro_batch)
            st.precision = resolve_precision(spec.optim.precision, self.device)
        elif st.micro_batch * st.grad_accum * self.world.size != effective:  # resumed on another number of processes
            st.micro_batch, st.grad_accum = distributed.split_batch(effective, self.world.size, st.micro_batch)
        if spec.checkpoints.keep_best and not self.track_best and st.global_step == 0:
            log.info("checkpoints.keep_best: not applied, recipe %s has %d stages (%s) whose %s do not compare",
                     spec.recipe, len(self.spans), ", ".join(sp.stage.name for sp in self.spans), self.recipe.metric)
        with rng.kept(self.device):  # the restored RNG is the step's: entering the stage draws nothing from it
            self._enter_stage(stages.at(self.spans, st.global_step))
        self._new_scaler()
        loaded = {name: slot.take() for name, slot in self.slots.items()}
        if self.optimizer is not None and loaded["optimizer"]:  # the optimizer of the stage global_step is in
            self.optimizer.load_state_dict(loaded["optimizer"])  # optimizer before scheduler
            self.scheduler.load_state_dict(loaded["scheduler"])
        if loaded["scaler"]:
            self.scaler.load_state_dict(loaded["scaler"])
        rungs = {r.name: r for r in self.recipe.memory_rungs()}
        for name in st.memory_rungs:  # an earlier session's OOM fallbacks hold for the rest of the run
            log.info("memory rung %r kept from an earlier session: %s", name, rungs[name].apply())

    # -- stages ---------------------------------------------------------------------------------
    def _enter_stage(self, span: stages.Span) -> None:
        """A stage's own optimizer and schedule over its own steps (none for a fit stage); the previous
        stage's optimizer state is dropped and cached memory returned first, so the next stage never trains beside
        the memory the last one held."""
        switching = self.span is not None
        self.span, self.optimizer, self.scheduler, self._batches = span, None, None, None
        # Stage.batch_scale: this stage's steps take k x the micro-batch from a k x larger step schedule
        self.stage_schedule = self.schedule.scaled(span.stage.batch_scale, span.stage.name)
        if switching:
            memory.free_cached(self.device)
        if not span.stage.fit:
            self.optimizer = build_optimizer(self.recipe.stage_module(self.model, span.stage), self.spec, self.device)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, lr_lambda(self.spec.optim.schedule, self.spec.optim.warmup_steps, span.length))
        self.slots["optimizer"].current, self.slots["scheduler"].current = self.optimizer, self.scheduler
        self.recipe.begin_stage(self.model, span.stage)
        self._set_phase()
        if len(self.spans) > 1:
            log.info("stage %s: steps %d-%d%s", span.stage.name, span.start, span.end,
                     " (fit)" if span.stage.fit else "")

    def _next_stage(self) -> None:
        if self.state.global_step >= self.span.end and self.state.global_step < self.total_steps:
            self._enter_stage(stages.at(self.spans, self.state.global_step))

    # -- state ----------------------------------------------------------------------------------
    def _new_scaler(self) -> torch.amp.GradScaler:
        enabled = self.state.precision == "fp16"  # only on CUDA (resolve_precision), or resumed from there
        self.scaler = self.slots["scaler"].current = torch.amp.GradScaler(self.device.type, enabled=enabled)
        return self.scaler

    # -- the loop -------------------------------------------------------------------------------
    def preflight(self) -> dict:
        """The session's worst case before its first step (session/preflight.py): backs off an OOM now, and its
        figure bounds the session's peak. Returns the memory sample after it."""
        return PreFlight(self).run()

    def fit(self) -> str:
        """Train until done or told to stop; returns "done", "budget", "steps" or "sigterm"."""
        self.model.train()
        self._memory_phase("train")
        st, session = self.state, self.session
        bar = tqdm(total=self.total_steps, initial=st.global_step, desc=f"session {st.sessions[-1]['index']}",
                   unit="step", dynamic_ncols=True, mininterval=1.0, disable=not self.world.main)
        try:
            while not session.should_stop():
                if session.insurance_due():  # before the step: after the last one's eval, stage change and best
                    self.save("periodic")
                try:
                    loss = self._step()
                except Exception as err:  # noqa: BLE001 - only OOM is handled, the rest re-raised
                    if not memory.is_oom(err):
                        raise
                    self._back_off(err)
                    continue
                self._step_done(loss)
                bar.update(1)
                if st.global_step % self.spec.optim.log_every_steps == 0:  # ~40 us: not every step
                    bar.set_postfix(left=f"{self.clock.remaining():.0f}s", refresh=False)
            return session.stop_reason
        finally:
            bar.close()

    def _step(self) -> Any:
        """One optimizer step over `grad_accum` micro-batches (or a fit stage's step). Returns the mean loss: a
        float with several processes (agreed on at every step) and in a fit stage, else a device tensor that is
        read with its window at the next log step."""
        if self.span.stage.fit:
            return self._fit_step()
        st, opt = self.state, self.optimizer
        if self._batches is None:
            self._batches = iter(self._loader(st.global_step))
        self._step_rng = self._torch_rng()  # an OOM retry replays the same dropout masks
        self._recipe_step(st.global_step)
        self._started = time.perf_counter()
        losses, oom = [], None
        try:
            for _ in range(st.grad_accum):
                batch = data.to_device(next(self._batches), self.device, self.spec.data.non_blocking)
                with self._autocast():
                    loss = self.recipe.loss(self.model, batch)
                losses.append(loss.detach())
                self.scaler.scale(loss / st.grad_accum).backward()
        except Exception as err:  # noqa: BLE001 - an OOM on one rank is agreed on below, the rest re-raised
            if not (self.world.active and memory.is_oom(err)):
                raise
            oom = err
        mean = _mean(losses) if losses else None
        if self.world.active:  # one small all-reduce: did any rank run out of memory, and the mean loss
            n_oom, loss_sum = distributed.agree(self.world, [oom is not None, 0.0 if oom else mean.item()],
                                                self.device)
            if n_oom:
                raise oom or _peer_oom()
            loss = loss_sum / self.world.size  # counted when the session reads it, at the log step
            distributed.average_gradients(self.model, self.world)
            if math.isfinite(loss):
                self._optimizer_step(opt)
        elif self._skips_on_device():
            # No host read: the fused optimizer skips a non-finite step on the device, and the skip is counted
            # when the loss is read, at the next log step. Without a GradScaler we hand it the loss's found_inf;
            # fp16's GradScaler computes its own from the gradients, which a non-finite loss is made to poison,
            # so that it skips the step and lowers its scale as it does for an overflow.
            if self.scaler.is_enabled():
                _poison_gradients(opt, mean)
                self._optimizer_step(opt)
            else:
                opt.found_inf = mean.mul(0).ne_(0)  # 1.0 if the loss is NaN or infinite (then x * 0 is NaN), else 0.0
                try:
                    self._optimizer_step(opt)
                finally:
                    del opt.found_inf
            loss = mean
        else:  # an optimizer that cannot skip a step on the device: the loss is read to decide
            loss = mean
            if math.isfinite(mean.item()):
                self._optimizer_step(opt)
        self.scheduler.step()  # per optimizer step, skipped or not: lr stays a function of the step
        opt.zero_grad(set_to_none=True)
        return loss

    def _optimizer_step(self, opt: torch.optim.Optimizer) -> None:
        if self.spec.optim.clip_grad_norm:
            self.scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.optim.clip_grad_norm)
        self.scaler.step(opt)
        self.scaler.update()

    def _skips_on_device(self) -> bool:
        """A non-finite step can be skipped without reading the loss: the optimizer takes found_inf (the fused
        AdamW this loop builds; a GradScaler then passes it its own, reading nothing)."""
        return getattr(self.optimizer, "_step_supports_amp_scaling", False)

    def _fit_step(self) -> float:
        self._started = time.perf_counter()
        with torch.no_grad():
            return float(self.recipe.fit_step(self.model, self.span.stage, self.state.global_step - self.span.start))

    def _step_done(self, loss: Any) -> None:
        """The session counts the step (one process: its loss stays on the device, read with its window; several:
        the agreed float), then the step's own end: the cache, the eval, the next stage, the best checkpoint."""
        st, spec = self.state, self.spec
        step = st.global_step + 1
        log_due = step % spec.optim.log_every_steps == 0 or step == self.total_steps
        # a stop decided with several processes is agreed in step_done, before this step's eval: keep time for it
        eval_next = self._eval_due(step + 1) or (self.world.active and self._eval_due(step))
        self.session.step_done(loss, save=False, samples=self.stage_schedule.effective_batch, phase=self._phase,
                               started=self._started, eval_next=eval_next,
                               **(self._train_fields(step) if log_due else {}))
        every = spec.session.empty_cache_every_steps
        if every and self.device.type == "cuda" and st.global_step % every == 0:
            memory.free_cached(self.device)
        improved = self._eval_due(st.global_step) and self.evaluate()
        self._next_stage()  # after the eval that scores the finished stage, before any save
        if improved and spec.checkpoints.keep_best:  # improved only while the best is tracked
            self.save("best")
            return

    def _train_fields(self, step: int) -> dict:
        """What the Trainer's train line says at log step `step` beside the window's mean loss (the session reads
        and averages the window, its finite losses): the epoch the logged steps were in, lr, samples/s, the batch
        split, the recipe's report and stage; and, `measured` (not carried in a checkpoint: they differ from run to
        run), samples/s and now and then a memory sample."""
        st = self.state
        record = {
            "epoch": self.schedule.epoch_of(max(0, step - 1)),
            "lr": self.scheduler.get_last_lr()[0] if self.scheduler else 0.0,
            "micro_batch": self._stage_micro_batch(), "grad_accum": st.grad_accum, **(self._shown or {}),
        }
        if len(self.spans) > 1:
            record["stage"] = self.span.stage.name
        measured = {"samples_per_s": self.session.samples_per_s or 0.0}
        if step % self.spec.session.memory_log_every_steps == 0:
            measured.update(self.monitor.sample())
        return {**record, "measured": measured}

    def save(self, reason: str) -> None:
        """The session's save, with the peak memory so far in its record; periodic and best saves commit in the
        background while training goes on, the last is waited for."""
        back = self._memory_phase("save")
        try:
            self.session.note(peak_mem_mb=round(self.monitor.peak_mb() or self.monitor.sample()["rss_mb"], 1))
            self.session.save(reason, background=reason in ("periodic", "best"))
        finally:
            self._memory_phase(back)

    # -- eval -----------------------------------------------------------------------------------
    def _eval_due(self, step: int) -> bool:
        every = self.spec.optim.eval_every_steps
        due = step % every == 0 if every else self.schedule.is_epoch_end(step)
        return due or step == self.total_steps or any(step == span.end for span in self.spans)

    def evaluate(self) -> bool:
        """Eval without touching the training RNG; returns whether the watched metric improved."""
        t0 = time.perf_counter()
        back = self._memory_phase("eval")
        loader = data.eval_loader(self.recipe.eval_dataset(), self.recipe.collate, self.spec.optim.eval_batch,
                                  0, False, seed=self.spec.seed)
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        while True:
            try:
                with torch.random.fork_rng(devices=devices), torch.no_grad(), self._autocast():
                    self.model.eval()
                    try:
                        batches = (data.to_device(b, self.device, self.spec.data.non_blocking)
                                   for b in self._alive(loader))
                        metrics = {k: float(v) for k, v in self.recipe.evaluate(self.model, batches).items()}
                    finally:
                        self.model.train()
                break
            except Exception as err:  # noqa: BLE001 - only OOM is handled
                if not memory.is_oom(err):
                    raise
                self._back_off(err, phase="eval")
        self._memory_phase(back)
        self.clock.eval_seconds = max(self.clock.eval_seconds, time.perf_counter() - t0)
        self.session.log("eval", **metrics)  # the book's last_eval
        metric = self.recipe.metric
        return self.track_best and self.state.score(metric, self.recipe.metric_mode, metrics.get(metric))

    # -- failure handling -----------------------------------------------------------------------
    def _non_finite(self, step: int, loss: float) -> None:
        """Step `step` (0-based) had a non-finite loss and was skipped, as the session counted when it read the
        window: `nonfinite_patience` in a row fall back to fp32, or stop a run already in fp32. The window is read
        at steps that do not depend on where sessions are cut (the step after a log step), so a split run falls
        back at the uninterrupted run's step."""
        st = self.state
        log.warning("non-finite loss %s at step %d: step skipped (%d in a row)", loss, step, st.nonfinite_streak)
        if st.nonfinite_streak < self.spec.optim.nonfinite_patience:
            return
        if st.precision == "fp32":
            raise NonFiniteLossError(
                f"loss was non-finite for {st.nonfinite_streak} steps in a row in fp32 at step {step};"
                " lower optim.lr or check the data")
        log.warning("falling back from %s to fp32 after %d non-finite losses", st.precision,
                    st.nonfinite_streak)
        st.precision, st.nonfinite_streak = "fp32", 0
        self._new_scaler()

    def _any_oom(self, err: Optional[BaseException]) -> Optional[BaseException]:
        """This rank's OOM, or a stand-in when another rank ran out: all ranks then back off together."""
        if not self.world.active:
            return err
        (n_oom,) = distributed.agree(self.world, [err is not None], self.device)
        return (err or _peer_oom()) if n_oom else None

    def _back_off(self, err: BaseException, phase: str = "train") -> None:
        """The OOM ladder: halve the micro-batch (training only) until 1, then the recipe's own rungs in order,
        skipping those that cannot help this phase. Every rung holds for the rest of the run."""
        st = self.state
        smaller = memory.back_off(st.micro_batch, st.grad_accum) if phase == "train" else None
        if smaller is not None:
            log.warning("out of memory at micro-batch %d: retrying step %d with micro-batch %d x accumulation %d",
                        st.micro_batch, st.global_step, *smaller)
            st.micro_batch, st.grad_accum = smaller
            rung, detail = "micro_batch", f"micro-batch {smaller[0]} x accumulation {smaller[1]}"
        else:
            taken = memory.next_rung(self.recipe.memory_rungs(), st.memory_rungs, phase)
            if taken is None:
                raise err
            rung, detail = taken.name, taken.apply()
            st.memory_rungs.append(rung)
            log.warning("out of memory in %s at step %d: %s (kept for the rest of the run)", phase,
                        st.global_step, detail)
        self._rungs.append(rung)
        self.session.note(memory_rungs=list(self._rungs))
        self.session.log("memory", phase=phase, rung=rung, detail=detail)
        memory.free_cached(self.device)
        if phase != "train":
            return
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        torch.default_generator.set_state(self._step_rng[0])
        if self._step_rng[1] is not None:
            self._cuda_generator().set_state(self._step_rng[1])
        self._batches = None  # rebuilt at the same step with the new micro-batch

    # -- helpers --------------------------------------------------------------------------------
    def _memory_phase(self, phase: str, fresh: bool = False) -> str:
        """Start a memory phase (memory.PeakBook: the peak per phase, the pre-flight's figure beside the session's
        peak, one line when the session passes it), copied into the session's record; returns the phase left."""
        book = self.monitor.peaks
        left = book.enter(phase, fresh=fresh, step=self.state.global_step)
        if book.active and self.state.sessions:
            profile = memory.emulated(self.device)
            self.session.note(**book.fields(), **({"emulated": profile.name} if profile else {}))
        return left

    def _recipe_step(self, step: int) -> None:
        """Let the recipe set up the step (a curriculum stage); log when what it reports changes."""
        shown = self.recipe.on_step(step, self.schedule.epoch_of(step))
        if not shown or shown == self._shown:
            return
        self._shown = dict(shown)
        self._set_phase()
        self.session.log("stage", step=step, epoch=self.schedule.epoch_of(step), **shown)
        for key, value in shown.items():  # e.g. "A" or "A -> B" for a session that crossed a stage change
            before = self._noted.get(key)
            if before not in (None, value) and not str(before).endswith(f"-> {value}"):
                value = f"{before} -> {value}"
            self._noted[key] = value
        self.session.note(**self._noted)

    def _set_phase(self) -> None:
        """The model and curriculum stage a loss belongs to (the divergence guard compares losses within one),
        derived when either changes rather than every step."""
        self._phase = f"{self.span.stage.name} {sorted((getattr(self, '_shown', None) or {}).items())}"

    def _torch_rng(self) -> tuple:
        """The generators a forward/backward draws from (dropout): ~3 us, against ~150 us for the full
        rng_state (numpy's get_state dominates), taken every step. Recipes keep numpy/python randomness
        out of loss(), deriving it from (seed, epoch, index) in their datasets. On CUDA only this session's
        device's generator, read directly (get_rng_state_all visits every device under a device guard)."""
        return torch.default_generator.get_state(), (
            self._cuda_generator().get_state() if self.device.type == "cuda" else None)

    def _cuda_generator(self) -> torch.Generator:
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]

    def _alive(self, batches: Iterator) -> Iterator:
        """The batches, each a sign of progress for the stall watchdog (a long eval is not a stall)."""
        for batch in batches:
            self.clock.alive()
            yield batch

    def _autocast(self):
        if self.state.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.float16 if self.state.precision == "fp16" else torch.bfloat16
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def _stage_micro_batch(self) -> int:
        return self.state.micro_batch * self.span.stage.batch_scale

    def _loader(self, start_step: int):
        d = self.spec.data
        sampler = data.MicroBatchSampler(self.stage_schedule, start_step, self.span.end, self._stage_micro_batch(),
                                         self.world.rank, self.world.size)
        pin = (self.device.type == "cuda") if d.pin_memory == "auto" else d.pin_memory
        return data.make_loader(self.train_set, sampler, self.recipe.collate, num_workers=d.num_workers,
                                pin_memory=pin, prefetch_factor=d.prefetch_factor,
                                persistent_workers=d.persistent_workers, seed=self.spec.seed + start_step)


def _poison_gradients(opt: torch.optim.Optimizer, mean: torch.Tensor) -> None:
    """NaN into one gradient when the step's loss is non-finite, on the device: the GradScaler's check then finds
    it, as it would in nearly every such step anyway (a NaN loss whose gradients stay finite is rare, not
    impossible), and skips the step. Adds 0 otherwise."""
    grad = next((p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None), None)
    if grad is not None:  # its first element, a view (a whole-tensor add would cost a pass over the gradient)
        grad[(0,) * grad.dim()].add_(mean.mul(0).to(grad.dtype))  # x * 0: NaN for a NaN or infinite x, else 0


def _mean(losses: list[torch.Tensor]) -> torch.Tensor:
    """The step's mean loss in fp32, on the device: the loss itself at grad_accum 1, a stack and a mean above it
    (a launch-bound GPU step waits on each launch; zeros, an add per micro-batch and a division were grad_accum + 2;
    ops counted with a TorchDispatchMode)."""
    return losses[0].float() if len(losses) == 1 else torch.stack(losses).float().mean()


def _peer_oom() -> RuntimeError:
    return RuntimeError("out of memory on another rank: every rank backs off together")
