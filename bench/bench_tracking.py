"""Benchmark: what TensorBoard tracking costs a Session API loop (docs/tracking.md).

The loop of bench/bench_byo.py (MLP 64 -> 512 -> 512 -> 1, AdamW + LambdaLR, batch 64, one torch thread) under
`relay.open_session`, twice in one process, rounds alternating (ABAB...) after a warm-up:
    off  tracking off (metrics.jsonl every 10 steps, as always)
    on   `tracking={"tensorboard": True}`: every log record also written as TensorBoard scalars (loss, lr,
         samples/s, epoch) by torch's SummaryWriter, whose writer thread's CPU counts too (process CPU time)
The run's length is sized from a step time measured in the same run (~`target_s` CPU seconds a run: shorter
runs put this shared machine's noise above the 2 % asked). Periodic saves are off in both (a save flushes the
writer: once per save, not per step). Figure: median over rounds of (on CPU s / off CPU s), time.process_time;
goal <= 1.02. Also the tracker's own cost per logged record, alone.
Run: `python bench/bench_tracking.py [--repeats N --target-s S]` or `bench/run.py --only tracking`.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402

from bench_byo import _setup, _train_step  # noqa: E402

TARGET = 1.02


def loop(steps: int, workdir: Path, tensorboard: bool) -> float:
    import relay

    shutil.rmtree(workdir, ignore_errors=True)
    session = relay.open_session(total_steps=steps, workdir=str(workdir), save_every=1e9, log_every=10,
                                 tracking={"tensorboard": tensorboard})
    x, y, model, opt, sched = _setup()
    session.register(model=model, optimizer=opt, scheduler=sched)
    session.restore()
    t0 = time.process_time()
    for idx in session.batches(len(x), 64):
        session.step_done(loss=_train_step(model, opt, sched, x[idx], y[idx]))
    seconds = time.process_time() - t0
    session.close()
    return seconds


def record_cost(records: int = 5000) -> float:
    """Microseconds of CPU per train record the TensorBoard tracker writes (4 scalars), flush included."""
    from relay.kernel.session.tracking import Trackers

    work = Path(tempfile.mkdtemp(prefix="bench-tracking-rec-"))
    trackers = Trackers({"tensorboard": True}, work)
    trackers.start(0, {})
    t0 = time.process_time()
    for step in range(records):
        trackers.log({"kind": "train", "step": step, "epoch": 0, "loss": 0.5, "lr": 1e-3, "samples_per_s": 900.0})
    trackers.close()
    seconds = time.process_time() - t0
    shutil.rmtree(work, ignore_errors=True)
    return seconds / records * 1e6


def run(repeats: int = 7, target_s: float = 1.5) -> dict:
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="bench-tracking-"))
    loop(20, work / "warm-off", False), loop(20, work / "warm-on", True)
    step_s = loop(100, work / "calibrate", False) / 100  # this run's step time sizes the work
    steps = max(200, int(target_s / step_s) // 10 * 10)
    off, on = [], []
    for i in range(repeats):
        for tb in ((False, True) if i % 2 == 0 else (True, False)):
            (on if tb else off).append(loop(steps, work / f"r{i}-{tb}", tb))
    shutil.rmtree(work, ignore_errors=True)
    ratio = statistics.median(b / a for a, b in zip(off, on))  # per round: load changes between rounds cancel
    out = {"tracking_steps": steps, "tracking_repeats": repeats, "tracking_step_ms": round(step_s * 1e3, 3),
            "tracking_off_cpu_s": round(statistics.median(off), 3), "tracking_on_cpu_s": round(statistics.median(on), 3),
            "tracking_tb_over_off": round(ratio, 4), "tracking_ratio_spread": round(max(b / a for a, b in zip(off, on))
                                                                                    - min(b / a for a, b in zip(off, on)), 4),
            "tracking_record_us": round(record_cost(), 1), "tracking_target": TARGET,
            "tracking_meets_target": ratio <= TARGET}
    # what the tracker alone predicts: one record every log_every (10) steps, against this run's step time
    out["tracking_record_share_of_step"] = round(out["tracking_record_us"] * 1e-6 / 10 / step_s, 5)
    return out


def format_lines(f: dict) -> list[str]:
    return [f"TensorBoard tracking on a Session API loop ({f['tracking_steps']} steps of {f['tracking_step_ms']} ms,"
            f" {f['tracking_repeats']} alternating rounds, one thread; process CPU): {f['tracking_on_cpu_s']} s on vs"
            f" {f['tracking_off_cpu_s']} s off: {f['tracking_tb_over_off']:.3f}x (spread"
            f" {f['tracking_ratio_spread']}; target <= {f['tracking_target']})"
            f"  {'OK' if f['tracking_meets_target'] else 'MISSED'}",
            f"  the tracker alone: {f['tracking_record_us']} us per logged record, one every 10 steps:"
            f" {100 * f['tracking_record_share_of_step']:.2f} % of a step"]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--target-s", type=float, default=1.5)
    a = ap.parse_args()
    figures = run(a.repeats, a.target_s)
    print("\n".join(format_lines(figures)))
    print(json.dumps(figures, indent=1))
