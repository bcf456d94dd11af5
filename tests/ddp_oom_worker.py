"""TEST-ONLY (tests/kernel/test_distributed.py): one rank of a 2-process session whose rank 1 runs out of memory.

CUDA OOM cannot happen on this CPU-only machine, so rank 1's recipe raises torch.cuda.OutOfMemoryError (a real
exception type) for micro-batches larger than 4 once training is under way. Spawned processes do not see a
test's monkeypatches, so each rank registers the recipe itself.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from relay.kernel import recipes
from relay.kernel.recipes.toy import ToyRecipe


class OomOnRank1(ToyRecipe):
    calls = 0

    def loss(self, model, batch):
        OomOnRank1.calls += 1
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if rank == 1 and OomOnRank1.calls > 6 and len(batch["y"]) > 4:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (simulated on rank 1: micro-batch {len(batch['y'])})")
        return super().loss(model, batch)


NAME, PATH = "oom-on-rank-1", f"{__name__}:OomOnRank1"


def worker(rank: int, world_size: int, port: int, errors, spec, workdir: str) -> None:
    from relay.kernel.run import _session
    from relay.kernel.session import distributed
    from relay.kernel.session.settings import SessionSettings

    recipes._REGISTRY[NAME] = PATH
    torch.set_num_threads(1)
    world = distributed.init(rank, world_size, port, "cpu")
    try:
        _session(world, time.time(), spec, Path(workdir), SessionSettings.from_spec(spec, Path(workdir), None))
    finally:
        distributed.shutdown(world)
