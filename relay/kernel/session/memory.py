"""Memory: what the process and the device use, and what to do when CUDA runs out."""
from __future__ import annotations

import gc
import logging
from typing import Optional

import psutil
import torch

log = logging.getLogger(__name__)

WARN_FRACTION = 0.80


class MemoryMonitor:
    """Process RSS, system RAM %, GPU allocated/reserved/peak and utilisation (NVML when present)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._proc = psutil.Process()
        self._nvml = _nvml_handle(device)
        self._warned: set[str] = set()
        self.peak_rss_mb = 0.0

    def sample(self) -> dict[str, float]:
        rss = self._proc.memory_info().rss / 2**20
        self.peak_rss_mb = max(self.peak_rss_mb, rss)
        out = {"rss_mb": round(rss, 1), "ram_pct": psutil.virtual_memory().percent}
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            out.update(
                gpu_alloc_mb=round(torch.cuda.memory_allocated(self.device) / 2**20, 1),
                gpu_reserved_mb=round(torch.cuda.memory_reserved(self.device) / 2**20, 1),
                gpu_peak_mb=round(torch.cuda.max_memory_allocated(self.device) / 2**20, 1),
                gpu_pct=round(100 * torch.cuda.memory_reserved(self.device) / total, 1),
            )
            if self._nvml is not None:
                import pynvml

                out["gpu_util_pct"] = float(pynvml.nvmlDeviceGetUtilizationRates(self._nvml).gpu)
        self._warn(out)
        return out

    def peak_mb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
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
    """Peak allocated memory since the last reset, as a fraction of the device (0 off CUDA: RAM is not capped)."""
    if device.type != "cuda":
        return 0.0
    return torch.cuda.max_memory_allocated(device) / torch.cuda.get_device_properties(device).total_memory


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
        return f"{p.name}, {p.total_memory / 2**30:.1f} GiB"
    vm = psutil.virtual_memory()
    return f"CPU x{torch.get_num_threads()} threads, {vm.total / 2**30:.1f} GiB RAM"
