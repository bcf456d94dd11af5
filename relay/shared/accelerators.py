"""What a Kaggle machine shape brings, and whether the GPUs a session sees are that.

Kaggle has served another accelerator than the one asked for (a P100 for a T4 request), and `NvidiaTeslaT4` is
"GPU T4 x2": two T4s, a single one is not offered. A session compares what it sees with its spec's
`kaggle.machine_shape` in its first seconds (relay/kernel/session/core.py); `relay plan` counts the processes a
shape trains with. Shapes whose GPU count is not documented are checked by name only; TPU shapes and shapes not
listed here are not checked.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class Accelerator:
    name: str             # what torch.cuda.get_device_name() contains ("Tesla T4", "NVIDIA L4")
    count: Optional[int]  # GPUs the shape brings; None: not documented, not checked

    def __str__(self) -> str:
        return f"{self.count} x {self.name}" if self.count else self.name


SHAPES = {
    "NvidiaTeslaT4": Accelerator("T4", 2),
    "NvidiaTeslaT4Highmem": Accelerator("T4", 2),
    "NvidiaTeslaP100": Accelerator("P100", 1),
    "NvidiaL4X1": Accelerator("L4", 1),
    "NvidiaL4": Accelerator("L4", None),
    "NvidiaTeslaA100": Accelerator("A100", None),
    "NvidiaH100": Accelerator("H100", None),
    "NvidiaRtxPro6000": Accelerator("RTX PRO 6000", None),
}


# The GPU shapes a push may ask for (kaggle-cli docs/kernels.md, "Accelerators available as of Feb 2026"; PR #1198),
# and the retired ones, which Kaggle does not refuse but "silently runs the session on a replacement" for
# (kaggle-cli PR #1192): a spec asking for one is refused here instead, naming the replacement. Some current
# shapes are open only to some competitions or to admins (the same doc): Kaggle then may swap them too.
GPU_SHAPES = ("NvidiaTeslaT4", "NvidiaL4", "NvidiaL4X1", "NvidiaTeslaA100", "NvidiaH100", "NvidiaRtxPro6000",
              "NvidiaTeslaT4Highmem")
RETIRED = {"NvidiaTeslaP100": "NvidiaTeslaT4", "TpuV38": "TpuV5E8", "Tpu1VmV38": "TpuV5E8", "TpuV232": "CPU", "TpuV2256": "CPU"}


def shape_problem(shape: str) -> Optional[str]:
    """Why a relay cannot ask Kaggle for `shape` (one line), None when it can."""
    if shape in GPU_SHAPES:
        return None
    if shape in RETIRED:
        return f"{shape} is retired: Kaggle runs it on {RETIRED[shape]} instead; ask for one of {', '.join(GPU_SHAPES)}"
    return f"expected one of {', '.join(GPU_SHAPES)} (a relay trains on GPUs; got {shape!r})"


def gpus_of(shape: Optional[str]) -> int:
    """GPUs a shape brings (1 when it is not known): the processes `session.devices: auto` trains with."""
    accelerator = SHAPES.get(shape or "")
    return accelerator.count if accelerator and accelerator.count else 1


def describe(names: Sequence[str]) -> str:
    """"2 x Tesla T4", "Tesla T4 + Tesla P100", "no GPU"."""
    if not names:
        return "no GPU"
    return f"{len(names)} x {names[0]}" if len(set(names)) == 1 else " + ".join(names)


def mismatch(shape: Optional[str], names: Sequence[str]) -> Optional[str]:
    """Why the GPUs `names` are not what `shape` asks for (one line), or None when they are, or when the shape
    is not one this module knows."""
    wanted = SHAPES.get(shape or "")
    if wanted is None:
        return None
    right_kind = bool(names) and all(wanted.name.lower() in n.lower() for n in names)
    if right_kind and wanted.count in (None, len(names)):
        return None
    return f"got {describe(names)} where kaggle.machine_shape {shape} asks for {wanted}"
