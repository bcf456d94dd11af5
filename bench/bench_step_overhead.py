"""Benchmark: what one Session API step costs beside the user's own work (issue 48 part 3).

CPU mode (the default): the null step. A loop that does nothing but
    for idx in session.batches(n, b): session.step_done(loss=t)          (t: a 0-dim tensor)
against a bare loop of the same length doing the same user-side nothing (`for i in range(N): loss = t`), and
`step_done` alone (`for _ in range(N): session.step_done(loss=t)`, no batches()), in one process, rounds
alternating, saves off (save_every huge), log_every at its default (50; `--log-every` sets another). Figure: the relay's per-step cost in
microseconds, (session loop - bare loop) / N, median over rounds, in process CPU time (time.process_time: the
work is all on the host, and a shared machine's load moves wall time far more).

`--device cuda`: the issue's three loops, each hand-written and under the Session API (`open_session`,
`batches`, `step_done(loss=loss.detach())`, saves off, log_every default), each step on a fresh batch of noise
made on the device, median of `--rounds` rounds of N steps, N sized from a step time measured in the same run
so that one round of one loop takes ~`--target-s` seconds:
    tiny       MLP 64-256-256-1, batch 16, fp32
    mlp        MLP 1024-4096-4096-1, batch 512, bf16 autocast
    transformer  6-layer encoder d384 (6 heads, ff 1536), seq 256, batch 32, bf16 autocast, LM head over 1000 tokens
AdamW (fused on CUDA) in all. In a round the three loops take turns of TURN steps (who goes first rotates; a CUDA
sync at each turn's ends), training the same model in turn, so a change in the machine's speed during the round
falls on all three alike: whole runs in turn moved their hand-written loop's own time by up to 30 % between rounds
on a lent H200 (issue 48). Before each round: os.sync() (the last session's checkpoint written out) and
gc.collect(). Figure: session ms/step / hand-written ms/step per round (no loss read by the hand-written loop, so
any host-device sync the relay adds shows as a ratio above 1), median and spread over rounds, against two
hand-written loops: one that draws no batch indices at all, and one that draws the same shuffled batches the way
such a loop does (an epoch's torch.randperm, a tensor slice a step), which is the loop batches() replaces.
Run: `python bench/bench_step_overhead.py [--device cuda] [--rounds 5] [--target-s 1.5]`; ~70 s on an H100 (before the turns).
The JSON line has every round's (hand, session) ms/step: rounds that disagree mean the machine was not quiet.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import logging
import os
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
from torch import nn  # noqa: E402

from machine import describe  # noqa: E402


def _open(workdir: Path, total_steps: int, log_every: int | None = None):
    import relay

    shutil.rmtree(workdir, ignore_errors=True)
    # saves off: the figure is the per-step cost, not the insurance save's (bench_checkpoint measures that)
    session = relay.open_session(total_steps=total_steps, workdir=str(workdir), save_every=1e12,
                                 safety_margin=0.0, log_every=log_every)
    return session


# -- CPU: the null step ---------------------------------------------------------------------------------------
def null_step(steps: int, rounds: int) -> dict:
    """Per-step microseconds: bare loop, step_done alone, batches() + step_done (the documented loop)."""
    work = Path(tempfile.mkdtemp(prefix="bench-step-"))
    t = torch.tensor(0.5)
    model = nn.Linear(1, 1)
    bare, done_only, full = [], [], []
    try:
        for r in range(rounds + 1):  # round 0 warms up (imports, allocator), dropped
            t0 = time.process_time()
            for _ in range(steps):
                loss = t  # noqa: F841 - the user-side nothing a null step does
            b = time.process_time() - t0

            session = _open(work / "a", steps)
            session.register(model=model)
            session.restore()
            t0 = time.process_time()
            for _ in range(steps):
                session.step_done(loss=t)
            d = time.process_time() - t0
            session.close()

            session = _open(work / "b", steps)
            session.register(model=model)
            session.restore()
            t0 = time.process_time()
            for idx in session.batches(1 << 20, 16):
                session.step_done(loss=t)
            f = time.process_time() - t0
            session.close()
            if r:
                bare.append(b / steps * 1e6)
                done_only.append(d / steps * 1e6)
                full.append(f / steps * 1e6)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = statistics.median
    return {"steps": steps, "rounds": rounds, "bare_us": round(med(bare), 3),
            "step_done_us": round(med(done_only) - med(bare), 2),
            "batches_step_done_us": round(med(full) - med(bare), 2),
            "spread_us": [round(min(full) - med(bare), 2), round(max(full) - med(bare), 2)]}


# -- CUDA: the three loops ----------------------------------------------------------------------------
class _Transformer(nn.Module):
    def __init__(self, vocab: int = 1000, d: int = 384, layers: int = 6, seq: int = 256):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        layer = nn.TransformerEncoderLayer(d, 6, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        return self.head(self.enc(self.emb(x) + self.pos))


def _models(device: torch.device) -> dict:
    """name -> (build model, make one batch (x, y), loss fn, autocast dtype or None, batch size)."""
    def mlp(*widths):
        layers = []
        for a, b in zip(widths, widths[1:]):
            layers += [nn.Linear(a, b), nn.GELU()]
        return nn.Sequential(*layers[:-1])

    mse = nn.functional.mse_loss

    def ce(out, y):
        return nn.functional.cross_entropy(out.flatten(0, 1).float(), y.flatten())

    return {
        "tiny": (lambda: mlp(64, 256, 256, 1),
                 lambda g: (torch.randn(16, 64, device=device, generator=g),
                            torch.randn(16, 1, device=device, generator=g)),
                 mse, None, 16),
        "mlp": (lambda: mlp(1024, 4096, 4096, 1),
                lambda g: (torch.randn(512, 1024, device=device, generator=g),
                           torch.randn(512, 1, device=device, generator=g)),
                lambda out, y: mse(out.float(), y), torch.bfloat16, 512),
        "transformer": (_Transformer,
                        lambda g: (torch.randint(0, 1000, (32, 256), device=device, generator=g),
                                   torch.randint(0, 1000, (32, 256), device=device, generator=g)),
                        ce, torch.bfloat16, 32),
    }


TURN = 50  # steps of one loop before the next one's turn (~0.1 s at the issue's ~2 ms steps)


def trainer(device: torch.device, name: str):
    """(one training step on a fresh batch of noise, returning its loss unread; the batch size; the model; its
    optimizer) of model `name`."""
    build, make, loss_fn, dtype, batch = _models(device)[name]
    torch.manual_seed(0)
    g = torch.Generator(device=device).manual_seed(0)
    # A fresh batch of noise each step, made on the device (no loader in any loop): the loss stays near its noise
    # floor (lr 1e-5: at 1e-4 chasing the noise lifts it ~10 % in 400 steps). Eight batches reused made the wide MLP
    # memorize them to a loss near zero within a few hundred steps, where AdamW's spikes tripped the divergence
    # guard: the session stopped, "diverged" (an H200, issue 48).
    model = build().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")

    def train_step():
        x, y = make(g)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return train_step, batch, model, opt


def in_turns(loops: dict, states: dict, steps: int, sync, first: int = 0) -> dict:
    """Seconds a step of each loop over `steps` steps, the loops taking turns of TURN steps (who goes first rotates
    from `first`; a sync at each turn's ends), so a change in the machine's speed falls on all alike. `loops`: name
    -> f(k, state) running k steps; `states`: name -> what f carries from turn to turn."""
    names, spent, done, turn = list(loops), dict.fromkeys(loops, 0.0), 0, first
    while done < steps:
        k = min(TURN, steps - done)
        for loop in names[turn % len(names):] + names[:turn % len(names)]:
            sync()
            t0 = time.perf_counter()
            loops[loop](k, states[loop])
            sync()
            spent[loop] += time.perf_counter() - t0
        done, turn = done + k, turn + 1
    return {loop: seconds / steps for loop, seconds in spent.items()}


def drawing_steps(k: int, state: dict, batch: int, train_step) -> None:
    """k steps of the hand-written loop that draws its shuffled batches itself, as such a loop does: an epoch's
    randperm, a slice of it per step (a tensor: the cheaper form; batches() gives a list). `state`: {"i": 0,
    "epoch": -1} at the start, carried from turn to turn."""
    for _ in range(k):
        e, pos = divmod(state["i"], 8)
        if e != state["epoch"]:
            state["perm"] = torch.randperm(8 * batch, generator=torch.Generator().manual_seed(e))
            state["epoch"] = e
        idx = state["perm"][pos * batch:(pos + 1) * batch]  # noqa: F841 - the batch is noise, as in the others
        train_step()
        state["i"] += 1


def gpu_loops(device: torch.device, rounds: int, target_s: float, only: list | None = None,
              log_every: int | None = None) -> dict:
    logging.getLogger("relay").setLevel(logging.WARNING)
    work = Path(tempfile.mkdtemp(prefix="bench-step-gpu-"))
    out = {}
    try:
        for name in _models(device):
            if only and name not in only:
                continue
            train_step, batch, model, opt = trainer(device, name)

            def sync():
                if device.type == "cuda":
                    torch.cuda.synchronize(device)

            def quiet():
                """Before each round: the last session's checkpoint on disk (its writeback would compete with the
                round for the host) and the garbage collected."""
                os.sync()
                gc.collect()
                sync()

            def steps_hand(k, _state):
                for _ in range(k):
                    train_step()

            def steps_drawing(k, state):
                drawing_steps(k, state, batch, train_step)

            def steps_session(k, state):
                for _ in range(k):
                    next(state["batches"])  # this step's indices (the batch itself is noise, as in the others)
                    state["session"].step_done(loss=train_step().detach())

            loops = {"hand": steps_hand, "drawing": steps_drawing, "session": steps_session}

            def round_(n, r):
                """Seconds a step of each loop over n steps, in turns (in_turns). The loops train the same model in
                turn; each step's cost does not depend on its weights."""
                with contextlib.redirect_stdout(io.StringIO()):  # the session's relay-progress lines
                    session = _open(work / f"{name}-round{r}", n, log_every)
                session.register(model=model, optimizer=opt)
                session.restore()
                states = {"hand": {}, "drawing": {"i": 0, "epoch": -1},
                          "session": {"session": session, "batches": iter(session.batches(8 * batch, batch))}}
                quiet()
                seconds = in_turns(loops, states, n, sync, first=r)
                if session.step != n:
                    raise RuntimeError(f"the session stopped at step {session.step} of {n}: {session.stop_reason}")
                with contextlib.redirect_stdout(io.StringIO()):
                    session.close()  # its final save is outside the timing
                return seconds

            steps_hand(10, None)  # kernels, cuBLAS handles, the optimizer state
            sync()
            t0 = time.perf_counter()
            steps_hand(5, None)
            sync()
            probe = (time.perf_counter() - t0) / 5
            n = max(2 * TURN, int(target_s / max(probe, 1e-5)))
            round_(min(n, 4 * TURN), -1)  # a first session's costs (its files, its first window) out of the rounds
            rounds_s = [round_(n, r) for r in range(rounds)]
            h, d, s = ([x[loop] for x in rounds_s] for loop in loops)
            ratios = sorted(b / a for a, b in zip(h, s))
            drawn = sorted(b / a for a, b in zip(d, s))
            out[name] = {"steps": n, "turn": TURN, "hand_ms": round(statistics.median(h) * 1e3, 3),
                         "hand_drawing_ms": round(statistics.median(d) * 1e3, 3),
                         "session_ms": round(statistics.median(s) * 1e3, 3),
                         "ratio": round(statistics.median(ratios), 3),
                         "spread": [round(ratios[0], 3), round(ratios[-1], 3)],
                         "ratio_drawing": round(statistics.median(drawn), 3),
                         "spread_drawing": [round(drawn[0], 3), round(drawn[-1], 3)],
                         "rounds_ms": [[round(a * 1e3, 3), round(c * 1e3, 3), round(b * 1e3, 3)]
                                       for a, c, b in zip(h, d, s)]}
            o = out[name]
            print(f"{name:12s} {n} steps x {rounds} rounds in turns of {TURN}: hand {o['hand_ms']} ms/step, hand "
                  f"drawing its batches {o['hand_drawing_ms']}, session {o['session_ms']}; session/hand "
                  f"{o['ratio']:.3f} (spread {o['spread'][0]}-{o['spread'][1]}), session/hand drawing "
                  f"{o['ratio_drawing']:.3f} (spread {o['spread_drawing'][0]}-{o['spread_drawing'][1]})", flush=True)
            del model, opt, train_step
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def run(steps: int = 30_000, rounds: int = 5) -> dict:
    """bench/run.py's entry (`--only step`): the CPU null step."""
    torch.set_num_threads(1)
    with contextlib.redirect_stdout(io.StringIO()):  # the sessions' relay-progress lines
        f = null_step(steps, rounds)
    return {f"step_overhead_{k}": v for k, v in f.items()}


