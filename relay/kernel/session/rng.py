"""Every random generator a resumed step depends on (torch CPU and CUDA, Python's, NumPy's), captured as plain
data that torch.load(weights_only=True) reads, and put back. Both session paths save it with each checkpoint."""
from __future__ import annotations

import random

import numpy as np
import torch


def rng_state(device: torch.device) -> dict:
    state = {
        "torch": torch.get_rng_state(),
        "python": _python_rng_to_plain(random.getstate()),
        "numpy": _numpy_rng_to_plain(np.random.get_state()),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _python_rng_to_plain(s: tuple) -> list:
    return [s[0], list(s[1]), s[2]]


def _numpy_rng_to_plain(s: tuple) -> list:
    # np.random.get_state() holds an ndarray, which torch.load(weights_only=True) refuses.
    return [s[0], torch.from_numpy(s[1].astype(np.int64)), int(s[2]), int(s[3]), float(s[4])]
