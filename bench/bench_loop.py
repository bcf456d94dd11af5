"""Benchmark 1: per-step overhead of relay's loop vs a minimal hand-written PyTorch loop vs HF Trainer.

The same work in all three, in one process, one torch thread: the toy recipe's MLP (64 -> 512 -> 512 -> 1,
GELU, dropout 0.1; ~300k parameters), 8192 generated samples, AdamW (lr 1e-3, weight decay 0.01), linear
schedule with 10 warm-up steps, gradient clipping at 1.0, micro-batch 32 x accumulation 2, `STEPS` optimizer
steps, shuffled map-style data through a DataLoader with 0 workers.

What is timed is the training only, equally for all three (CPU seconds of the process, which is what the
ratios use, and wall seconds, both reported); process start-up, imports, data generation and
model construction are outside every timing:
  relay         `relay.kernel.run.run_session` (budget none, periodic saves effectively off, no best save,
                eval only at the last step on 8 samples); the time of `Trainer.fit()`, i.e. every optimizer
                step with relay's data loading, deadline checks, logging and tqdm, plus the final tiny eval
  hand-written  the loop below, from the first batch to the last optimizer step, with the fused AdamW the relay
                builds (so the ratio is the loop's own cost, not the fused optimizer's gain over torch's default)
  HF Trainer    `transformers.Trainer.train()` between the `on_train_begin` and `on_train_end` callbacks
                (no saving, no eval, logging every 50 steps, tqdm off)
Rounds rotate the order (each loop runs first, second and third equally often); the ratios are medians of
per-round ratios (relay and the other loop of the same round ran back to back, under the same load), with
their spread (min-max); one warm-up round is dropped.
`--device cuda` (on a GPU; `bash bench/gpu_check.sh OUT loop`): the same three loops on the GPU, where this small
model's step is short, so whatever a loop adds on the host shows: the model and every batch on the device (pinned
host memory, non-blocking copies, as the relay does), a CUDA sync at each timing's ends; the ratios
use wall seconds there (a process waiting on the GPU spins, so its CPU seconds are its wall seconds).
`--hidden 8`: the MLP shrunk until a step is nearly all host work (collation, launches, the loop's Python), as a
launch-bound GPU step is: what a loop adds on the host shows in full, on a CPU too.
Run: `python bench/bench_loop.py [--steps N --repeats N] [--device cuda] [--hidden N]`; `run()` returns the
named figures.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

try:
    import relay  # noqa: F401
except ImportError:  # run as a script from a checkout without an installed package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from machine import describe, spread  # noqa: E402  (bench/machine.py)
from sandbox import environment  # noqa: E402  (bench/sandbox.py: the variables as they were, after)
from torch import nn

from relay.kernel.recipes.toy import ToyParams, ToyRecipe
from relay.kernel.run import run_session
from relay.kernel import trainer as loop_mod
from relay.shared import spec as spec_mod
from relay.shared.environment import DEVICE

TARGET_VS_HAND = 1.05
TARGET_VS_HF = 1.0
MICRO, ACCUM, LR, WD, WARMUP, CLIP, SEED = 32, 2, 1e-3, 0.01, 10, 1.0, 0
PARAMS = dict(n_train=8192, n_eval=8, features=64, hidden=512, dropout=0.1)


def _recipe() -> ToyRecipe:
    recipe = ToyRecipe(ToyParams(**PARAMS), data_dir=Path("."), cache_dirs=[], seed=SEED)
    recipe.prepare()
    return recipe


# -- relay -----------------------------------------------------------------------------------------
def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_relay(steps: int, workdir: Path, device: str = "cpu") -> tuple[float, float]:
    spec = spec_mod.validate({
        "name": "bench-loop", "recipe": "toy", "seed": SEED, "params": PARAMS,
        "optim": {"micro_batch": MICRO, "grad_accum": ACCUM, "lr": LR, "weight_decay": WD, "precision": "fp32",
                  "schedule": "linear", "warmup_steps": WARMUP, "clip_grad_norm": CLIP, "max_steps": steps,
                  "eval_every_steps": steps, "log_every_steps": 50},
        "data": {"num_workers": 0},
        "session": {"threads": 1, "save_every": "1000h", "safety_margin": 0, "memory_log_every_steps": 10**6,
                    "empty_cache_every_steps": None},
        "checkpoints": {"keep_best": False},
    })
    timings = []
    real_fit = loop_mod.Trainer.fit

    def timed_fit(self):
        _sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            return real_fit(self)
        finally:
            _sync(device)
            timings.append((time.perf_counter() - t0, time.process_time() - c0))

    loop_mod.Trainer.fit = timed_fit
    try:
        with environment(**{DEVICE: device}):  # the session's device: the other loops' (else CUDA wherever there is)
            progress = run_session(spec, workdir)  # the spec has no session.budget: none
    finally:
        loop_mod.Trainer.fit = real_fit
    assert progress["status"] == "done" and progress["global_step"] == steps
    return timings[0]


# -- hand-written ------------------------------------------------------------------------------------
def time_hand(steps: int, device: str = "cpu") -> tuple[float, float]:
    recipe = _recipe()
    torch.manual_seed(SEED)
    model = recipe.build_model().to(device)
    cuda = device == "cuda"
    loader = torch.utils.data.DataLoader(recipe.train_dataset(), batch_size=MICRO, shuffle=True, drop_last=True,
                                         collate_fn=recipe.collate, generator=torch.Generator().manual_seed(SEED),
                                         pin_memory=cuda)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)  # as the relay builds it
    sched = torch.optim.lr_scheduler.LambdaLR(opt, loop_mod.lr_lambda("linear", WARMUP, steps))
    model.train()
    _sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    step, micro, batches = 0, 0, iter(loader)
    while step < steps:
        try:
            batch = next(batches)
        except StopIteration:
            batches = iter(loader)
            continue
        x, y = batch["x"].to(device, non_blocking=True), batch["y"].to(device, non_blocking=True)
        loss = nn.functional.mse_loss(model(x), y)
        (loss / ACCUM).backward()
        micro += 1
        if micro == ACCUM:
            nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            micro, step = 0, step + 1
    _sync(device)
    return time.perf_counter() - t0, time.process_time() - c0


# -- HF Trainer --------------------------------------------------------------------------------------
class _WithLoss(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        return {"loss": nn.functional.mse_loss(self.model(x), y)}


class _Items(torch.utils.data.Dataset):
    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        x, y = self.ds[i]
        return {"x": x, "y": y}


def _stack(items: list[dict]) -> dict:
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


def time_hf(steps: int, workdir: Path, device: str = "cpu") -> tuple[float, float]:
    import transformers
    from transformers import Trainer, TrainerCallback, TrainingArguments

    transformers.logging.set_verbosity_error()
    recipe = _recipe()
    torch.manual_seed(SEED)
    model = _WithLoss(recipe.build_model())
    marks: dict[str, float] = {}

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            _sync(device)
            marks["begin"], marks["cpu_begin"] = time.perf_counter(), time.process_time()

        def on_train_end(self, args, state, control, **kw):
            _sync(device)
            marks["end"], marks["cpu_end"] = time.perf_counter(), time.process_time()

    args = TrainingArguments(
        output_dir=str(workdir), per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUM,
        max_steps=steps, learning_rate=LR, weight_decay=WD, warmup_steps=WARMUP, lr_scheduler_type="linear",
        max_grad_norm=CLIP, logging_steps=50, save_strategy="no", eval_strategy="no", report_to=[],
        use_cpu=device == "cpu", disable_tqdm=True, dataloader_num_workers=0, dataloader_drop_last=True, seed=SEED,
        remove_unused_columns=False,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_Items(recipe.train_dataset()),
                      data_collator=_stack, callbacks=[Clock()])
    result = trainer.train()
    assert result.global_step == steps
    return marks["end"] - marks["begin"], marks["cpu_end"] - marks["cpu_begin"]


# -- driver ------------------------------------------------------------------------------------------
def run(steps: int = 400, repeats: int = 5, workdir: Path | None = None, device: str = "cpu",
        hidden: int = PARAMS["hidden"]) -> dict:
    global PARAMS
    PARAMS = {**PARAMS, "hidden": hidden}
    torch.set_num_threads(1)
    logging.getLogger("relay").setLevel(logging.WARNING)
    os.environ.setdefault("TQDM_DISABLE", "1")  # relay's bar still runs its code path; nothing is printed
    import transformers  # noqa: F401  (imported before any timing)

    wall: dict[str, list[float]] = {"relay": [], "hand": [], "hf": []}
    cpu: dict[str, list[float]] = {"relay": [], "hand": [], "hf": []}
    with tempfile.TemporaryDirectory(dir=workdir, prefix="bench-loop-") as tmp:
        tmp = Path(tmp)
        for r in range(repeats + 1):
            fns = [("relay", lambda: time_relay(steps, tmp / f"relay{r}", device)),
                   ("hand", lambda: time_hand(steps, device)), ("hf", lambda: time_hf(steps, tmp / f"hf{r}", device))]
            k = r % 3
            for name, fn in fns[k:] + fns[:k]:
                w, c = fn()
                if r:  # round 0 warms up allocators, the dynamo import, transformers' lazy modules
                    wall[name].append(w)
                    cpu[name].append(c)
    figures = {
        "loop_device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "loop_steps": steps,
        "loop_hidden": hidden,
        "loop_repeats": repeats,
        "loop_samples_per_step": MICRO * ACCUM,
        "loop_target_vs_hand": TARGET_VS_HAND,
        "loop_target_vs_hf": TARGET_VS_HF,
    }
    # CPU seconds of this process (one torch thread, no loader workers) are the work each loop does, robust
    # to other tenants of a shared machine preempting us: the ratios use them. Wall seconds are what a user
    # would see on this machine at this moment. On CUDA the unsuffixed ratios are of wall seconds too (a process
    # waiting on the GPU spins: its CPU seconds say nothing the wall does not).
    primary = wall if device == "cuda" else cpu
    for samples, seconds, rate, ratio in ((cpu, "cpu_s", "steps_per_cpu_s", "_cpu"), (wall, "s", "steps_per_s", "_wall"),
                                          (primary, None, None, "")):
        medians = {name: statistics.median(v) for name, v in samples.items()}
        for name in ("relay", "hand", "hf") if seconds else ():
            figures[f"loop_samples_{name}_{seconds}"] = [round(x, 3) for x in samples[name]]
            figures[f"loop_{name}_{seconds}"] = round(medians[name], 3)
            figures[f"loop_{name}_{rate}"] = round(steps / medians[name], 1)
        for other in ("hand", "hf"):
            # paired: each round's relay time over the same round's other loop (run back to back, so under
            # the same load), then the median and spread of those ratios
            paired = spread([a / b for a, b in zip(samples["relay"], samples[other])])
            figures[f"loop_relay_vs_{other}{ratio}"] = round(paired["median"], 3)
            figures[f"loop_relay_vs_{other}{ratio}_spread"] = [round(paired["min"], 3), round(paired["max"], 3)]
    figures["loop_meets_target"] = (figures["loop_relay_vs_hand"] <= TARGET_VS_HAND
                                    and figures["loop_relay_vs_hf"] < TARGET_VS_HF)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--hidden", type=int, default=PARAMS["hidden"], help="the MLP's width (8: host-bound)")
    args = parser.parse_args(argv)
    figures = run(args.steps, args.repeats, device=args.device, hidden=args.hidden)
    print(json.dumps(figures, indent=1))
    print(describe())
    return 0 if figures["loop_meets_target"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
