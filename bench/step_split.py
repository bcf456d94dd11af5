"""Where the Session API's per-step cost goes (issue 48): one loop in several forms, rounds alternating.

    python bench/step_split.py [cpu|cuda] [tiny,mlp,transformer] [seconds per round] [rounds]

Forms, each timed from the same model and AdamW state (bench_step_overhead.py's models, fresh noise each step):
    hand               the hand-written loop
    hand_sync10        + torch.cuda.synchronize() every 10 steps (what a full wait costs)
    hand_window10      + the losses kept and read at every 10th step (torch.stack(...).tolist(): a wait for the GPU)
    hand_deferred10    + the same window copied into pinned memory without a wait, read 10 steps later
    sess_noop          the loop inside an open session, no relay call a step
    sess_done_logN     + step_done(loss=loss.detach()), log_every N
    sess_full_logN     + the batches() loop (the documented one)
    sess_split_log10   the full loop with the host's seconds inside the relay's calls counted (printed apart:
                       batches() next; step_done at a log step, at the step after it, at the others)
On CUDA also: a sync after every step (serial) and the GPU's kernel time a step (torch.profiler), which say
whether the loop is bound by the host or by the GPU. The ratios of a loop this short move with the machine:
read the rounds in the JSON line before a difference of a few percent.
"""
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

import bench_step_overhead as b  # noqa: E402
from machine import describe  # noqa: E402

logging.getLogger("relay").setLevel(logging.WARNING)
os.environ.pop("RELAY_SESSION", None)  # run by hand: the arguments here, not a relay's settings
dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cpu")
names = (sys.argv[2] if len(sys.argv) > 2 else "tiny").split(",")
target = float(sys.argv[3]) if len(sys.argv) > 3 else 0.5
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 5
if dev.type == "cpu":
    torch.set_num_threads(1)
print(describe(), flush=True)
if dev.type == "cuda":
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
def sync():
    if dev.type == "cuda": torch.cuda.synchronize()
