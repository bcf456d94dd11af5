"""The handoff of a multi-GB checkpoint on the local Kaggle emulator: the orchestrator's disk, memory and time.

    python bench/bench_handoff.py            # a synthetic 2 GB checkpoint (the issue's figure)
    python bench/bench_handoff.py --gb 0.5   # smaller, for a quick look; run() returns the figures

A kernel of the emulator writes a session's output the way `relay train` leaves it: two kept checkpoints of
`gb` GB each (random bytes: incompressible, crc32 in the manifest), progress.json, metrics.jsonl, a 50 MB
feature cache and the relay-kernel.json marker. Then, each in a fresh subprocess (so peak RSS is its own):

- handoff:  relay.orchestrator.handoff.hand_over (selective, streamed, verified) publishing the checkpoint dataset version
- baseline: the same checkpoint bytes plainly downloaded (1 MiB chunks, no checks) and uploaded once to the
            emulator's blob endpoint (StartBlobUpload + PUT of the file): the transfer cost alone.

Figures: peak disk of the orchestrator's folders (sampled every 20 ms: its state dir and TMPDIR) over the
checkpoint size (goal <= 1.1x), peak RSS (ru_maxrss; goal < 300 MB; the import-only RSS of the same
process is shown too), and handoff wall time over the baseline's (goal <= 1.3x).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
USER, KEY = "bench", "bench-key-0123456789abcdef"
KERNEL = f"{USER}/bench-handoff-session"
RUN_ID = "bench-handoff-s001-a1"

# runs inside the emulator's kernel (cwd = /kaggle/working): a session output, without training
KERNEL_SOURCE = r'''
import json, os, zlib, time
GB, STEP = {gb!r}, 100
os.makedirs("relay/cache", exist_ok=True)
json.dump({{"run_id": "{run_id}"}}, open("relay-kernel.json", "w"))
def write(path, nbytes, seed):
    crc, left, block = 0, nbytes, os.urandom(1 << 20)
    with open(path, "wb") as f:
        while left > 0:
            chunk = block[: min(left, len(block))]
            block = bytes([(block[0] + seed) % 256]) + block[1:]  # vary the blocks a little
            crc = zlib.crc32(chunk, crc); f.write(chunk); left -= len(chunk)
    return {{"bytes": nbytes, "crc32": f"{{crc:08x}}"}}
for i, step in enumerate((STEP - 50, STEP)):
    d = f"relay/checkpoints/step-{{step:08d}}"
    os.makedirs(d, exist_ok=True)
    files = {{"state.pt": write(d + "/state.pt", int(GB * 1e9), i + 1)}}
    json.dump({{"format": 1, "step": step, "created": time.time(), "run_id": "{run_id}", "files": files}},
              open(d + "/manifest.json", "w"))
write("relay/cache/features.bin", 50 * 10**6, 7)
json.dump({{"run_id": "{run_id}", "global_step": STEP, "total_steps": 1000, "status": "paused",
           "sessions": [], "stop_reason": "budget"}}, open("relay/progress.json", "w"))
open("relay/metrics.jsonl", "w").write("".join(json.dumps({{"step": s, "loss": 1.0 / s}}) + "\n" for s in range(1, STEP + 1)))
'''

CHILD = r'''
import json, os, resource, sys, threading, time
sys.path.insert(0, {root!r})
mode, endpoint, local = sys.argv[1], sys.argv[2], sys.argv[3]
from relay.orchestrator import chain, handoff
from relay.orchestrator.kaggle import ClientBackend, KaggleCredentials, RetryPolicy
from relay.shared import spec as spec_mod
import requests
watch = [local, os.environ["TMPDIR"]]
peak, rss_peak = [0], [0]
PAGE = os.sysconf("SC_PAGE_SIZE")
def rss():  # current RSS from /proc (ru_maxrss would carry the forking parent's peak over exec)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE
def usage():
    total = 0
    for top in watch:
        for dirpath, _, files in os.walk(top):
            for f in files:
                try: total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
                except OSError: pass
    return total
stop = threading.Event()
def sample():
    while not stop.wait(0.02):
        peak[0] = max(peak[0], usage())
        rss_peak[0] = max(rss_peak[0], rss())
threading.Thread(target=sample, daemon=True).start()
rss_import = rss()
rss_peak[0] = rss_import
spent = {{"download_s": 0.0, "publish_s": 0.0}}
def timed(fn, key):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[key] += time.perf_counter() - t
    return wrapper
backend = ClientBackend(KaggleCredentials({user!r}, key={key!r}), endpoint,
                        RetryPolicy(attempts=8, base_delay_s=0.05, max_delay_s=0.5), dataset_poll_s=0.05, dataset_wait_s=600)
from relay.orchestrator.kaggle import selective_output
selective_output.stream_verified = timed(selective_output.stream_verified, "download_s")
backend.publish_folder = timed(backend.publish_folder, "publish_s")
t0 = time.perf_counter()
if mode == "handoff":
    spec = spec_mod.load(sys.argv[4])
    names = chain.Names({user!r}, spec.name)
    obs = chain.Observation(None, {run_id!r}, "complete", features_published=True)
    action = chain.Action(chain.Do.HARVEST, {run_id!r}, 1, 1)
    result = handoff.hand_over(backend, spec, names, action, obs, __import__("pathlib").Path(local))
    assert result.ok, result.reason
    moved = result.step
else:
    from relay.orchestrator.kaggle.output import list_output
    from kagglesdk.blobs.types.blob_api_service import ApiStartBlobUploadRequest, ApiBlobType
    files, _ = list_output(backend.client, *{kernel!r}.split("/"))
    url = dict(files)["relay/checkpoints/step-00000100/state.pt"]
    target = os.path.join(local, "state.pt")
    os.makedirs(local, exist_ok=True)
    t = time.perf_counter()
    with requests.get(url, stream=True) as r, open(target, "wb") as out:
        for chunk in r.iter_content(1 << 20):
            out.write(chunk)
    spent["download_s"] = time.perf_counter() - t
    t = time.perf_counter()
    def start(kaggle):
        req = ApiStartBlobUploadRequest()
        req.type, req.name, req.content_length = ApiBlobType.DATASET, "state.pt", os.path.getsize(target)
        req.last_modified_epoch_seconds = int(time.time())
        return kaggle.blobs.blob_api_client.start_blob_upload(req)
    created = backend.client.sdk("start upload", start)
    with open(target, "rb") as f:
        requests.put(created.create_url, data=f).raise_for_status()
    spent["publish_s"] = time.perf_counter() - t
    os.remove(target)
    moved = 0
wall = time.perf_counter() - t0
stop.set()
peak[0] = max(peak[0], usage())
print("FIGURES " + json.dumps({{"wall_s": wall, "peak_disk": peak[0], "rss_import": rss_import,
      "rss_peak": max(rss_peak[0], rss()), "step": moved, **spent}}))
'''

SPEC = """name: bench-handoff
recipe: toy
optim: {max_steps: 1000}
"""


def _child(mode: str, endpoint: str, work: Path, spec: Path) -> dict:
    tmp = work / f"tmp-{mode}"
    tmp.mkdir(parents=True, exist_ok=True)
    script = work / "child.py"
    script.write_text(CHILD.format(root=str(ROOT), user=USER, key=KEY, run_id=RUN_ID, kernel=KERNEL))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAGGLE_")}
    env.update(TMPDIR=str(tmp), HOME=str(tmp), PYTHONPATH=str(ROOT), RELAY_HANDOFF_DISK_RESERVE_MB="0")
    out = subprocess.run([sys.executable, str(script), mode, endpoint, str(work / f"local-{mode}"), str(spec)],
                         env=env, capture_output=True, text=True)
    line = [l for l in out.stdout.splitlines() if l.startswith("FIGURES ")]
    if out.returncode or not line:
        raise RuntimeError(f"{mode} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return json.loads(line[-1][len("FIGURES "):])


def run(gb: float = 2.0, keep: bool = False) -> dict:
    """Figures for one synthetic checkpoint of `gb` GB (decimal)."""
    sys.path.insert(0, str(ROOT))
    from relay.emulator import Emulator, EmulatorConfig
    from relay.orchestrator.kaggle import ClientBackend, KaggleCredentials, RetryPolicy

    work = Path(tempfile.mkdtemp(prefix="bench-handoff-"))
    spec = work / "spec.yaml"
    spec.write_text(SPEC)
    emu = Emulator(work / "emulator", EmulatorConfig(users={USER: KEY})).start()
    try:
        backend = ClientBackend(KaggleCredentials(USER, key=KEY), emu.url, RetryPolicy(attempts=8, base_delay_s=0.05))
        folder = work / "push"
        folder.mkdir()
        (folder / "run.py").write_text(KERNEL_SOURCE.format(gb=gb, run_id=RUN_ID))
        (folder / "kernel-metadata.json").write_text(json.dumps({
            "id": KERNEL, "title": "bench handoff session", "code_file": "run.py", "language": "python",
            "kernel_type": "script", "enable_gpu": False, "enable_internet": False}))
        backend.client.run("push", lambda api: api.kernels_push(str(folder)))
        deadline = time.time() + 1800
        while not backend.kernel_status(KERNEL).state.finished:
            if time.time() > deadline:
                raise RuntimeError("the synthetic session did not finish")
            time.sleep(0.5)
        baseline = _child("baseline", emu.url, work, spec)
        handoff = _child("handoff", emu.url, work, spec)
    finally:
        emu.stop()
        if not keep:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
    size = int(gb * 1e9)
    return {
        "checkpoint_gb": gb,
        "handoff_s": round(handoff["wall_s"], 2), "baseline_s": round(baseline["wall_s"], 2),
        "time_ratio": round(handoff["wall_s"] / baseline["wall_s"], 2),
        "peak_disk_gb": round(handoff["peak_disk"] / 1e9, 3),
        "disk_ratio": round(handoff["peak_disk"] / size, 3),
        "baseline_disk_ratio": round(baseline["peak_disk"] / size, 3),
        "handoff_download_s": round(handoff["download_s"], 2), "handoff_publish_s": round(handoff["publish_s"], 2),
        "baseline_download_s": round(baseline["download_s"], 2), "baseline_upload_s": round(baseline["publish_s"], 2),
        "peak_rss_mb": round(handoff["rss_peak"] / 2**20), "import_rss_mb": round(handoff["rss_import"] / 2**20),
        "baseline_rss_mb": round(baseline["rss_peak"] / 2**20),
        "goals": {"disk_ratio <= 1.1": handoff["peak_disk"] <= 1.1 * size,
                  "peak_rss < 300 MB": handoff["rss_peak"] < 300 * 2**20,
                  "time_ratio <= 1.3": handoff["wall_s"] <= 1.3 * baseline["wall_s"]},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.0, help="checkpoint size in GB (default 2)")
    args = parser.parse_args(argv)
    figures = run(args.gb)
    print(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