def format_lines(f: dict) -> list[str]:
    return [f"Session API step, the null step ({f['step_overhead_steps']} steps, median of {f['step_overhead_rounds']}"
            f" rounds, process CPU): step_done {f['step_overhead_step_done_us']} us, with batches()"
            f" {f['step_overhead_batches_step_done_us']} us (spread {f['step_overhead_spread_us']}) a step, over a bare"
            f" loop's {f['step_overhead_bare_us']} us; on CUDA: `python bench/bench_step_overhead.py --device cuda`"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--steps", type=int, default=50_000, help="CPU null-step loop length")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 5)")
    ap.add_argument("--target-s", type=float, default=1.5, help="CUDA: seconds per round per loop")
    ap.add_argument("--only", default="", help="CUDA: comma-separated subset of tiny,mlp,transformer")
    ap.add_argument("--log-every", type=int, default=None,
                    help="CUDA: the sessions' log_every (default the API's): what the log steps' read and line cost")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ.pop("RELAY_SESSION", None)  # run by hand: the arguments here, not a relay's settings
    print(describe(), flush=True)
    if a.device == "cpu":
        torch.set_num_threads(1)
        with contextlib.redirect_stdout(io.StringIO()):  # the sessions' relay-progress lines
            f = null_step(a.steps, a.rounds or 5)
        print(f"null step ({f['steps']} steps, median of {f['rounds']} rounds, process CPU): relay per step "
              f"{f['batches_step_done_us']} us with batches() (spread {f['spread_us'][0]}-{f['spread_us'][1]}), "
              f"step_done alone {f['step_done_us']} us, over a bare loop's {f['bare_us']} us")
        print(json.dumps(f))
        return
    if not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device here")
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(device), "torch", torch.__version__, flush=True)
    try:  # another process on the GPU would time-slice it and void the ratios: say which ones are there
        print(" ".join(torch.cuda.list_gpu_processes(device).split()), flush=True)
    except Exception as err:  # noqa: BLE001 - pynvml missing or the driver's answer refused: only a hint
        print(f"GPU processes: unknown ({err})", flush=True)
    f = gpu_loops(device, a.rounds or 5, a.target_s, [s for s in a.only.split(",") if s] or None, a.log_every)
    print(json.dumps(f))


if __name__ == "__main__":
    main()
