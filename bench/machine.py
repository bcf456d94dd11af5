"""The machine a benchmark ran on, printed with every bench output and stored in results.json: timings mean
nothing without it (machines differ 2-5x, and a shared machine's load changes its figures)."""
from __future__ import annotations

import datetime
import os
import platform
import statistics


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    import torch

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"host": platform.node(), "cpu": cpu_model(), "cores": os.cpu_count(), "usable_cores": usable,
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "os": f"{platform.system()} {platform.release()}",
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def describe(m: dict | None = None) -> str:
    m = m or machine()
    return (f"machine: {m['cpu']}, {m['cores']} cores ({m['usable_cores']} usable), torch {m['torch']}, "
            f"Python {m['python']}, {m['os']}, load average {m['load_average']} at {m['utc']}")


def spread(samples: list) -> dict:
    """Median and spread (min, max, and the interquartile range where there are >= 4 samples)."""
    s = sorted(samples)
    out = {"median": statistics.median(s), "min": s[0], "max": s[-1]}
    if len(s) >= 4:
        q = statistics.quantiles(s, n=4)
        out["p25"], out["p75"] = q[0], q[2]
    return out


def bench_device(name: str):
    """The torch device a step bench runs on, with the machine printed: one torch thread on a CPU (the step's work is
    the host's there, and a shared machine's other cores would vary it), the GPU's name on CUDA."""
    import torch

    device = torch.device(name)
    if device.type == "cpu":
        torch.set_num_threads(1)
    print(describe(), flush=True)
    if device.type == "cuda":
        print(torch.cuda.get_device_name(device), "torch", torch.__version__, flush=True)
    return device
