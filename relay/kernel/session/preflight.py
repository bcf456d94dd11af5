"""The pre-flight: the session's worst case run before training, so an OOM shows (and is backed off) now rather
than hours in, and a figure that bounds the session's peak memory. It leaves no trace on the run.

A part of the built-in loop (relay/kernel/trainer.py's Trainer, duck-typed: nothing here imports it), whose step, OOM ladder and memory phases it uses.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

from relay.kernel.session import data, memory

log = logging.getLogger(__name__)


class PreFlight:
    def __init__(self, trainer: Any):
        self.t = trainer  # relay/kernel/trainer.py's Trainer, whose step, OOM ladder and memory phases this uses
        self.held_mb = 0.0  # what train's forward/backward ran on top of (weights, AdamW state, held gradients)

    def run(self) -> dict:
        """The run's worst case before training, so an OOM shows (and is backed off) now rather than hours in. Its
        figure bounds the session's peak (torch's max_memory_allocated; tests/kernel/test_preflight_memory.py lists what
        allocates where): a training step as the session's second and later steps meet it (_train),
        on the recipe's worst-case batch at the working micro-batch, and one eval batch for recipes whose eval
        generates. A peak above PREFLIGHT_FRACTION of the device (an emulated GPU's cap) counts as an OOM
        (fragmentation would end the session hours in). It leaves no trace: RNG forked, weights, buffers and
        optimizer state restored in place from a CPU copy. Each phase's peak goes into the session's PeakBook."""
        t = self.t
        st = t.state
        if st.global_step >= t.total_steps or t.span.stage.fit:
            return {}
        tensors = dict(t.model.named_parameters())
        tensors.update(t.model.named_buffers())
        saved, saved_opt = _cpu_copy(tensors), _optimizer_snapshot(t.optimizer)
        t._step_rng = t._torch_rng()  # what a back-off restores
        devices = [t.device.index or 0] if t.device.type == "cuda" else []
        t._recipe_step(st.global_step)
        phases = ("train", "eval") if t.recipe.preflight_eval else ("train",)
        try:
            for phase in phases:
                while (oom := t._any_oom(self._phase(phase, devices))) is not None:
                    t._back_off(oom, phase=phase)
        finally:  # the step taken above must not change the trajectory: exact resume stays bit-identical
            t._memory_phase("setup")  # the restore is not the worst step's; it is counted, as setup
            with torch.no_grad():
                for name, tensor in tensors.items():
                    tensor.copy_(saved[name])
            _restore_optimizer(t.optimizer, saved_opt)
        sample = t.monitor.sample()
        book = t.monitor.peaks
        used = (", ".join(f"GPU peak {phase} {book.alloc.get('preflight_' + phase, 0.0):.0f} MB" for phase in phases)
                + f" (train's forward/backward over {self.held_mb:.0f} MB held:"
                " weights, AdamW state, gradients of earlier micro-batches)"
                if book.active else f"RSS {sample['rss_mb']:.0f} MB, RAM {sample['ram_pct']:.0f} %")
        log.info("pre-flight at micro-batch %d x %d: %s on %s", st.micro_batch, st.grad_accum, used,
                 memory.describe_device(t.device))
        return sample

    def _phase(self, phase: str, devices: list) -> Optional[BaseException]:
        """One pre-flight phase; the OOM it met (a peak over PREFLIGHT_FRACTION counts as one), else None."""
        t = self.t
        t._memory_phase(f"preflight_{phase}", fresh=True)  # resets the peak: a retry forgets the OOM's
        try:
            with torch.random.fork_rng(devices=devices):
                self._train() if phase == "train" else self._eval()
            peak = memory.peak_fraction(t.device)
            if peak > memory.PREFLIGHT_FRACTION:
                raise torch.cuda.OutOfMemoryError(f"pre-flight {phase} peak at {peak:.0%} of the device (over "
                                                  f"{memory.PREFLIGHT_FRACTION:.0%}): as good as an OOM")
        except Exception as err:  # noqa: BLE001 - only OOM is handled
            if not memory.is_oom(err):
                raise
            return err
        finally:
            t.optimizer.zero_grad(set_to_none=True)
        return None

    def _train(self) -> None:
        """One training step as _step runs it after the session's first: AdamW's state (2x the weights) already
        on the device while the forward/backward runs (a fresh step allocates it only after its backward, so the
        activations never meet it there, while every later step's do), with grad_accum > 1 the previous
        micro-batches' gradients held through the forward (its first micro-batch grows them as activations are
        freed; the later ones carry all of them), the loss scaled by a GradScaler, unscaled and clipped as _step
        does, then the optimizer step. One forward/backward: the held gradients are zeros standing for the
        earlier micro-batches'."""
        t = self.t
        st, opt = t.state, t.optimizer
        idx = data.rank_indices(t.stage_schedule, st.global_step, t.world.rank,
                                t.world.size)[: t._stage_micro_batch()]
        params = [p for group in opt.param_groups for p in group["params"]]
        if any(p not in opt.state for p in params):  # a fresh run: allocate AdamW's state with a zero-grad step
            with torch.no_grad():
                for p in params:
                    p.grad = torch.zeros_like(p)
                opt.step()  # the weights it moves (weight decay) are restored by preflight
        if st.grad_accum > 1:
            with torch.no_grad():
                for p in params:
                    p.grad = torch.zeros_like(p) if p.grad is None else p.grad.zero_()
        else:
            opt.zero_grad(set_to_none=True)
        if t.device.type == "cuda":  # what the forward/backward runs on top of, for the log line
            self.held_mb = torch.cuda.memory_allocated(t.device) / memory.MB
        # a throwaway scaler: the session's keeps its scale and its per-step unscale_ record
        scaler = torch.amp.GradScaler(t.device.type, enabled=t.scaler.is_enabled())
        with t.recipe.worst_case([t.train_set[i] for i in idx]) as items:
            batch = data.to_device(t.recipe.collate(items), t.device, False)
            with t._autocast():
                loss = t.recipe.loss(t.model, batch)
            scaler.scale(loss / st.grad_accum).backward()
        if t.spec.optim.clip_grad_norm:
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(t.model.parameters(), t.spec.optim.clip_grad_norm)
        opt.step()  # the batch is still held, as _step holds its last micro-batch through the step

    def _eval(self) -> None:
        t = self.t
        dataset = t.recipe.eval_dataset()
        items = [dataset[i] for i in range(min(len(dataset), t.spec.optim.eval_batch))]
        with t.recipe.worst_case(items) as items, torch.no_grad(), t._autocast():
            t.model.eval()
            try:
                t.recipe.evaluate(t.model, [data.to_device(t.recipe.collate(items), t.device, False)])
            finally:
                t.model.train()


def _optimizer_snapshot(opt: torch.optim.Optimizer) -> dict:
    """A CPU copy of each parameter's optimizer state (AdamW: exp_avg, exp_avg_sq, step), keyed by parameter."""
    return {p: _cpu_copy(dict(state)) for p, state in opt.state.items()}


def _restore_optimizer(opt: torch.optim.Optimizer, saved: dict) -> None:
    """The optimizer state back to `saved`, in place: copied into the tensors it has now, so the device never
    holds two copies of it (load_state_dict builds the new state beside the old: 2x the weights more, at the end
    of a resumed session's pre-flight, after its peak was read). State the pre-flight created (a fresh run's) is
    dropped, as if never taken: the first real step creates it as it would have."""
    with torch.no_grad():
        for p in list(opt.state):
            if p not in saved:
                del opt.state[p]
                continue
            state = opt.state[p]
            for key, value in saved[p].items():
                now = state.get(key)
                if isinstance(value, torch.Tensor) and isinstance(now, torch.Tensor) and now.shape == value.shape \
                        and now.dtype == value.dtype:
                    now.copy_(value)
                else:  # not a tensor (or the step changed its layout): the saved value, where it lived
                    state[key] = value.to(now.device) if isinstance(value, torch.Tensor) and \
                        isinstance(now, torch.Tensor) else value


def _cpu_copy(obj: Any) -> Any:
    """A CPU copy of a (nested) state dict: the pre-flight's snapshot, off the device it measures."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return obj
