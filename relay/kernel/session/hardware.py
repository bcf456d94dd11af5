"""What this session runs on, read once when its record opens (SessionCore.open), without the network: the
Python and torch versions, the CUDA and cuDNN torch uses, the GPUs and their compute capability, the CPU's model
and the instruction set torch's CPU kernels use here (AVX512 and AVX2 kernels round differently: the same CPU
math gives other bits on another CPU), and Kaggle's Docker image (its build sets GIT_COMMIT and BUILD_DATE in
the environment and writes /etc/git_commit and /etc/build_date). All of it decides a session's float results:
the one place that reads it, for the session's record and for `relay verify-resume`. And whether the
GPUs are those the spec's machine shape asks for: checked inside a Kaggle kernel only (a laptop or CI is not
what the spec describes), and not in the emulator, which runs kernels on this machine's CPU, unless a test tells
the session what it "runs on" (RELAY_TEST_HARDWARE: CUDA and Kaggle's images cannot run here).
"""
from __future__ import annotations

import platform
from pathlib import Path
from typing import Optional

import torch

from relay.shared import accelerators
from relay.shared.environment import SessionEnvironment

describe_gpus = accelerators.describe
_IMAGE_FILES = {"commit": Path("/etc/git_commit"), "built": Path("/etc/build_date")}


def gpu_inventory() -> dict:
    """The GPUs this session sees, {"count", "names"}: kept in the session's entry of progress.json, because
    Kaggle has been reported to ignore the machine shape asked for (a P100 instead of T4 x2 shows here, not in
    the push)."""
    if not torch.cuda.is_available():
        return {"count": 0, "names": []}
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"count": len(names), "names": names}


def _gpu_capability() -> Optional[str]:
    """The GPUs' compute capability ("7.5"; distinct values joined by commas); None without a GPU."""
    if not torch.cuda.is_available():
        return None
    found = dict.fromkeys("%d.%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count()))
    return ",".join(found)


def cpu_model() -> Optional[str]:
    """The CPU's model name, from /proc/cpuinfo on Linux (Kaggle's kernels); elsewhere what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or None


def _image(env: SessionEnvironment) -> dict:
    """Kaggle's image as it describes itself, inside a Kaggle kernel ({} elsewhere: GIT_COMMIT is a common name)."""
    if not env.kaggle_kernel:
        return {}
    image = dict(env.image)
    for key, path in _IMAGE_FILES.items():
        if image.get(key) is None and path.is_file():
            image[key] = path.read_text(errors="replace").strip() or None
    return image


def observe(env: SessionEnvironment) -> dict:
    """{"gpus": {"count", "names"}, "runtime": {"python", "torch", "cuda", "cudnn", "image", "image_built", "cpu",
    "cpu_capability", "gpu_capability"}}: what the session's record keeps (relay/shared/runtime.py compares two).
    RELAY_TEST_HARDWARE replaces what it names."""
    image = _image(env)
    gpus = gpu_inventory()
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    # plain str: torch.__version__ is a TorchVersion, which a weights_only load of the books refuses
    seen = {"python": platform.python_version(), "torch": str(torch.__version__), "cuda": torch.version.cuda,
            "cudnn": str(cudnn) if cudnn else None, "image": image.get("commit"), "image_built": image.get("built"),
            "cpu": cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "gpu_capability": _gpu_capability()}
    told = env.hardware or {}
    if "gpus" in told:
        gpus = {"count": len(told["gpus"]), "names": list(told["gpus"])}
    seen.update({k: told[k] for k in seen if k in told})
    return {"gpus": gpus, "runtime": seen}


def accelerator_mismatch(shape: Optional[str], gpus: dict, env: SessionEnvironment) -> Optional[str]:
    """Why these GPUs are not what `shape` asks for (relay/shared/accelerators.py), or None: they are, no shape
    is asked for, or the session does not run where the spec's shape applies."""
    applies = env.hardware is not None or (env.kaggle_kernel and not env.emulator)
    return accelerators.mismatch(shape, gpus["names"]) if shape and applies else None
