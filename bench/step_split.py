"""Where the Session API's per-step cost goes (issue 48): one loop in several forms, rounds alternating.

    python bench/step_split.py [--device cpu|cuda] [--only tiny,mlp,transformer] [--target-s 0.5] [--rounds 5]

Forms, each timed from the same model and AdamW state (bench_step_overhead.py's models, fresh noise each step):
    hand               the hand-written loop
    hand_sync10        + torch.cuda.synchronize() every 10 steps (what a full wait costs)
    hand_window10      + the losses kept and read at every 10th step (torch.stack(...).tolist(): a wait for the GPU)
    hand_deferred10    + the same window copied into pinned memory without a wait, read at the next step
    sess_noop          the loop inside an open session, no relay call a step
    sess_done_logN     + step_done(loss=loss.detach()), log_every N
    sess_full_logN     + the batches() loop (the documented one)
    sess_split_log10   the full loop with the host's seconds inside the relay's calls counted, printed by kind:
                       batches() next; step_done at a log step, at the step after it, at the others
On CUDA also: a sync after every step (serial) and the GPU's kernel time a step (torch.profiler), which say
whether the loop is bound by the host or by the GPU. The ratios of a loop this short move with the machine:
read the rounds in the JSON line before trusting a difference of a few percent.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402

from bench_step_overhead import _models, _open  # noqa: E402
from machine import bench_device  # noqa: E402

WINDOW = 10  # the hand-written forms' window, the sessions' default log_every


class Loop:
    """One model's training step and the forms of the loop around it, each returning seconds a step."""

    def __init__(self, name: str, device: torch.device, work: Path):
        build, self.make, self.loss_fn, self.dtype, self.batch = _models(device)[name]
        torch.manual_seed(0)
        self.g = torch.Generator(device=device).manual_seed(0)
        self.model = build().to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5, fused=device.type == "cuda")
        self.name, self.device, self.work = name, device, work
        self.split: list[tuple] = []  # sess_split's host microseconds by kind of call, a tuple a round

    def step(self) -> torch.Tensor:
        x, y = self.make(self.g)
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
            loss = self.loss_fn(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self, body, n: int) -> float:
        self.sync()
        t0 = time.perf_counter()
        body(n)
        self.sync()
        return (time.perf_counter() - t0) / n

    # -- hand-written forms ---------------------------------------------------------------------------------
    def hand(self, n: int) -> None:
        for _ in range(n):
            self.step()

    def hand_sync10(self, n: int) -> None:
        for i in range(n):
            self.step()
            if (i + 1) % WINDOW == 0:
                self.sync()

    def hand_window10(self, n: int) -> None:
        window = []
        for i in range(n):
            window.append(self.step().detach())
            if (i + 1) % WINDOW == 0:
                torch.stack(window).tolist()
                window = []

    def hand_deferred10(self, n: int) -> None:
        window, copying = [], None
        cuda = self.device.type == "cuda"
        for i in range(n):
            window.append(self.step().detach())
            if copying is not None:  # the step after a log step: the copy is done
                host, done = copying
                if done is not None:
                    done.synchronize()
                host.tolist()
                copying = None
            if (i + 1) % WINDOW == 0:
                host = torch.stack(window).to("cpu", non_blocking=True)  # pinned on CUDA, no wait
                done = torch.cuda.Event() if cuda else None
                if done is not None:
                    done.record()
                copying, window = (host, done), []

    # -- Session API forms ----------------------------------------------------------------------------------
    def session(self, mode: str, log_every: int):
        def run(n: int) -> float:
            with contextlib.redirect_stdout(io.StringIO()):  # the session's relay-progress lines
                s = _open(self.work / f"{self.name}-{mode}-{log_every}", n, log_every)
                s.register(model=self.model, optimizer=self.opt)
                s.restore()
                seconds = self.timed(lambda k: self._session_body(s, mode, log_every, k), n)
                if s.step != n and mode != "noop":
                    raise RuntimeError(f"the session stopped at step {s.step} of {n}: {s.stop_reason}")
                s.close()
            return seconds
        return run

    def _session_body(self, s, mode: str, log_every: int, n: int) -> None:
        if mode == "noop":
            for _ in range(n):
                self.step()
        elif mode == "done":
            for _ in range(n):
                s.step_done(loss=self.step().detach())
        elif mode == "full":
            for _ in s.batches(8 * self.batch, self.batch):
                s.step_done(loss=self.step().detach())
        else:  # "split": host seconds in batches() and in step_done() by kind of step
            spent, count = [0.0] * 4, [0] * 4  # batches() next, log step, the step after, any other
            batches = iter(s.batches(8 * self.batch, self.batch))
            while True:
                t0 = time.perf_counter()
                if next(batches, None) is None:
                    break
                t1 = time.perf_counter()
                loss = self.step().detach()
                t2 = time.perf_counter()
                s.step_done(loss=loss)
                t3 = time.perf_counter()
                kind = 1 if s.step % log_every == 0 else 2 if s.step % log_every == 1 and s.step > 1 else 3
                spent[0] += t1 - t0
                count[0] += 1
                spent[kind] += t3 - t2
                count[kind] += 1
            self.split.append(tuple(t / max(1, c) * 1e6 for t, c in zip(spent, count)))

    def forms(self) -> dict:
        return {"hand": self.hand, "hand_sync10": self.hand_sync10, "hand_window10": self.hand_window10,
                "hand_deferred10": self.hand_deferred10}


