"""Data-parallel sessions on this CPU: samples/s with 2 processes vs 1 (informative: 2 cores here, so 2 ranks
share them), and the synchronisation a rank pays per optimizer step (the flags all-reduce, the loss and the
gradient all-reduce) measured alone, in the same run.

Run: `python bench/bench_ddp.py [--steps N --repeats N]`; `run()` returns the named figures.
On a GPU machine the comparable figure is the price model's real-size step at world size 1 vs the single-process
path; a 2-GPU scaling figure needs a 2-GPU machine (a Kaggle T4 x2 session).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]

SPEC = {
    "name": "bench-ddp", "recipe": "toy", "seed": 0,
    "params": {"n_train": 4096, "n_eval": 64, "features": 64, "hidden": 512, "dropout": 0.1},
    "optim": {"micro_batch": 32, "grad_accum": 2, "lr": 1e-3, "log_every_steps": 50, "eval_every_steps": 100000},
    "data": {"num_workers": 0},
    "session": {"threads": 1, "save_every": "1h", "safety_margin": 0},
    "checkpoints": {"keep_best": False},
}


def _train(devices: int, steps: int, root: Path) -> float:
    """Samples/s of a session of `steps` optimizer steps (training only, as the session records it)."""
    spec = dict(SPEC, optim=dict(SPEC["optim"], max_steps=steps), session=dict(SPEC["session"], devices=devices))
    path = root / f"spec-{devices}.yaml"
    path.write_text(yaml.safe_dump(spec))
    workdir = Path(tempfile.mkdtemp(dir=root))
    env = dict(os.environ, PYTHONPATH=str(REPO), RELAY_DEVICE="cpu", OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "relay", "train", str(path), "--workdir", str(workdir), "--budget", "none",
                    "--max-steps", "none"], env=env, check=True, capture_output=True, cwd=root)
    return json.loads((workdir / "progress.json").read_text())["sessions"][0]["samples_per_s"]


def _sync_worker(rank: int, world_size: int, port: int, errors, iters: int, out: str) -> None:
    import torch

    from relay.kernel.recipes.toy import ToyParams, ToyRecipe
    from relay.kernel.session import distributed

    torch.set_num_threads(1)
    world = distributed.init(rank, world_size, port, "cpu")
    params = ToyParams(**SPEC["params"])
    model = ToyRecipe(params, data_dir=Path("."), cache_dirs=[], seed=0).build_model()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    device = torch.device("cpu")
    for _ in range(10):  # warm-up
        distributed.agree(world, [0, 0, 0, 0], device)
    t0 = time.perf_counter()
    for _ in range(iters):
        distributed.agree(world, [0, 0, 0, 0], device)  # the stop/save flags
        distributed.agree(world, [0, 1.0], device)  # OOM flag and loss
        distributed.average_gradients(model, world)
    seconds = (time.perf_counter() - t0) / iters
    if rank == 0:
        Path(out).write_text(json.dumps({"sync_s": seconds, "params": sum(p.numel() for p in model.parameters())}))
    distributed.shutdown(world)


def run(steps: int = 300, repeats: int = 3, sync_iters: int = 200) -> dict:
    from relay.kernel.session import distributed

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        one, two = [], []
        for _ in range(repeats):  # alternating, so load drifts hit both alike
            one.append(_train(1, steps, root))
            two.append(_train(2, steps, root))
        out = root / "sync.json"
        distributed.launch(_sync_worker, 2, (sync_iters, str(out)))
        sync = json.loads(out.read_text())
    step_s_one = SPEC["optim"]["micro_batch"] * SPEC["optim"]["grad_accum"] / statistics.median(one)
    return {
        "ddp_steps": steps, "ddp_repeats": repeats, "ddp_params": sync["params"],
        "ddp_samples_per_s_1proc": round(statistics.median(one), 1),
        "ddp_samples_per_s_2proc": round(statistics.median(two), 1),
        "ddp_2proc_vs_1proc": round(statistics.median(two) / statistics.median(one), 3),
        "ddp_spread_1proc": [round(min(one), 1), round(max(one), 1)],
        "ddp_spread_2proc": [round(min(two), 1), round(max(two), 1)],
        "ddp_sync_ms_per_step": round(1000 * sync["sync_s"], 3),
        "ddp_sync_vs_1proc_step": round(sync["sync_s"] / step_s_one, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps(run(args.steps, args.repeats), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
