"""The divergence guard's calibration: no false stop on the project's own runs, a real divergence stopped.

    python bench/bench_divergence.py [--only legal-tiny,byo-plain] [--inject-at 0.5] [--jump 100]

1. Every built-in recipe's tiny and demo spec and every CPU-feasible `examples/byo-*` run is trained to its end in
   one session (`relay train SPEC --budget none --max-steps none`) with the guard on (the default). Reported per
   run: the stop reason (a false stop is any other than `done`), the steps, and the headroom: the highest the
   smoothed loss came to the guard's bar, as a fraction of the way from its best to the bar (1.0 would stop);
   and where the rule before this guard (10x the median, 3 steps) would have stopped the same losses.
2. The same runs with the learning rate multiplied by `--jump` (a global optimizer step hook, so the recipe's
   and the user's own optimizers alike) from `--inject-at` of the longest phase on (one model, one curriculum
   stage: see `jump_step`): the steps from the jump to the stop, or "missed".
Sized in steps, never in seconds: the outcome is the same on any machine. Each run is its own process (recipes
set process-wide state); the guard's decisions are read from a trace of the losses it was given.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GENERATOR = {"legal": "legal", "price": "price-model", "vqa": "vqa", "temporal": "temporal", "recsys": "recsys"}
DATA = {  # (recipe, size): the `relay data` options; "demo" are the demo's and the tests' sets
    ("legal", "demo"): ["--train", "1200", "--val", "200"],
    ("price", "demo"): ["--train", "1200", "--test", "200"],
    ("vqa", "demo"): [],
    ("temporal", "demo"): ["--rows", "3000"],
    ("recsys", "demo"): ["--ratings", "20000", "--users", "600", "--items", "400"],
    **{(r, "default"): [] for r in GENERATOR},  # what `relay data <recipe> --out DIR` makes
}
RUNS = {f"{r}-{spec}" + ("" if size == "demo" else "@default-data"): (f"examples/{r}-{spec}.yaml", (r, size))
        for r in GENERATOR for spec, size in (("tiny", "demo"), ("tiny", "default"), ("demo", "demo"))}
RUNS.update({name: (f"examples/{name}/spec.yaml", None) for name in ("byo-plain", "byo-hf", "byo-lightning",
                                                                      "byo-recipe")})


def _child(spec: str, workdir: str, data: str, trace: str, inject_at: int, jump: float) -> None:
    """One run in this process: the guard's input recorded, the learning rate jumped from step `inject_at`."""
    from torch.optim import optimizer

    from relay.kernel.session import divergence

    seen: list = []
    update = divergence.DivergenceGuard.update

    def recording(self, step, loss, phase=None):
        why = update(self, step, loss, phase)
        seen.append([step, float(loss), phase, why])
        return why

    divergence.DivergenceGuard.update = recording
    if inject_at >= 0:
        def pre(opt, *_):
            if len(seen) >= inject_at:
                for group in opt.param_groups:
                    group["lr"] = group["lr"] * jump

        def post(opt, *_):
            if len(seen) >= inject_at:
                for group in opt.param_groups:
                    group["lr"] = group["lr"] / jump
        optimizer.register_optimizer_step_pre_hook(pre)
        optimizer.register_optimizer_step_post_hook(post)
    from relay.cli import main

    args = ["train", spec, "--workdir", workdir, "--budget", "none", "--max-steps", "none"]
    rc = main(args + (["--data", data] if data else []))
    progress = json.loads((Path(workdir) / "progress.json").read_text())
    Path(trace).write_text(json.dumps({"rc": rc, "stop_reason": progress.get("stop_reason"),
                                       "step": progress.get("global_step"), "trace": seen}))


def _run(name: str, root: Path, inject_at: int, jump: float) -> dict:
    spec, data_set = RUNS[name]
    data = ""
    if data_set:
        data = str(root / "data" / "-".join(data_set))
        if not Path(data).exists():
            subprocess.run([sys.executable, "-m", "relay", "data", GENERATOR[data_set[0]], "--out", data,
                            *DATA[data_set]], check=True, cwd=REPO, capture_output=True)
    tag = f"{name}-{inject_at}"
    trace = root / f"{tag}.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    done = subprocess.run([sys.executable, __file__, "--child", str(REPO / spec), str(root / tag), data, str(trace),
                           str(inject_at), str(jump)], cwd=REPO / Path(spec).parent, env=env, capture_output=True,
                          text=True)
    if done.returncode or not trace.exists():
        raise RuntimeError(f"{name}: the run failed\n{done.stderr[-3000:]}")
    return json.loads(trace.read_text())


def headroom(trace: list) -> float:
    """Replays the guard on the recorded losses: the highest (smoothed - best) / (bar - best) of the run."""
    from relay.kernel.session.divergence import DivergenceGuard

    guard, top = DivergenceGuard(), 0.0
    for step, loss, phase, _ in trace:
        guard.update(step, loss, phase)
        bar, h = guard.bar(), guard.h
        if bar is not None and bar > h.best:
            top = max(top, (h.smoothed - h.best) / (bar - h.best))
    return top