def measure(loop: Loop, target_s: float, rounds: int) -> dict:
    forms = {k: (lambda n, f=f: loop.timed(f, n)) for k, f in loop.forms().items()}
    forms.update({"sess_noop": loop.session("noop", WINDOW), "sess_done_log10": loop.session("done", WINDOW),
                  "sess_full_log10": loop.session("full", WINDOW), "sess_done_log1000": loop.session("done", 1000),
                  "sess_full_log1000": loop.session("full", 1000), "sess_split_log10": loop.session("split", WINDOW)})
    loop.timed(loop.hand, 20)  # kernels, cuBLAS handles, the optimizer state
    start = copy.deepcopy((loop.model.state_dict(), loop.opt.state_dict()))

    def fresh():
        loop.model.load_state_dict(start[0])
        loop.opt.load_state_dict(start[1])

    probe = loop.timed(loop.hand, max(10, int(0.3 / max(loop.timed(loop.hand, 5), 1e-5))))
    n = max(50, int(target_s / probe))
    serial_n = min(n, 200)
    serial = loop.timed(lambda k: [(loop.step(), loop.sync()) for _ in range(k)], serial_n)
    gpu_ms = None
    if loop.device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            loop.timed(loop.hand, 50)
        gpu_ms = sum(e.self_device_time_total for e in prof.key_averages()) / 50 / 1e3
    for form in forms.values():  # each form once, short: its first-call costs out of the rounds
        fresh()
        form(min(n, 100))
    loop.split.clear()
    times = {k: [] for k in forms}
    for r in range(rounds):  # the order alternates: a drift in the machine falls on every form alike
        for k in (list(forms) if r % 2 == 0 else list(forms)[::-1]):
            fresh()
            times[k].append(forms[k](n))
    return {"steps": n, "rounds": rounds, "serial_ms": serial * 1e3, "gpu_kernel_ms": gpu_ms, "times": times,
            "split_us": [statistics.median(x[i] for x in loop.split) for i in range(4)]}


def report(name: str, r: dict) -> None:
    hand = statistics.median(r["times"]["hand"])
    gpu = "" if r["gpu_kernel_ms"] is None else f"; GPU kernel time {r['gpu_kernel_ms']:.3f} ms a step"
    print(f"== {name}: {r['steps']} steps x {r['rounds']} rounds; hand {hand * 1e3:.3f} ms a step; a sync after every"
          f" step {r['serial_ms']:.3f} ms{gpu}", flush=True)
    for k, v in r["times"].items():
        m = statistics.median(v)
        ratio = statistics.median(x / y for x, y in zip(v, r["times"]["hand"]))
        print(f"  {k:18s} {m * 1e3:8.4f} ms  {(m - hand) * 1e6:+7.1f} us  ratio (median of rounds) {ratio:.3f}")
    batches, at_log, after, other = r["split_us"]
    per_step = batches + ((WINDOW - 2) * other + at_log + after) / WINDOW
    print(f"  host inside the relay's calls (log_every {WINDOW}): batches() {batches:.1f} us; step_done {other:.1f} us,"
          f" at a log step {at_log:.1f} us, the step after {after:.1f} us; {per_step:.1f} us a step", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--only", default="tiny", help="comma-separated subset of tiny,mlp,transformer")
    ap.add_argument("--target-s", type=float, default=0.5, help="seconds a round of one form")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    logging.getLogger("relay").setLevel(logging.WARNING)
    os.environ.pop("RELAY_SESSION", None)  # run by hand: the arguments here, not a relay's settings
    device = bench_device(a.device)
    work = Path(tempfile.mkdtemp(prefix="bench-step-split-"))
    out = {}
    for name in a.only.split(","):
        r = measure(Loop(name, device, work), a.target_s, a.rounds)
        report(name, r)
        out[name] = {k: [round(x * 1e6, 1) for x in v] for k, v in r["times"].items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
