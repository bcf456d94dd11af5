"""Where the relay's step waits on the GPU: host-device syncs per step, by source line (issue 48, CUDA only).

torch.cuda.set_sync_debug_mode("warn") warns at each synchronizing CUDA call (`.item()`, `float(t)`, a copy to
the host, a nonzero); this counts them by the innermost relay line above the call, for
  builtin  the built-in loop (`run_session`, bench_loop.py's toy MLP spec, STEPS steps, log every 50, an eval
           and the final save at the end)
  session  the Session API (`open_session`, `batches`, `step_done(loss=loss.detach())`, log_every 10)
A step should sync only where a value is needed on the host (log steps, a save, the eval); a line counted about
once per step is a sync inside the step. Run on a GPU: `python bench/gpu_syncs.py [--steps N]` (~20 s).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

import torch  # noqa: E402
from torch import nn  # noqa: E402

RELAY_DIR = str(REPO / "relay")


def _count(fn) -> collections.Counter:
    """Run fn with sync warnings on; the Counter of 'relay file:line' (else the innermost frame) per sync."""
    sites: collections.Counter = collections.Counter()
    shown = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return shown(message, category, filename, lineno, file, line)
        frames = traceback.extract_stack()[:-1]
        mine = [f for f in frames if f.filename.startswith(RELAY_DIR)]
        f = mine[-1] if mine else frames[-1]
        sites[f"{os.path.relpath(f.filename, REPO)}:{f.lineno} {f.name}"] += 1

    warnings.showwarning = record
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = shown
    return sites


def builtin(steps: int, work: Path) -> None:
    import bench_loop

    bench_loop.time_relay(steps, work / "builtin", device="cuda")


def session(steps: int, work: Path) -> None:
    import relay

    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x, y = torch.randn(512, 1024, device="cuda"), torch.randn(512, 1, device="cuda")
    s = relay.open_session(total_steps=steps, workdir=str(work / "session"), save_every=1e12, safety_margin=0.0,
                           log_every=10)
    s.register(model=model, optimizer=opt)
    s.restore()
    for _ in s.batches(512 * 8, 512):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        s.step_done(loss=loss.detach())
    s.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_syncs.py: no CUDA device here (sync debug mode is CUDA's)")
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in (("builtin", builtin), ("session", session)):
            fn(20, Path(tmp) / "warm")  # kernels, handles and imports outside the count
            sites = _count(lambda: fn(a.steps, Path(tmp)))
            total = sum(sites.values())
            print(f"{name}: {total} syncs in {a.steps} steps ({total / a.steps:.2f} a step)", flush=True)
            for site, n in sites.most_common(12):
                print(f"  {n:6d}  {site}")


if __name__ == "__main__":
    main()
