"""The session's device and its process-wide settings: where it trains (RELAY_DEVICE, else CUDA when there is
one), threads and TF32, and the seeds. The built-in runner and the Session API both start here."""
from __future__ import annotations

import random

import numpy as np
import torch

from relay.shared.environment import SessionEnvironment
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
        torch.backends.cudnn.benchmark = True


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
