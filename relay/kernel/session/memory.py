"""Memory: what the process and the device use, and what to do when CUDA runs out."""
from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import psutil
import torch

from relay.shared.errors import InputError

log = logging.getLogger(__name__)

WARN_FRACTION = 0.80
MB = 2**20


# -- a smaller GPU on a bigger one (session.emulate, RELAY_EMULATE_GPU) ------------------------------------
@dataclass(frozen=True)
class GpuProfile:
    name: str
    memory_bytes: int  # what torch's get_device_properties reports on that GPU: the most the allocator could get
    bf16: bool  # native bf16: `precision: auto` picks bf16 where true, else fp16 + GradScaler


# Kaggle's and Colab's T4 report total_memory=15102 MiB (nvidia-smi: 15360 MiB, less what the driver keeps). The CUDA
# context (~300-400 MiB) sits outside the allocator on both cards, so a cap at this figure is as tight as a T4.
EMULATED = {"t4": GpuProfile("Tesla T4", 15102 * MB, bf16=False)}
_emulating: dict[int, GpuProfile] = {}  # device index -> the profile its session runs as


def emulate(name: Optional[str], device: torch.device, source: str = "session.emulate") -> Optional[GpuProfile]:
    """Run this process's session on `device` as if on the GPU `name` (None: as itself): the caching allocator
    is capped at that GPU's memory (torch.cuda.set_per_process_memory_fraction: an allocation past it is an
    OOM, so the OOM ladder and the pre-flight's 90 % meet Kaggle's memory) and `precision: auto` resolves as
    there (a T4 has no native bf16: fp16 + GradScaler). Speed is not emulated."""
    if not name:
        return None
    profile = EMULATED.get(name.lower())
    if profile is None:
        raise InputError(f"{source}: unknown GPU {name!r} to emulate (known: {', '.join(EMULATED)})")
    if device.type != "cuda":
        log.warning("%s: %s needs CUDA; on %s nothing is capped", source, name, device)
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    if profile.memory_bytes < total:
        torch.cuda.set_per_process_memory_fraction(profile.memory_bytes / total, index)
    _emulating[index] = profile
    log.info("%s: running as a %s: GPU memory capped at %.0f MiB of %.0f MiB, precision auto -> %s", source,
             profile.name, min(profile.memory_bytes, total) / MB, total / MB, "bf16" if profile.bf16 else "fp16")
    return profile


def emulated(device: torch.device) -> Optional[GpuProfile]:
    if device.type != "cuda" or not _emulating:  # nothing emulated: ask CUDA nothing (a CPU build cannot answer)
        return None
    return _emulating.get(device.index if device.index is not None else torch.cuda.current_device())


def device_total(device: torch.device) -> int:
    """The device's memory in bytes as the session may use it: an emulated GPU's cap where one is set."""
    total = torch.cuda.get_device_properties(device).total_memory
    profile = emulated(device)
    return min(total, profile.memory_bytes) if profile else total


# -- peaks per phase ------------------------------------------------------------------------------------------
class PeakReader(Protocol):
    def read(self, phase: str) -> tuple[int, int]:
        """(peak allocated, peak reserved) bytes since the last reset; `phase` is for scripted readers (tests)."""

    def reset(self) -> None: ...


class CudaPeakReader:
    """torch's caching-allocator peaks: allocated is what tensors held (the pre-flight's yardstick), reserved what
    the allocator took from the device (allocated + cached + fragmentation: what a real OOM is against)."""

    def __init__(self, device: torch.device):
        self.device = device

    def read(self, phase: str) -> tuple[int, int]:
        return torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device)

    def reset(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)


def peak_reader(device: torch.device) -> Optional[PeakReader]:
    """The reader a session's PeakBook uses (tests replace this function to script GPU peaks on CPU)."""
    return CudaPeakReader(device) if device.type == "cuda" else None


