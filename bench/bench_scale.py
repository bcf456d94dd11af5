"""How many relays one worker and one PostgreSQL-backed Prefect server drive at once, on the emulator.

For each count N: a fresh PostgreSQL (deploy/local_postgres.py), `prefect server start` on it, the `relay/run`
deployment, ONE process worker, and N toy relays of 2 sessions each submitted at once as watch flow runs (the
long-lived-worker shape: one flow-run process per relay), one account whose cap lets every relay run. Sampled
every second until all are done: resident memory and CPU seconds of the worker with its flow-run processes, and of
the server with its PostgreSQL. From the emulator: the latency from a session's end to its relay's next push (the
hand-over in between). The kernels run on the same machine (on Kaggle they would not), so on a small machine
they compete with the orchestrator and the latency is an upper bound.

    python bench/run.py --only scale                 # N = 10, 20 (--quick: 5); or python bench/bench_scale.py
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
PREFECT = str(Path(sys.executable).parent / "prefect")
USER, KEY = "bench", "bench-key-0123456789abcdef"
TOY = {"recipe": "toy", "seed": 3, "params": {"n_train": 256, "n_eval": 64, "hidden": 64},
       "optim": {"micro_batch": 8, "grad_accum": 2, "lr": 0.003, "max_steps": 200, "warmup_steps": 5,
                 "log_every_steps": 10, "eval_every_steps": 100},
       "data": {"num_workers": 0},
       "session": {"threads": 1, "max_steps": 100, "budget": "10m", "save_every": "5s", "safety_margin": "0.5s"},
       "kaggle": {"session_timeout": "15m", "startup_overhead": "1s"}}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(api: str, path: str, body: dict):
    request = urllib.request.Request(f"{api}{path}", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())


class Sampler(threading.Thread):
    """Every second: RSS (MB) and CPU seconds of a process tree (and of the PostgreSQL processes for the server)."""

    def __init__(self, roots: dict, pg_data: str):
        super().__init__(daemon=True)
        self.roots, self.pg_data, self.stop = roots, pg_data, threading.Event()
        self.peak_rss = {k: 0.0 for k in roots}
        self.cpu = {k: {} for k in roots}  # pid -> last CPU seconds seen (a process that ended keeps its last)

    def _tree(self, name: str) -> list:
        root = psutil.Process(self.roots[name])
        procs = [root, *root.children(recursive=True)]
        if name == "server":
            procs += [p for p in psutil.process_iter(["cmdline"]) if self.pg_data in " ".join(p.info["cmdline"] or [])]
        return procs

    def run(self) -> None:
        while not self.stop.wait(1.0):
            for name in self.roots:
                rss = 0.0
                for proc in self._tree(name):
                    try:
                        rss += proc.memory_info().rss / 2 ** 20
                        times = proc.cpu_times()
                        self.cpu[name][proc.pid] = times.user + times.system
                    except psutil.Error:
                        continue
                self.peak_rss[name] = max(self.peak_rss[name], rss)

    def cpu_s(self, name: str) -> float:
        return sum(self.cpu[name].values())


def one_count(n: int, root: Path) -> dict:
    from relay.emulator import Emulator, EmulatorConfig

    port, pg_port = _port(), _port()
    api = f"http://127.0.0.1:{port}/api"
    pg_root = Path(tempfile.mkdtemp(prefix="relay-bench-pg-", dir="/tmp"))  # PostgreSQL's owner must enter it
    pg_root.chmod(0o711)
    pg_data = pg_root / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "KAGGLE_", "RELAY_"))}
    env.update(PREFECT_HOME=str(root / "prefect"), PREFECT_API_URL=api, PREFECT_SERVER_ANALYTICS_ENABLED="false",
               DO_NOT_TRACK="1", PREFECT_CLI_PROMPT="false", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env["PREFECT_API_DATABASE_CONNECTION_URL"] = subprocess.run(
        [sys.executable, "deploy/local_postgres.py", "start", "--data", str(pg_data), "--port", str(pg_port)],
        cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    emulator = Emulator(root / "emulator", EmulatorConfig(users={USER: KEY}, max_gpu_sessions=n,
                                                          kernel_env={"OMP_NUM_THREADS": "1"}))
    emulator.start()
    logs, procs = open(root / "processes.log", "w"), []
    try:
        procs.append(subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                                      env=env, cwd=REPO, stdout=logs, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(f"{api}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "the Prefect server did not start in 300 s"
                time.sleep(0.5)
        for cmd in ([PREFECT, "work-pool", "create", "relay-pool", "--type", "process"],
                    [PREFECT, "deploy", "--name", "run", "--no-prompt", "--prefect-file", "deploy/prefect.yaml"]):
            subprocess.run(cmd, env=env, cwd=REPO, check=True, capture_output=True, timeout=600)
        worker_env = dict(env, RELAY_KAGGLE_ENDPOINT=emulator.url, KAGGLE_USERNAME=USER, KAGGLE_KEY=KEY,
                          PREFECT_WORKER_QUERY_SECONDS="1", HOME=str(root), TMPDIR=str(root))
        procs.append(subprocess.Popen([PREFECT, "worker", "start", "--pool", "relay-pool", "--name", "bench-worker",
                                       "--limit", str(n)], env=worker_env, cwd=REPO, stdout=logs,
                                      stderr=subprocess.STDOUT, start_new_session=True))
        deployment = _post(api, "/deployments/filter", {"deployments": {"name": {"any_": ["run"]}}})[0]["id"]
        sampler = Sampler({"server": procs[0].pid, "worker": procs[1].pid}, str(pg_data))
        sampler.start()
        t0 = time.monotonic()
        ids = []
        for i in range(n):
            spec = root / "specs" / f"scale-{i}.yaml"
            spec.parent.mkdir(exist_ok=True)
            spec.write_text(yaml.safe_dump(dict(TOY, name=f"scale-{i}", kaggle=dict(TOY["kaggle"], account_sessions=n))))
            ids.append(_post(api, f"/deployments/{deployment}/create_flow_run", {"parameters": {
                "spec": str(spec), "state_dir": str(root / "orchestrator"), "poll_seconds": 2.0,
                "step_lock_wait_s": 5}})["id"])
        while True:
            states = [r["state_type"] for r in _post(api, "/flow_runs/filter", {"flow_runs": {"id": {"any_": ids}}})]
            if all(s in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") for s in states):
                break
            assert time.monotonic() - t0 < 1800, f"not done after 30 min: {states}"
            time.sleep(2)
        wall = time.monotonic() - t0
        sampler.stop.set()
        sampler.join()
        assert set(states) == {"COMPLETED"}, states
        with emulator.store.lock:
            kernels = json.loads(json.dumps(emulator.store.kernels))
        gaps = [v2["pushed"] - v1["ended"] for k in kernels.values() for v1, v2 in zip(k["versions"], k["versions"][1:])]
        return {f"scale_{n}_wall_s": round(wall, 1),
                f"scale_{n}_worker_rss_mb_peak": round(sampler.peak_rss["worker"]),
                f"scale_{n}_worker_rss_mb_per_relay": round(sampler.peak_rss["worker"] / n, 1),
                f"scale_{n}_worker_cpu_s_per_relay": round(sampler.cpu_s("worker") / n, 1),
                f"scale_{n}_server_rss_mb_peak": round(sampler.peak_rss["server"]),
                f"scale_{n}_server_cpu_s_per_relay": round(sampler.cpu_s("server") / n, 1),
                f"scale_{n}_end_to_push_s_median": round(statistics.median(gaps), 1),
                f"scale_{n}_end_to_push_s_max": round(max(gaps), 1)}
    finally:
        for proc in reversed(procs):  # the worker with its flow runs, then the server
            if proc.poll() is None:
                tree = [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]
                for p in tree:
                    try:
                        p.kill()
                    except psutil.Error:
                        pass
            proc.wait()
        emulator.stop()
        subprocess.run([sys.executable, "deploy/local_postgres.py", "stop", "--data", str(pg_data)], cwd=REPO,
                       capture_output=True)
        shutil.rmtree(pg_root, ignore_errors=True)


def run(counts: tuple = (10, 20)) -> dict:
    figures: dict = {"scale_counts": list(counts)}
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        for n in counts:
            root = Path(tmp) / f"n{n}"
            root.mkdir()
            figures.update(one_count(n, root))
    return figures


def format_lines(f: dict) -> list:
    lines = ["scale (N watch relays of 2 toy sessions on ONE process worker, PostgreSQL-backed server; kernels on the"
             " same machine):"]
    for n in f["scale_counts"]:
        lines.append(f"  N={n}: all done in {f[f'scale_{n}_wall_s']} s; worker+flow runs peak"
                     f" {f[f'scale_{n}_worker_rss_mb_peak']} MB ({f[f'scale_{n}_worker_rss_mb_per_relay']} MB and"
                     f" {f[f'scale_{n}_worker_cpu_s_per_relay']} CPU s per relay); server+PostgreSQL peak"
                     f" {f[f'scale_{n}_server_rss_mb_peak']} MB, {f[f'scale_{n}_server_cpu_s_per_relay']} CPU s per relay;"
                     f" session end -> next push median {f[f'scale_{n}_end_to_push_s_median']} s, max"
                     f" {f[f'scale_{n}_end_to_push_s_max']} s")
    return lines


if __name__ == "__main__":
    print("\n".join(format_lines(run((5,) if "--quick" in sys.argv else (10, 20)))))
