"""Benchmark: the recsys recipe's read path vs a plain read + dense pivot, on the same synthetic ratings.

    relay   pd.read_csv(usecols=userId,movieId,rating; int32/int32/float32) -> id maps -> float32 CSR
    plain   pd.read_csv(all columns, default int64/float64) -> pivot_table(userId x movieId) -> dense values

Each path runs in its own fresh Python process (same imports: pandas + numpy), so one path's freed memory
or allocator pools never count for the other. Peak RSS is the child's VmHWM, reset after its imports
(/proc/self/clear_refs, Linux); "above imports" subtracts the RSS at that reset: the read path's own share. The seed claims ~50 %
less memory; the target here is the ratio of the peaks above imports (<= 0.5).
Run: `python bench/bench_recsys.py [--ratings N]`; `run()` returns the named figures.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_RATIO = 0.5

CHILD = r"""
import importlib.util, json, sys, time
import numpy as np, pandas as pd
sys.path.insert(0, {root!r})
# recsys_data alone (relay.kernel.recipes/__init__ would import torch, whose import dwarfs what is measured)
spec = importlib.util.spec_from_file_location("recsys_data", {root!r} + "/relay/kernel/recipes/recsys_data.py")
recsys_data = sys.modules["recsys_data"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(recsys_data)

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak RSS (VmHWM) to the current RSS: only what follows counts
base = status("VmHWM")
t0 = time.perf_counter()
if {mode!r} == "relay":
    frame = recsys_data.read_ratings({path!r})
    users, u = np.unique(frame["userId"].to_numpy(), return_inverse=True)
    items, i = np.unique(frame["movieId"].to_numpy(), return_inverse=True)
    matrix = recsys_data.CSR.from_coo(u, i, frame["rating"].to_numpy(), (len(users), len(items)))
    del frame
    cells = matrix.nnz
else:
    frame = pd.read_csv({path!r})
    matrix = frame.pivot_table(index="userId", columns="movieId", values="rating").to_numpy()
    cells = matrix.size
seconds = time.perf_counter() - t0
print(json.dumps({{"seconds": seconds, "peak_rss_mb": status("VmHWM"), "import_rss_mb": base, "cells": int(cells)}}))
"""


def _child(mode: str, path: Path) -> dict:
    code = CHILD.format(root=str(ROOT), mode=mode, path=str(path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(n_ratings: int = 1_000_000, n_users: int = 6040, n_items: int = 3706, workdir: Path | None = None) -> dict:
    sys.path.insert(0, str(ROOT))
    from relay.kernel.recipes import recsys_data

    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        path = recsys_data.generate(tmp, n_ratings, n_users, n_items, rank=8, seed=0)
        relay, plain = _child("relay", path), _child("plain", path)
    above = lambda r: r["peak_rss_mb"] - r["import_rss_mb"]  # noqa: E731
    ratio = above(relay) / max(above(plain), 1e-9)
    return {
        "recsys_ratings": n_ratings, "recsys_users": n_users, "recsys_items": n_items,
        "recsys_relay_s": round(relay["seconds"], 3), "recsys_plain_s": round(plain["seconds"], 3),
        "recsys_relay_peak_rss_mb": round(relay["peak_rss_mb"], 1), "recsys_plain_peak_rss_mb": round(plain["peak_rss_mb"], 1),
        "recsys_relay_above_imports_mb": round(above(relay), 1), "recsys_plain_above_imports_mb": round(above(plain), 1),
        "recsys_memory_ratio": round(ratio, 3), "recsys_peak_ratio": round(relay["peak_rss_mb"] / plain["peak_rss_mb"], 3),
        "recsys_time_ratio": round(relay["seconds"] / max(plain["seconds"], 1e-9), 3),
        "recsys_target_ratio": TARGET_RATIO, "recsys_meets_target": ratio <= TARGET_RATIO,
    }


def format_lines(f: dict) -> list[str]:
    return [
        f"recsys read path ({f['recsys_ratings']} ratings, {f['recsys_users']} users x {f['recsys_items']} items; "
        "each path in its own process):",
        f"  relay (usecols + int32/float32 + CSR) {f['recsys_relay_s']} s, peak RSS {f['recsys_relay_peak_rss_mb']} MB "
        f"({f['recsys_relay_above_imports_mb']} MB above imports)",
        f"  plain (read_csv + dense pivot)        {f['recsys_plain_s']} s, peak RSS {f['recsys_plain_peak_rss_mb']} MB "
        f"({f['recsys_plain_above_imports_mb']} MB above imports)",
        f"  memory above imports {f['recsys_memory_ratio']:.3f}x (target <= {f['recsys_target_ratio']}) "
        f"{'OK' if f['recsys_meets_target'] else 'MISSED'}; whole peak {f['recsys_peak_ratio']:.3f}x; "
        f"time {f['recsys_time_ratio']:.3f}x",
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratings", type=int, default=1_000_000)
    args = parser.parse_args()
    figures = run(args.ratings)
    print("\n".join(format_lines(figures)))
    print(json.dumps(figures, indent=1))
