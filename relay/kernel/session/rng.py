"""Every random generator a resumed step depends on (torch CPU and CUDA, Python's, NumPy's), captured as plain
data that torch.load(weights_only=True) reads, and put back. Both session paths save it with each checkpoint."""
from __future__ import annotations

import contextlib
import random
from typing import Iterator, Optional

import numpy as np
import torch

from relay.kernel.session import distributed
from relay.kernel.session.device import seed_everything


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


def capture(world: distributed.World, device: torch.device) -> Optional[dict]:
    """The checkpoint's RNG entries: `rng` (rank 0's) and, with several processes, `rng_ranks` (every rank's,
    gathered: a collective, every rank calls it). None off rank 0."""
    rngs = distributed.gather(world, rng_state(device))
    if not world.main:
        return None
    return {"rng": rngs[0], **({"rng_ranks": rngs} if world.size > 1 else {})}


def restore(saved: dict, world: distributed.World, device: torch.device, seed: int, step: int) -> None:
    """Put this rank's generators back from a checkpoint. A rank the saving session did not have (the world
    grew: exactness is lost already) is seeded from the run's seed, the step and its rank instead."""
    rngs = saved.get("rng_ranks") or [saved["rng"]]
    if world.rank < len(rngs):
        set_rng_state(rngs[world.rank], device)
    else:
        seed_everything(distributed.rank_seed(seed + step, world.rank))


@contextlib.contextmanager
def kept(device: torch.device) -> Iterator[None]:
    """Every generator as it was before the block: set-up that may draw (a stage's first build) leaves the
    run's random stream where a checkpoint put it."""
    state = rng_state(device)
    try:
        yield
    finally:
        set_rng_state(state, device)


def _python_rng_to_plain(s: tuple) -> list:
    return [s[0], list(s[1]), s[2]]


def _numpy_rng_to_plain(s: tuple) -> list:
    # np.random.get_state() holds an ndarray, which torch.load(weights_only=True) refuses.
    return [s[0], torch.from_numpy(s[1].astype(np.int64)), int(s[2]), int(s[3]), float(s[4])]