def jump_step(trace: list, fraction: float) -> int | None:
    """Where to jump the learning rate: at `fraction` of the longest phase (one model, one curriculum stage: the
    guard judges within one), but early enough to leave it 2 spans (the stated bound), and at least 10 steps after
    the guard's warmup; None when no phase is that long (a few fit steps, VQA's 60-step tiny stages)."""
    from relay.kernel.session.divergence import DivergenceGuard

    span = DivergenceGuard().span
    phases: dict = {}
    for i, (_, _, phase, _) in enumerate(trace):
        phases.setdefault(phase, []).append(i)
    if not phases:  # the HF Trainer's callback hands the relay no per-step loss: nothing is judged
        return None
    longest = max(phases.values(), key=len)
    first, last = longest[0], longest[-1]
    at = min(first + int((last - first) * fraction), last + 1 - 2 * span)
    return at if at >= first + span + 10 else None


def median_rule_stop(trace: list) -> int | None:
    """Where the guard before this one would have stopped: a loss over 10x the median of the last 50 kept
    losses, 3 steps in a row (after 20), each session starting a new window; here one uninterrupted session."""
    import statistics

    kept, strikes = [], 0
    for step, loss, _, _ in trace:
        high = len(kept) >= 20 and loss > 10 * statistics.median(kept[-50:])
        strikes = strikes + 1 if high else 0
        if not high:
            kept.append(loss)
        if strikes >= 3:
            return step
    return None


def worse_than_untrained(jumped: list, at: int) -> bool:
    """Whether the jump made the smoothed loss worse than where the phase started (the guard's `start`: an
    untrained model's loss) for a span: a blow-up by any definition, which the guard must stop. A jump that only
    costs the model what it learned leaves the loss between best and start, where a run whose gain is below
    its noise cannot be told from a healthy one (docs/relay.md says what the guard misses)."""
    from relay.kernel.session.divergence import DivergenceGuard

    guard, above = DivergenceGuard(), 0
    for i, (step, loss, phase, _) in enumerate(jumped):
        guard.update(step, loss, phase)
        h = guard.h
        worse = i >= at and h.start is not None and h.smoothed > h.start
        above = above + 1 if worse else 0
        if above >= guard.span or (i >= at and h.n == 0):  # n == 0: the guard stopped and began a new history
            return True
    return False


def run(only: list[str] | None = None, inject_at: float = 0.5, jump: float = 100.0) -> dict:
    figures, root = {}, Path(tempfile.mkdtemp(prefix="bench-divergence-"))
    for name in only or list(RUNS):
        clean = _run(name, root, -1, jump)
        steps = len(clean["trace"])
        row = {"stop": clean["stop_reason"], "steps": clean["step"], "guarded_steps": steps,
               "headroom": round(headroom(clean["trace"]), 3), "median_rule_stop": median_rule_stop(clean["trace"])}
        at = jump_step(clean["trace"], inject_at)
        if at is not None:
            hit = _run(name, root, at, jump)
            stopped = [s for s, _, _, why in hit["trace"] if why]
            # the (at+1)-th optimizer step is the first one jumped: the guard's step counts steps done
            row.update(jump_at=at + 1, stopped_after=(stopped[0] - at - 1) if stopped else None,
                       jumped_stop=hit["stop_reason"], blew_up=worse_than_untrained(hit["trace"], at))
        figures[name] = row
        print(f"{name:16s} {json.dumps(row)}", flush=True)
    false_stops = [n for n, r in figures.items() if r["stop"] != "done"]
    # the target: no false stop, and every jump that made the loss worse than untrained stopped
    missed = [n for n, r in figures.items() if r.get("blew_up") and r["stopped_after"] is None]
    delays = [r["stopped_after"] for r in figures.values() if r.get("stopped_after") is not None]
    summary = {"divergence_false_stops": len(false_stops), "divergence_missed": len(missed),
               "divergence_max_steps_to_stop": max(delays) if delays else None,
               "divergence_max_headroom": max(r["headroom"] for r in figures.values()), "divergence_lr_jump": jump}
    summary["divergence_meets_target"] = not false_stops and not missed
    return {**summary, "divergence_runs": figures}


def format_lines(f: dict) -> list[str]:
    x = f"lr x{f['divergence_lr_jump']:g}"
    lines = [f"divergence guard (each run to its end in one session, guard on; then the {x} from mid-phase):"]
    for name, r in f["divergence_runs"].items():
        jumped = (f"{x} at step {r['jump_at']}: stopped {r['stopped_after']} steps later" if r.get("stopped_after")
                  is not None else f"{x}: MISSED" if r.get("blew_up") else
                  f"{x} at step {r['jump_at']}: not stopped, its loss stayed between its best and its start"
                  if "jump_at" in r else "not judged: no per-step loss" if not r["guarded_steps"]
                  else "too short to judge a jump")
        old = f", the old 10x-median rule stopped it at {r['median_rule_stop']}" if r["median_rule_stop"] else ""
        lines.append(f"  {name:24s} {r['stop']} at {r['steps']} (headroom {r['headroom']:.2f}{old}); {jumped}")
    lines.append(f"  false stops {f['divergence_false_stops']}, missed {f['divergence_missed']}, slowest stop"
                 f" {f['divergence_max_steps_to_stop']} steps after the jump  {'OK' if f['divergence_meets_target'] else 'MISSED'}")
    return lines


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6]), float(sys.argv[7]))
        sys.exit(0)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated runs: " + ", ".join(RUNS))
    ap.add_argument("--inject-at", type=float, default=0.5, help="the jump's step, as a fraction of the run")
    ap.add_argument("--jump", type=float, default=100.0, help="the learning rate's factor from then on")
    a = ap.parse_args()
    out = run(a.only.split(",") if a.only else None, a.inject_at, a.jump)
    print("\n".join(format_lines(out)))
    sys.exit(0 if out["divergence_meets_target"] else 1)