PREFLIGHT_PHASES = ("preflight_train", "preflight_eval")


class PeakBook:
    """A session's GPU memory peak per phase: setup (the model on the device, a restored state), preflight_train,
    preflight_eval, train, eval, save. The peak counter is reset as each phase begins, so one run shows where
    the session's peak arises; the pre-flight's figure (its larger phase) is kept beside the rest, and the first
    time another phase passes it one warning line says so (the pre-flight then missed something)."""

    def __init__(self, device: torch.device, reader: Optional[PeakReader] = None):
        self.reader = reader if reader is not None else peak_reader(device)
        self.step_of: Optional[Callable[[], int]] = None  # the trainer's step, for the line when none is given
        self.phase = "setup"  # from the process's start: no reset before, so setup holds all that came first
        self.alloc: dict[str, float] = {}  # phase -> peak allocated MB
        self.reserved: dict[str, float] = {}  # phase -> peak reserved MB
        self.passed: Optional[str] = None  # the line logged when the session passed its pre-flight

    @property
    def active(self) -> bool:
        return self.reader is not None

    def enter(self, phase: str, *, fresh: bool = False, step: Optional[int] = None) -> str:
        """Close the running phase (its peak since it began) and start `phase`; returns the phase closed.
        fresh: forget an earlier run of `phase` (a pre-flight attempt that ran out of memory and is retried
        smaller: its peak is not what the session will train at)."""
        closed = self.phase
        if self.reader is not None:
            self.peek(step)
            self.reader.reset()
            if fresh:
                self.alloc.pop(phase, None)
                self.reserved.pop(phase, None)
        self.phase = phase
        return closed

    def peek(self, step: Optional[int] = None) -> None:
        """Fold the running phase's peak so far into the book (peaks only grow within a phase)."""
        if self.reader is None:
            return
        alloc, reserved = self.reader.read(self.phase)
        self.alloc[self.phase] = max(self.alloc.get(self.phase, 0.0), alloc / MB)
        self.reserved[self.phase] = max(self.reserved.get(self.phase, 0.0), reserved / MB)
        self._check(step)

    def current_mb(self) -> float:
        """The running phase's peak allocated MB since it began."""
        if self.reader is None:
            return 0.0
        return self.reader.read(self.phase)[0] / MB

    def preflight_mb(self) -> Optional[float]:
        seen = [self.alloc[p] for p in PREFLIGHT_PHASES if p in self.alloc]
        return max(seen) if seen else None

    def session_peak_mb(self) -> float:
        """The largest allocated peak of any phase, pre-flight included (what the device had to hold)."""
        self.peek()
        return max(self.alloc.values(), default=0.0)

    def _check(self, step: Optional[int]) -> None:
        figure = self.preflight_mb()
        if self.passed is not None or figure is None or self.phase in PREFLIGHT_PHASES:
            return
        peak = self.alloc.get(self.phase, 0.0)
        if peak > figure:
            step = step if step is not None or self.step_of is None else self.step_of()
            where = self.phase if step is None else f"{self.phase} at step {step}"
            self.passed = (f"memory: the session's peak {peak:.0f} MB ({where}) passed its pre-flight's "
                           f"{figure:.0f} MB by {peak - figure:.1f} MB ({peak / figure - 1:.1%}): the pre-flight "
                           f"misses what {self.phase} allocates, and on a smaller GPU this session would run out of"
                           " memory there")
            log.warning(self.passed)

    def fields(self) -> dict:
        """What the session record keeps (nothing off CUDA: RAM peaks are the record's peak_mem_mb)."""
        if self.reader is None:
            return {}
        self.peek()
        figure = self.preflight_mb()
        return {"peak_mem_mb": round(max(self.alloc.values(), default=0.0), 1),
                "preflight_mb": None if figure is None else round(figure, 1),
                "phase_peaks_mb": {k: round(v, 1) for k, v in self.alloc.items()},
                "phase_reserved_mb": {k: round(v, 1) for k, v in self.reserved.items()}}


