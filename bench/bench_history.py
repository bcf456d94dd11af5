"""Bytes moved per hand-over as a relay goes on: the metrics history must not grow with the run (issue 61, item 3).

    python bench/bench_history.py [--sessions 10] [--steps 1000000]
    python bench/bench_history.py --root /path/to/other/checkout --carried   # the same relay on older code
    python bench/bench_history.py --tensorboard     # the sessions also write the relay's TensorBoard events

On the local Kaggle emulator, `sessions` kernels one after the other each leave what a session of `steps`
optimizer steps leaves (no training: the work is sized by steps, not seconds): a checkpoint (1 MB, random bytes),
progress.json with every session so far, and metrics.jsonl with a train line and a memory line every 50 steps
(the defaults of optim.log_every_steps and memory_log_every_steps) in the kernel's own format, its session's lines
only (`--carried`: the lines of every session so far, as kernels wrote before relay/orchestrator/history.py). Each
is handed over by relay.orchestrator.handoff.hand_over, then its history is read as the relay's summary reads it
after a hand-over (handoff.published_metrics). Bytes are counted on the orchestrator's sockets (a child process; the
emulator runs in this one), requests and answers whole, HTTP headers included, from the start of the hand-over to
the end of that read: uploaded (to Kaggle) and downloaded (from it). Target: sessions 1 and N within 10 % each way.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
USER, KEY = "bench", "bench-key-0123456789abcdef"
NAME = "bench-history"
LOG_EVERY = 50  # optim.log_every_steps and session.memory_log_every_steps: their defaults (relay/shared/spec_sections.py)
TARGET = 0.10

# runs inside the emulator's kernel (cwd = /kaggle/working): what a session leaves, without training
KERNEL_SOURCE = r'''
import json, os, time, zlib
SESSION, STEPS, EVERY, RUN_ID, CARRIED, TB = {session!r}, {steps!r}, {every!r}, {run_id!r}, {carried!r}, {tb!r}
os.makedirs("relay", exist_ok=True)
json.dump({{"run_id": RUN_ID}}, open("relay-kernel.json", "w"))
step = SESSION * STEPS
d = f"relay/checkpoints/step-{{step:08d}}"
os.makedirs(d, exist_ok=True)
data = os.urandom(1 << 20)
open(d + "/state.pt", "wb").write(data)
json.dump({{"format": 1, "step": step, "created": time.time(), "run_id": RUN_ID,
           "files": {{"state.pt": {{"bytes": len(data), "crc32": f"{{zlib.crc32(data):08x}}"}}}}}}, open(d + "/manifest.json", "w"))
t0 = 1.764e9
sessions = [{{"index": i, "run_id": f"{name}-s{{i:03d}}-a1", "started": t0 + i * 3600, "ended": t0 + i * 3600 + 3000,
             "seconds": 3000.0, "step_start": (i - 1) * STEPS, "step_end": i * STEPS, "stop_reason": "steps",
             "world_size": 1}} for i in range(1, SESSION + 1)]
json.dump({{"run_id": RUN_ID, "name": "{name}", "global_step": step, "total_steps": 100 * STEPS, "status": "paused",
           "stop_reason": "steps", "checkpoint": d, "sessions": sessions}}, open("relay/progress.json", "w"))
with open("relay/metrics.jsonl", "w") as f:
    for s in range(1 if CARRIED else SESSION, SESSION + 1):
        for k in range((s - 1) * STEPS + EVERY, s * STEPS + 1, EVERY):
            t = round(t0 + s * 3600 + k * 0.002, 3)
            f.write(json.dumps({{"session": s, "time": t, "kind": "train", "step": k, "loss": 2.0 / (1 + k * 1e-5),
                                "lr": 0.0003, "samples_per_s": 16000.0, "grad_norm": 0.91}}) + "\n")
            f.write(json.dumps({{"session": s, "time": t, "kind": "memory", "step": k, "phase": "train",
                                "allocated_mb": 812.4, "peak_mb": 1034.9, "rss_mb": 2201.7}}) + "\n")
if TB:  # the relay's TensorBoard writer's events: one scalar an event, the train record's four (TB 2: every
    from tensorboard.compat.proto import event_pb2  # session's file, as kernels copied the log so far before)
    from tensorboard.summary.writer.record_writer import RecordWriter
    os.makedirs("relay/tensorboard", exist_ok=True)
    for s in range(1 if CARRIED or TB == 2 else SESSION, SESSION + 1):
        with open(f"relay/tensorboard/events.out.tfevents.{{1764000000 + s}}.kaggle.{{s}}", "wb") as f:
            w = RecordWriter(f)
            w.write(event_pb2.Event(wall_time=t0, file_version="brain.Event:2").SerializeToString())
            for k in range((s - 1) * STEPS + EVERY, s * STEPS + 1, EVERY):
                for tag, v in (("loss", 2.0 / (1 + k * 1e-5)), ("lr", 0.0003), ("samples_per_s", 16000.0),
                               ("grad_norm", 0.91)):
                    e = event_pb2.Event(wall_time=t0 + s * 3600 + k * 0.002, step=k)
                    e.summary.value.add(tag="train/" + tag, simple_value=v)
                    w.write(e.SerializeToString())
            w.flush()
'''

CHILD = r'''
import json, os, socket, sys, time
sys.path.insert(0, sys.argv[1])
endpoint, local, work, sessions, steps, every, carried, tb = sys.argv[2], sys.argv[3], sys.argv[4], *map(int, sys.argv[5:10])
from pathlib import Path
from relay.orchestrator import chain, handoff
from relay.orchestrator.kaggle import ClientBackend, KaggleCredentials, RetryPolicy
from relay.shared import spec as spec_mod
counted = {{"up": 0, "down": 0}}
def counting(method, key, sent):
    def wrapper(self, data, *a, **k):
        result = method(self, data, *a, **k)
        counted[key] += len(data) if sent == "all" else (result if isinstance(result, int) else len(result))
        return result
    return wrapper
socket.socket.sendall = counting(socket.socket.sendall, "up", "all")
socket.socket.send = counting(socket.socket.send, "up", "n")
socket.socket.recv_into = counting(socket.socket.recv_into, "down", "n")
socket.socket.recv = counting(socket.socket.recv, "down", "n")
backend = ClientBackend(KaggleCredentials({user!r}, key={key!r}), endpoint,
                        RetryPolicy(attempts=8, base_delay_s=0.05, max_delay_s=0.5), dataset_poll_s=0.05, dataset_wait_s=600)
spec = spec_mod.load(str(Path(work) / "spec.yaml"))
names = chain.Names({user!r}, spec.name)
published, rows = None, []
for i in range(1, sessions + 1):
    run_id = f"{name}-s{{i:03d}}-a1"
    folder = Path(work) / f"push-{{i}}"
    folder.mkdir()
    (folder / "run.py").write_text(Path(work, "kernel.py").read_text().format(session=i, steps=steps, every=every,
                                   run_id=run_id, carried=bool(carried), tb=tb))
    (folder / "kernel-metadata.json").write_text(json.dumps({{
        "id": names.kernel, "title": f"{name} session", "code_file": "run.py", "language": "python",
        "kernel_type": "script", "enable_gpu": False, "enable_internet": False}}))
    backend.client.run("push", lambda api: api.kernels_push(str(folder)))
    while True:  # the synthetic session runs for about a second
        state = backend.kernel_status(names.kernel).state
        if state.finished:
            break
        time.sleep(0.1)
    obs = chain.Observation(published, run_id, "complete", features_published=True)
    action = chain.Action(chain.Do.HARVEST, run_id, i, 1)
    counted.update(up=0, down=0)
    t = time.perf_counter()
    result = handoff.hand_over(backend, spec, names, action, obs, Path(local))
    assert result.ok, result.reason
    history = handoff.published_metrics(backend, names, Path(local), result.progress)
    rows.append({{"session": i, "up": counted["up"], "down": counted["down"], "seconds": time.perf_counter() - t,
                 "history_lines": sum(1 for _ in open(history)) if history else 0}})
    published = result.progress
print("FIGURES " + json.dumps(rows))
'''

SPEC = f"""name: {NAME}
recipe: toy
optim: {{max_steps: 100000000}}
"""


def run(sessions: int = 10, steps: int = 1_000_000, carried: bool = False, root: Path = ROOT,
        keep: bool = False, tensorboard: int = 0) -> dict:
    """Bytes per hand-over for each of `sessions` sessions of `steps` steps; `root`: the checkout handing over;
    `tensorboard`: 0 no events, 1 each session its own file, 2 every session's files (as older kernels did)."""
    sys.path.insert(0, str(ROOT))
    from relay.emulator import Emulator, EmulatorConfig

    work = Path(tempfile.mkdtemp(prefix="bench-history-"))
    (work / "spec.yaml").write_text(SPEC + ("tracking: {tensorboard: true}\n" if tensorboard else ""))
    (work / "kernel.py").write_text(KERNEL_SOURCE.replace("{name}", NAME))
    (work / "child.py").write_text(CHILD.format(user=USER, key=KEY, name=NAME))
    emu = Emulator(work / "emulator", EmulatorConfig(users={USER: KEY})).start()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KAGGLE_")}
        env.update(TMPDIR=str(work), HOME=str(work), PYTHONPATH=str(root), RELAY_HANDOFF_DISK_RESERVE_MB="0")
        out = subprocess.run([sys.executable, str(work / "child.py"), str(root), emu.url, str(work / "local"),
                              str(work), str(sessions), str(steps), str(LOG_EVERY), str(int(carried)),
                               str(int(tensorboard))],
                             env=env, capture_output=True, text=True)
        line = [x for x in out.stdout.splitlines() if x.startswith("FIGURES ")]
        if out.returncode or not line:
            raise RuntimeError(f"bench_history failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
        rows = json.loads(line[-1][len("FIGURES "):])
    finally:
        emu.stop()
        if not keep:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
    first, last = rows[0], rows[-1]
    up, down = last["up"] / first["up"], last["down"] / first["down"]
    return {
        "history_sessions": sessions, "history_steps_per_session": steps, "history_carried": carried,
        "history_tensorboard": tensorboard,
        "history_per_session": [[r["session"], r["up"], r["down"]] for r in rows],
        "history_up_first_bytes": first["up"], "history_up_last_bytes": last["up"],
        "history_down_first_bytes": first["down"], "history_down_last_bytes": last["down"],
        "history_up_ratio": round(up, 3), "history_down_ratio": round(down, 3),
        "history_local_lines": last["history_lines"],
        "history_meets_target": abs(up - 1) <= TARGET and abs(down - 1) <= TARGET,
    }


def format_lines(f: dict) -> list:
    mb = 1e6
    lines = [f"bytes per hand-over, {f['history_sessions']} sessions of {f['history_steps_per_session']:,} steps"
             f" (a train and a memory line every {LOG_EVERY}; 1 MB checkpoint)"
             + (", TensorBoard on (4 scalars a line)" if f.get("history_tensorboard") else "")
             + (" [kernels carry every session's TensorBoard files]" if f.get("history_tensorboard") == 2 else "")
             + (" [kernels carry every session's lines]" if f["history_carried"] else "") + ":"]
    for session, up, down in f["history_per_session"]:
        lines.append(f"  session {session:2d}: uploaded {up / mb:7.2f} MB, downloaded {down / mb:7.2f} MB")
    lines.append(f"  session {f['history_sessions']} / session 1: uploaded {f['history_up_ratio']:.3f}x, downloaded"
                 f" {f['history_down_ratio']:.3f}x (target within {TARGET:.0%});"
                 f" local history {f['history_local_lines']:,} lines  "
                 + ("OK" if f["history_meets_target"] else "MISSED"))
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=10)
    parser.add_argument("--steps", type=int, default=1_000_000, help="optimizer steps per session")
    parser.add_argument("--carried", action="store_true", help="kernels write every session's lines (older code)")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose orchestrator hands over")
    parser.add_argument("--tensorboard", action="store_true", help="the sessions write TensorBoard events too")
    parser.add_argument("--tensorboard-carried", action="store_true",
                        help="... and every session's TensorBoard files, as kernels did before (older code)")
    args = parser.parse_args(argv)
    tb = 2 if args.tensorboard_carried else int(args.tensorboard)
    figures = run(args.sessions, args.steps, args.carried, args.root, tensorboard=tb)
    print("\n".join(format_lines(figures)))
    return 0 if figures["history_meets_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
