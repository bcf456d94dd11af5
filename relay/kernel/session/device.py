"""The session's device and its process-wide settings: where it trains (RELAY_DEVICE, else CUDA when there is
one), threads and TF32, and the seeds. Both loops' sessions start here."""
from __future__ import annotations

import random

import numpy as np
import torch

from relay.kernel.session import memory
from relay.shared.environment import EMULATE_GPU, SessionEnvironment
from relay.shared.spec import RunSpec


def pick_device() -> torch.device:
    return torch.device(SessionEnvironment.read().device or ("cuda" if torch.cuda.is_available() else "cpu"))


def configure_backends(spec: RunSpec, device: torch.device) -> None:
    if spec.session.threads:
        torch.set_num_threads(spec.session.threads)
    if device.type == "cuda":
        # One TF32 API only: after a write through torch's newer fp32_precision API, reads of allow_tf32 raise.
        torch.backends.cuda.matmul.allow_tf32 = spec.optim.tf32
        torch.backends.cudnn.allow_tf32 = spec.optim.tf32
        # Exact resume over speed: benchmark mode times cuDNN's algorithms afresh in each process, within the
        # memory free at that moment, so a resumed session could compute the same convolution another way;
        # deterministic: no atomics in a convolution's backward.
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    emulate_gpu(spec, device)


def emulate_gpu(spec: RunSpec, device: torch.device) -> "memory.GpuProfile | None":
    """The GPU the session runs as (session.emulate; RELAY_EMULATE_GPU over it, `none` for none): its memory
    cap set on `device` now, before anything is allocated there; precision `auto` resolves by it."""
    told = SessionEnvironment.read().emulate_gpu
    name, source = (told, EMULATE_GPU) if told is not None else (spec.session.emulate, "session.emulate")
    return memory.emulate(None if (name or "").lower() in ("", "none") else name, device, source)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
