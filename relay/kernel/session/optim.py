"""The built-in loop's optimizer: AdamW over decayed and undecayed parameter groups, its learning rate as a pure
function of the step (so a resumed step gets the uninterrupted run's rate), and the precision a device trains in."""
from __future__ import annotations

import logging
import math
from typing import Callable

import torch
from torch import nn

from relay.kernel.session import memory
from relay.shared.spec import RunSpec

log = logging.getLogger(__name__)


def resolve_precision(requested: str, device: torch.device) -> str:
    if device.type == "cuda":
        if requested == "auto":
            profile = memory.emulated(device)  # session.emulate: t4 on a bigger GPU trains as the T4 would
            if profile is not None:
                return "bf16" if profile.bf16 else "fp16"
            # Native bf16 only (Ampere+): torch's default also counts emulation, which says yes on a T4 (sm_75).
            return "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"
        return requested
    if requested == "fp16":
        log.warning("optim.precision: fp16 needs CUDA; training in fp32 on %s", device)
    # bf16 autocast runs on CPU (slowly, ~10x here), so it is honoured only when asked for by name.
    return "bf16" if requested == "bf16" else "fp32"


def lr_lambda(schedule: str, warmup: int, total: int) -> Callable[[int], float]:
    """The learning-rate multiplier as a pure function of the optimizer step."""

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_optimizer(model: nn.Module, spec: RunSpec, device: torch.device) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    groups = [{"params": decay, "weight_decay": spec.optim.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    # One fused kernel per parameter group instead of ~10 ops per tensor (torch's CPU default). The loop's cost
    # against a hand-written one: bench/bench_loop.py.
    return torch.optim.AdamW(groups, lr=spec.optim.lr, fused=True)
