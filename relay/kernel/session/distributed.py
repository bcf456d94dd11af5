"""Several processes in one session: both GPUs of a Kaggle "T4 x2" (or N CPU processes with gloo in tests).

One process per device, launched by `run_session` with torch.multiprocessing. Every rank builds the same
model from the same seed and keeps a full replica (plain data parallelism); the optimizer step of every rank
sees the same averaged gradients, so the replicas stay equal and rank 0's state is the checkpoint.

Why gradients are averaged by hand rather than by DistributedDataParallel's backward hooks: a rank that runs
out of memory in a forward would leave the others blocked inside DDP's all-reduce. Here each rank accumulates
its micro-batches locally (DDP's `no_sync` for every micro-step), then all ranks agree on one small tensor of
flags (OOM, SIGTERM, the stop decision, the loss) and only then all-reduce the gradients: an OOM on one rank
makes every rank back off together, and a SIGTERM to any rank stops all at the same optimizer step.

The data order stays a pure function of the step: optimizer step s takes the schedule's effective batch of s
and rank r takes the r-th of `size` equal slices of it, so each rank's next batch after a resume is the one it
would have had, and the global effective batch (micro-batch x accumulation x world size) is the spec's.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from relay.kernel.session.watchdog import STALLED_EXIT
from relay.shared.errors import InputError

log = logging.getLogger(__name__)

GRAD_BUCKET_BYTES = 25 * 2**20  # gradients are all-reduced in flat buckets of this size, as DDP does
# When a rank fails, the others get this long to end on their own (a refused input fails every rank at once:
# they exit without a "Terminating process" warning), then SIGTERM, this long again, then SIGKILL (a rank
# blocked in a collective never returns to Python to see its SIGTERM).
FAILED_RANK_GRACE_S = 10.0


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.size > 1 and dist.is_available() and dist.is_initialized()


SINGLE = World()


def world_size_for(devices: Union[str, int], device_type: str, fit_only: bool = False) -> int:
    """`session.devices`: "auto" is every visible GPU (1 on CPU); a number is that many processes. A recipe made
    only of fit stages runs in one process (the spec refuses a number above 1 for it)."""
    if fit_only:
        return 1
    if devices == "auto":
        return max(1, torch.cuda.device_count()) if device_type == "cuda" else 1
    n = int(devices)
    if device_type == "cuda" and n > torch.cuda.device_count():
        raise InputError(f"session.devices: {n} processes asked for, but {torch.cuda.device_count()} GPUs are visible")
    return n


def split_batch(effective_batch: int, world_size: int, micro_batch: int) -> tuple[int, int]:
    """(micro-batch, accumulation) per rank so that micro x accumulation x world size == effective batch, with
    the largest micro-batch not above `micro_batch`."""
    if effective_batch % world_size:
        raise InputError(f"optim.micro_batch x optim.grad_accum ({effective_batch}) must be divisible by the"
                         f" number of processes ({world_size}) to keep the effective batch")
    share = effective_batch // world_size
    micro = max(d for d in range(1, min(micro_batch, share) + 1) if share % d == 0)
    return micro, share // micro


def rank_seed(seed: int, rank: int) -> int:
    """Each rank's training RNG (dropout); rank 0 keeps the seed, so one process trains as before."""
    return seed + 1_000_003 * rank


def rendezvous_store(world_size: int) -> "dist.TCPStore":
    """The ranks' rendezvous store, hosted by the launcher as torchrun's agent hosts it: bound to a port the OS picks
    and held until the ranks are done. (A port found free, released and bound again by rank 0 could be taken in
    between by any other process: EADDRINUSE, seen when two test suites ran on one machine.)"""
    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)


