"""What each part of the Session API's step costs inside a real training loop (issue 48): the documented loop with one
part of the relay's bookkeeping switched off at a time, against the hand-written loop that draws the same batches.

    python bench/session_ablation.py [--device cpu|cuda] [--only tiny,mlp] [--steps N] [--rounds 7]

Loops (bench_step_overhead.py's models, a fresh batch of noise each step), in turns of TURN steps inside each round
(bench_step_overhead.in_turns: who goes first
rotates, a CUDA sync at each turn's ends) so that a change in the machine's speed falls on all alike:
    hand, hand2    the hand-written loop drawing its batches (an epoch's randperm, a tensor slice a step), twice:
                   their difference is the bench's noise floor
    session        `for idx in session.batches(...): ...; session.step_done(loss=loss.detach())`, saves off
    no_log_steps   log_every 10**9: no window closed, read, judged or written
    no_batches     step_done only, no batches() (its stop check and indices)
    no_guard       the divergence guard off (stop_on_divergence=False)
    no_lines       the progress lines off (the relay-progress line the orchestrator follows)
    no_file        metrics.jsonl writes into memory (the line is still made; the system call is not)
Figure: each loop's microseconds a step above `hand` (median over rounds of the per-round difference). A part's cost is
`session` minus its row. On a CPU a real step's work evicts the caches between the relay's calls, so each costs
several times what the null step (bench_step_overhead.py) says.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import logging
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_step_overhead import TURN, _open, drawing_steps, in_turns, trainer  # noqa: E402
from machine import bench_device  # noqa: E402

LOOPS = ("hand", "session", "no_log_steps", "no_batches", "no_guard", "no_lines", "no_file", "hand2")


class _Memory(io.StringIO):
    def flush(self) -> None:  # nothing to write out
        pass


def measure(name: str, device: torch.device, steps: int, rounds: int, work: Path) -> dict:
    train_step, batch, model, opt = trainer(device, name)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def start(loop: str, r: int) -> dict:
        if loop.startswith("hand"):
            return {"i": 0, "epoch": -1}
        with contextlib.redirect_stdout(io.StringIO()):
            s = _open(work / f"{name}-{loop}-{r}", steps, 10 ** 9 if loop == "no_log_steps" else None)
        s.register(model=model, optimizer=opt)
        s.restore()
        if loop == "no_guard":
            s.step_books.guard = None
        if loop == "no_lines":
            s.core.lines = None
        if loop == "no_file":
            s.core._metrics = _Memory()  # noqa: SLF001 - the file object the session writes its lines to
        return {"s": s, "batches": None if loop == "no_batches" else iter(s.batches(8 * batch, batch))}

    def run(loop: str, state: dict, k: int) -> None:
        if loop.startswith("hand"):
            drawing_steps(k, state, batch, train_step)
            return
        s, batches = state["s"], state["batches"]
        for _ in range(k):
            if batches is not None:
                next(batches)
            s.step_done(loss=train_step().detach())

    train_step()
    sync()
    loops = {loop: (lambda k, state, loop=loop: run(loop, state, k)) for loop in LOOPS}
    per_round = []
    for r in range(rounds + 1):  # round 0 warms up, dropped
        states = {loop: start(loop, r) for loop in LOOPS}
        gc.collect()
        seconds = in_turns(loops, states, steps, sync)
        for state in states.values():
            if "s" in state:
                with contextlib.redirect_stdout(io.StringIO()):
                    state["s"].close()
        if r:
            per_round.append({loop: s * 1e6 for loop, s in seconds.items()})
    hand = statistics.median(x["hand"] for x in per_round)
    return {"hand_us": round(hand, 1),
            "above_hand_us": {loop: round(statistics.median(x[loop] - x["hand"] for x in per_round), 1)
                              for loop in LOOPS[1:]},
            "rounds_us": [{k: round(v, 1) for k, v in x.items()} for x in per_round]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--only", default="tiny", help="comma-separated subset of tiny,mlp,transformer")
    ap.add_argument("--steps", type=int, default=1000, help="steps of each loop a round")
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    logging.getLogger("relay").setLevel(logging.WARNING)
    os.environ.pop("RELAY_SESSION", None)  # run by hand: the arguments here, not a relay's settings
    device = bench_device(a.device)
    out = {}
    # the sessions' relay-progress lines (due at a session's first line, then every 30 s) to /dev/null, not the report
    with tempfile.TemporaryDirectory(prefix="bench-ablation-") as work, open(os.devnull, "w") as null:
        for name in a.only.split(","):
            with contextlib.redirect_stdout(null):
                f = out[name] = measure(name, device, a.steps, a.rounds, Path(work))
            print(f"== {name}: hand-written {f['hand_us']:.1f} us a step; each loop's us a step above it (median of"
                  f" {a.rounds} rounds of {a.steps} steps, turns of {TURN}):", flush=True)
            for loop, us in f["above_hand_us"].items():
                part = "" if loop in ("session", "hand2") else \
                    f"   (that part: {f['above_hand_us']['session'] - us:+.1f} us)"
                print(f"  {loop:14s} {us:+7.1f} us  {(f['hand_us'] + us) / f['hand_us']:.3f}x{part}", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