work = Path(tempfile.mkdtemp())
out = {}
for name in names:
    build, make, loss_fn, dtype, batch = b._models(dev)[name]
    torch.manual_seed(0)
    g = torch.Generator(device=dev).manual_seed(0)
    model = build().to(dev); opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev.type == "cuda")
    def train_step():
        x, y = make(g)
        with torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None):
            loss = loss_fn(model(x), y)
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        return loss
    split = {}
    def timed(fn):
        def run(n):
            sync(); t0 = time.perf_counter(); fn(n); sync(); return (time.perf_counter() - t0) / n
        return run
    @timed
    def hand(n):
        for i in range(n): train_step()
    @timed
    def hand_sync10(n):
        for i in range(n):
            train_step()
            if (i + 1) % 10 == 0: sync()
    @timed
    def hand_window10(n):
        w = []
        for i in range(n):
            w.append(train_step().detach())
            if (i + 1) % 10 == 0: torch.stack(w).tolist(); w = []
    @timed
    def hand_deferred10(n):  # the window copied to pinned memory without a wait, read one window later
        w = []; pend = None
        pinned = torch.empty(10, pin_memory=dev.type == "cuda")
        for i in range(n):
            w.append(train_step().detach())
            if (i + 1) % 10 == 0:
                if pend is not None:
                    pend[1].synchronize(); pend[0].tolist()
                buf = torch.empty(10, pin_memory=dev.type == "cuda")
                buf.copy_(torch.stack(w), non_blocking=True)
                ev = torch.cuda.Event() if dev.type == "cuda" else None
                if ev is not None: ev.record()
                pend = (buf, ev or type("E", (), {"synchronize": lambda self: None})()); w = []
    def sess(mode, log):
        def run(n):
            with contextlib.redirect_stdout(io.StringIO()):
                s = b._open(work / f"{name}-{mode}-{log}", n, log); s.register(model=model, optimizer=opt); s.restore()
                sync(); t0 = time.perf_counter()
                if mode == "full":
                    for idx in s.batches(8 * batch, batch):
                        loss = train_step(); s.step_done(loss=loss.detach())
                elif mode == "done":
                    for i in range(n):
                        loss = train_step(); s.step_done(loss=loss.detach())
                elif mode == "noop":
                    for i in range(n): train_step()
                elif mode == "split":  # host seconds inside the relay's calls, log steps apart
                    # buckets: batches() next; step_done at a log step (its window's read starts), at the step after
                    # (the window judged and logged), at any other step
                    it = iter(s.batches(8 * batch, batch)); spent = [0.0] * 4; count = [0] * 4
                    while True:
                        a = time.perf_counter()
                        try: next(it)
                        except StopIteration: break
                        c = time.perf_counter(); spent[0] += c - a; count[0] += 1
                        loss = train_step()
                        a = time.perf_counter(); s.step_done(loss=loss.detach()); c = time.perf_counter()
                        k = 1 if s.step % log == 0 else 2 if s.step % log == 1 and s.step > 1 else 3
                        spent[k] += c - a; count[k] += 1
                    split.setdefault(log, []).append(tuple(t / max(1, c) * 1e6 for t, c in zip(spent, count)))
                sync(); r = (time.perf_counter() - t0) / n
                if s.step != n and mode != "noop": raise RuntimeError(f"stopped at {s.step}: {s.stop_reason}")
                s.close()
            return r
        return run
    fns = {"hand": hand, "hand_sync10": hand_sync10, "hand_window10": hand_window10, "hand_deferred10": hand_deferred10,
           "sess_noop": sess("noop", 10), "sess_done_log10": sess("done", 10), "sess_full_log10": sess("full", 10),
           "sess_done_log1000": sess("done", 1000), "sess_full_log1000": sess("full", 1000),
           "sess_split_log10": sess("split", 10)}
    hand(20)
    start = copy.deepcopy((model.state_dict(), opt.state_dict()))
    probe = hand(max(10, int(0.3 / max(hand(5), 1e-5))))
    n = max(50, int(target / probe))
    # serial: a sync after every step (host launch + GPU run, nothing overlapped)
    sync(); t0 = time.perf_counter()
    for i in range(min(n, 200)): train_step(); sync()
    serial = (time.perf_counter() - t0) / min(n, 200)
    gpu_ms = None
    if dev.type == "cuda":
        from torch.profiler import profile, ProfilerActivity
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(50): train_step()
            sync()
        gpu_ms = sum(e.self_device_time_total for e in prof.key_averages()) / 50 / 1e3
    for f in fns.values():
        model.load_state_dict(start[0]); opt.load_state_dict(start[1]); f(min(n, 100))
    res = {k: [] for k in fns}
    for r in range(rounds):
        for k, f in (list(fns.items()) if r % 2 == 0 else list(reversed(list(fns.items())))):
            model.load_state_dict(start[0]); opt.load_state_dict(start[1])
            res[k].append(f(n))
    h = statistics.median(res["hand"])
    print(f"== {name}: {n} steps/round x {rounds}; hand {h*1e3:.3f} ms/step; serial (sync each step) {serial*1e3:.3f} ms;"
          f" GPU kernel time {gpu_ms if gpu_ms is None else round(gpu_ms, 3)} ms/step", flush=True)
    for k, v in res.items():
        m = statistics.median(v)
        rat = statistics.median([x / y for x, y in zip(v, res["hand"])])
        print(f"  {k:18s} {m*1e3:8.4f} ms/step  {(m-h)*1e6:+7.1f} us  ratio(med of rounds) {rat:.3f}", flush=True)
    for log, v in split.items():
        tb, tl, tj, td = (statistics.median(x[i] for x in v) for i in range(4))
        print(f"  host inside relay (log_every {log}): batches() next {tb:.1f} us; step_done {td:.1f} us, at a log step"
              f" {tl:.1f} us, the step after {tj:.1f} us; {tb + ((log - 2) * td + tl + tj) / log:.1f} us a step", flush=True)
    out[name] = {k: [round(x * 1e6, 1) for x in v] for k, v in res.items()}
    del model, opt
print(json.dumps(out))