def rank_environment(port: int) -> dict[str, str]:
    """What a rank's env:// rendezvous reads: the launcher's store (every rank a client of it, torchrun's agent
    store), for the relay's init() and for a user's script that calls init_process_group itself."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"}


def launch(worker: Callable[..., Any], world_size: int, args: Sequence[Any]) -> None:
    """Run `worker(rank, world_size, port, errors, *args)` in `world_size` new processes and wait for all.
    If any process dies (an exception, a SIGKILL), the others are terminated and this raises. A rank that
    refuses its input puts the one-line message on `errors` and returns: it is raised here as an InputError,
    so `relay train` exits 2 with one line as in one process. A rank that ended a stalled session (its
    watchdog: session/watchdog.py) makes this process exit with the same status, as one process would."""
    import torch.multiprocessing as mp

    start = start_method()
    method = mp.get_context(start)
    if start == "forkserver":
        _socket_dir()
        method.set_forkserver_preload(["__main__", "torch", worker.__module__])
    errors = method.SimpleQueue()
    store = rendezvous_store(world_size)  # held, listening, until the ranks are joined below
    context = mp.start_processes(_rank, args=(worker, world_size, store.port, errors, *args), nprocs=world_size,
                                 join=False, start_method=start)

    def forward(signum, frame):  # Kaggle may signal only this process: every rank must see the SIGTERM
        for proc in context.processes:
            if proc.is_alive():
                os.kill(proc.pid, signum)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        while not context.join(grace_period=FAILED_RANK_GRACE_S):
            pass
    except Exception as failed:
        if getattr(failed, "exit_code", None) == STALLED_EXIT:  # recorded and said by that rank already
            raise SystemExit(STALLED_EXIT) from None
        if not errors.empty():  # a rank that refused its input and exited non-zero (the others were stopped)
            raise InputError(errors.get()) from None
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        del store
    if not errors.empty():
        raise InputError(errors.get())


def start_method() -> str:
    """How the ranks are started. With GPUs, forkserver: like spawn, each rank is a process no CUDA state was
    inherited by (CUDA cannot be used in a child forked from a process that initialized it), but forked from one
    server that imported torch and the rank's code once, not a new interpreter. On CPU (gloo), fork: the ranks
    are forked from this process, which imported them already; a forkserver's own start imports torch again
    (docs/benchmarks.md, "The two-rank sessions' forkservers")."""
    return "forkserver" if torch.cuda.is_available() else "fork"


def _rank(rank: int, worker: Callable[..., Any], *args: Any) -> None:
    """One rank. Forked from the launcher, it has the launcher's threading-exit callbacks (a library's service
    threads, e.g. Prefect's in a test that launches in-process) but not their threads: run at this process's exit
    they fail, and the rank would exit 1 after training to its end. (A forkserver's rank has none to drop.)"""
    atexits = getattr(threading, "_threading_atexits", None)
    if isinstance(atexits, list):
        atexits.clear()
    worker(rank, *args)


def _socket_dir() -> None:
    """multiprocessing's temp dir, made now: the forkserver listens on a socket file in it, and a deep TMPDIR (an
    emulated kernel's) would make that path longer than a socket's 108 bytes; then it is made under /tmp."""
    import multiprocessing.util
    import tempfile

    before = tempfile.tempdir
    try:
        if len(tempfile.gettempdir()) > 60 and os.access("/tmp", os.W_OK):
            tempfile.tempdir = "/tmp"
        multiprocessing.util.get_temp_dir()  # kept for this process
    finally:
        tempfile.tempdir = before


def init(rank: int, size: int, port: int, device_type: str) -> World:
    os.environ.update(rank_environment(port))
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=size)
    return World(rank, size)


def shutdown(world: World) -> None:
    if world.active:
        dist.destroy_process_group()


def agree(world: World, values: Sequence[float], device: torch.device) -> list[float]:
    """The sum over ranks of each value: one small all-reduce. With one process, the values themselves."""
    if not world.active:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


class StepAgreement:
    """One all-reduce per optimizer step: stop (and why), periodic save, and the mean loss when logging. A SIGTERM
    to any rank or a step cap stops every rank; rank 0 alone decides the budget and the insurance save. The
    Session API's, whichever loop drives it."""

    def __init__(self, world: World, device: torch.device):
        self.world, self.device = world, device
        self.step: Optional[int] = None  # the step the last agreement was made at
        self.reason: Optional[str] = None
        self.save = False  # the periodic save agreed at that step

    def decide(self, step: int, reason: Optional[str], save_due: bool,
               losses: Optional[list] = None) -> tuple[Optional[str], bool, Optional[float]]:
        """(agreed stop reason, agreed periodic save, mean loss over every rank's losses or None)."""
        main = self.world.main
        values = [reason == "sigterm", reason == "steps", main and reason == "budget", main and save_due]
        if losses is not None:
            values += [sum(float(x) for x in losses), len(losses)]
        out = agree(self.world, values, self.device)
        sig, steps, budget, save = out[:4]
        agreed = "sigterm" if sig else "steps" if steps else "budget" if budget else None
        mean = out[4] / out[5] if losses is not None and out[5] else None
        self.step, self.reason, self.save = step, agreed, bool(save) and agreed is None
        return agreed, self.save, mean


def average_gradients(model: torch.nn.Module, world: World) -> None:
    """Mean of every parameter's gradient over the ranks, in flat buckets (one all-reduce per bucket)."""
    if not world.active:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    bucket: list[torch.Tensor] = []
    size = 0
    for g in grads:
        if bucket and g.dtype != bucket[0].dtype:  # a flat bucket holds one dtype
            _reduce_bucket(bucket, world)
            bucket, size = [], 0
        bucket.append(g)
        size += g.numel() * g.element_size()
        if size >= GRAD_BUCKET_BYTES:
            _reduce_bucket(bucket, world)
            bucket, size = [], 0
    if bucket:
        _reduce_bucket(bucket, world)


def _reduce_bucket(bucket: list[torch.Tensor], world: World) -> None:
    flat = torch._utils._flatten_dense_tensors(bucket)
    dist.all_reduce(flat)
    flat /= world.size
    for g, synced in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
        g.copy_(synced)


def gather(world: World, obj: Any) -> Optional[list]:
    """Every rank's `obj`, on rank 0 (None elsewhere). With one process, [obj]."""
    if not world.active:
        return [obj]
    out = [None] * world.size if world.main else None
    dist.gather_object(obj, out, dst=0)
    return out


def barrier(world: World) -> None:
    if world.active:
        dist.barrier()


def broadcast(world: World, obj: Any) -> Any:
    """Rank 0's `obj` on every rank."""
    if not world.active:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