class MemoryMonitor:
    """Process RSS, system RAM %, GPU allocated/reserved/peak and utilisation (NVML when present)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peaks = PeakBook(device)  # resets the peak counter per phase: peaks are read through it
        self._proc = psutil.Process()
        self._nvml = _nvml_handle(device)
        self._warned: set[str] = set()
        self.peak_rss_mb = 0.0

    def sample(self) -> dict[str, float]:
        rss = self._proc.memory_info().rss / 2**20
        self.peak_rss_mb = max(self.peak_rss_mb, rss)
        out = {"rss_mb": round(rss, 1), "ram_pct": psutil.virtual_memory().percent}
        if self.device.type == "cuda":
            total = device_total(self.device)
            out.update(
                gpu_alloc_mb=round(torch.cuda.memory_allocated(self.device) / 2**20, 1),
                gpu_reserved_mb=round(torch.cuda.memory_reserved(self.device) / 2**20, 1),
                gpu_peak_mb=round(self.peaks.session_peak_mb(), 1),
                gpu_pct=round(100 * torch.cuda.memory_reserved(self.device) / total, 1),
            )
            if self._nvml is not None:
                import pynvml

                out["gpu_util_pct"] = float(pynvml.nvmlDeviceGetUtilizationRates(self._nvml).gpu)
        self._warn(out)
        return out

    def peak_mb(self) -> float:
        if self.device.type == "cuda":
            return self.peaks.session_peak_mb()
        return self.peak_rss_mb

    def _warn(self, sample: dict[str, float]) -> None:
        for key in ("ram_pct", "gpu_pct"):
            if sample.get(key, 0.0) > 100 * WARN_FRACTION and key not in self._warned:
                self._warned.add(key)
                log.warning("memory: %s at %.0f%% (over %.0f%%): an OOM may be near", key, sample[key],
                            100 * WARN_FRACTION)


def _nvml_handle(device: torch.device):
    if device.type != "cuda":
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
    except Exception:  # NVML absent or not permitted: utilisation is optional
        return None


PREFLIGHT_FRACTION = 0.9  # a pre-flight peak above this is an OOM: hours of fragmentation and eval on top fail


def peak_fraction(device: torch.device) -> float:
    """Peak allocated memory since the last reset (the running phase's), as a fraction of the device as the
    session may use it (an emulated GPU's cap); 0 off CUDA: RAM is not capped."""
    if device.type != "cuda":
        return 0.0
    return torch.cuda.max_memory_allocated(device) / device_total(device)


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()


def back_off(micro_batch: int, grad_accum: int) -> Optional[tuple[int, int]]:
    """Halve the micro-batch (or the next divisor down) and raise accumulation so the effective batch is
    unchanged, unlike HF's auto_find_batch_size. None when the micro-batch is already 1."""
    for smaller in range(micro_batch // 2, 0, -1):
        if micro_batch % smaller == 0:
            return smaller, grad_accum * (micro_batch // smaller)
    return None


def next_rung(rungs: list, taken: list[str], phase: str):
    """The first rung of a recipe's ladder not taken yet that can help an OOM in `phase`, or None."""
    return next((r for r in rungs if r.name not in taken and phase in r.phases), None)


def free_cached(device: torch.device) -> None:
    """Periodic cleanup: returns cached blocks so fragmentation does not end in an OOM."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        profile = emulated(device)
        if profile is not None:
            capped = device_total(device) / 2**30
            return f"{p.name} as a {profile.name}, {capped:.1f} of {p.total_memory / 2**30:.1f} GiB"
        return f"{p.name}, {p.total_memory / 2**30:.1f} GiB"
    vm = psutil.virtual_memory()
    return f"CPU x{torch.get_num_threads()} threads, {vm.total / 2**30:.1f} GiB RAM"
