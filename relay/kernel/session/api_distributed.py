"""The Session API with several processes: a user's loop on both GPUs of a Kaggle T4 x2 (gloo on CPU in tests).

`relay train` runs the user's entry once per rank (relay.kernel.entry.launch_entry) with the torchrun environment (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so a script that sets up torch DDP itself works unchanged;
`relay.open_session()` joins that world (`join_world`) unless the script already initialised the process
group. The user wraps the model in torch's DistributedDataParallel as usual; the session does the rest with
relay.kernel.session.distributed's collectives, as the built-in recipes do:

- each step, one small all-reduce of flags (`distributed.StepAgreement`, the built-in Trainer's too): a SIGTERM
  to any rank, rank 0's budget, step-cap and insurance-save decisions, and the mean loss at logging steps, so
  every rank stops and saves at the same optimizer step;
- a save gathers every rank's RNG to rank 0, which alone writes the checkpoint (`rng_ranks`), metrics.jsonl,
  progress.json and the export; the other ranks wait at a barrier;
- a DistributedDataParallel model is saved and loaded through its `.module`, so one process can resume it.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from relay.kernel.session import distributed
from relay.kernel.session.distributed import World
from relay.shared.environment import SessionEnvironment
from relay.shared.errors import InputError

log = logging.getLogger(__name__)


def env_world_size() -> int:
    return SessionEnvironment.read().world_size


# -- inside the session --------------------------------------------------------------------------------
def join_world(device: torch.device) -> tuple[World, torch.device]:
    """The world of this process and its training device (cuda:LOCAL_RANK under several GPUs). Initialises
    the process group from the torchrun environment unless the script did already."""
    size = env_world_size()
    if size <= 1:
        return distributed.SINGLE, device
    if device.type == "cuda":
        device = torch.device("cuda", SessionEnvironment.read().local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return World(dist.get_rank(), dist.get_world_size()), device


def unwrap(obj: Any) -> Any:
    """The module inside DistributedDataParallel (or DataParallel): its state_dict has no `module.` prefix, so
    the checkpoint loads into a bare model, at any world size."""
    if isinstance(obj, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        return obj.module
    return obj


def single_process(session, what: str) -> None:
    """The HF Trainer and Lightning callbacks are proved in one process only: refuse several at once."""
    if session.world_size > 1:
        raise InputError(f"{what}: session.devices gives {session.world_size} processes; the callback trains in one"
                         " process only: set session.devices: 1 (a plain loop with the Session API can use several)")


def rank_batch(world: World, batch_size: int) -> None:
    if batch_size % world.size:
        raise InputError(f"session.batches(batch_size={batch_size}): the effective batch must be divisible by the"
                         f" {world.size} processes of session.devices, so every rank takes an equal slice")

