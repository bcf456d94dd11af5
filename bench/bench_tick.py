"""What a cron tick costs while its relay only waits for a running session, against a bare status call.

On the emulator, a relay's first session is held running (its script waits for a gate file the bench opens at
the end: an event, not a sleep). Then, alternating, in fresh processes as cron would start them:
  bare  `kaggle kernels status OWNER/KERNEL` (the unmodified kaggle CLI: the least any tick can cost),
  tick  `relay run SPEC --tick`, which must answer "nothing to do" (else the figure is void and the bench fails),
and, a few times, the same waiting tick through the `relay` flow on an ephemeral Prefect (what every tick cost
before it looked first). Figures: median wall and CPU seconds of each (CPU of the process and its children),
and the tick/bare ratios. Goal: tick wall <= 3x bare.

    python bench/bench_tick.py [--quick] [--install]

--install also times the orchestrator-only install a GitHub Actions tick does (`uv pip install -c constraints.txt
-e .` into a new venv, twice: the second with a warm cache; pip when uv is not on PATH; needs the package index).
"""
from __future__ import annotations

import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

TARGET_RATIO = 3.0
USER, KEY = "bench", "bench-key-0123456789"
SCRIPT = '''
import os, time, torch, relay
session = relay.open_session()
model = torch.nn.Linear(4, 1)
session.register(model=model)
session.restore()
for idx in session.batches(64, 8):
    while session.step == 1 and not os.path.exists(%r):  # held running until the bench opens the gate
        time.sleep(0.05)
    session.step_done(loss=torch.tensor(1.0))
session.close()
'''


def _timed(args: list, env: dict, cwd: Path) -> tuple[float, float, str]:
    """(wall s, CPU s of the child and its children, stdout) of one process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, args))} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), proc.stdout


def run(rounds: int = 7, flow_rounds: int = 2, install: bool = False) -> dict:
    import yaml

    from relay.emulator import Emulator, EmulatorConfig

    root = Path(tempfile.mkdtemp(prefix="bench-tick-"))
    for d in ("home", "tmp", "project"):
        (root / d).mkdir()
    gate = root / "gate"
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("KAGGLE_", "PREFECT_", "RELAY_")) and k.lower() not in ("http_proxy", "https_proxy")}
    base.update(HOME=str(root / "home"), TMPDIR=str(root / "tmp"), KAGGLE_USERNAME=USER, KAGGLE_KEY=KEY,
                OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO), MPLCONFIGDIR=str(root / "mpl"),
                PREFECT_HOME=str(root / "prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
    emulator = Emulator(root / "emulator", EmulatorConfig(users={USER: KEY}, kernel_env={"OMP_NUM_THREADS": "1"}))
    emulator.start()
    relay_env = dict(base, RELAY_KAGGLE_ENDPOINT=emulator.url)
    # what `relay emulator serve` tells a user to export for the unmodified kaggle CLI
    kaggle_env = dict(base, KAGGLE_API_ENVIRONMENT="LOCALHOST", HTTP_PROXY=f"http://127.0.0.1:{emulator.port}")
    project = root / "project"
    (project / "train.py").write_text(SCRIPT % str(gate))
    (project / "spec.yaml").write_text(yaml.safe_dump({
        "name": "bench-tick", "code": {"folder": ".", "entry": "train.py"}, "optim": {"max_steps": 8},
        "session": {"threads": 1, "safety_margin": "0.5s"},
        "kaggle": {"session_timeout": "1h", "startup_overhead": "1s"}}))
    tick = [sys.executable, "-m", "relay", "run", "spec.yaml", "--tick", "--poll", "0.3"]
    bare = [str(Path(sys.executable).parent / "kaggle"), "kernels", "status", f"{USER}/bench-tick-session"]
    flow_tick = [sys.executable, "-c", "import sys; from flows.one_relay import relay; "
                 "print(relay(spec='spec.yaml', mode='tick', poll_seconds=0.3, state_dir='relay-runs'))"]
    try:
        first_wall, first_cpu, out = _timed(tick, relay_env, project)  # pushes session 1 (the flow acts)
        assert "pushed" in out, out
        for _ in range(600):  # until the kernel runs: observed, each look a fresh status call
            _, _, out = _timed(bare, kaggle_env, project)
            if "running" in out.lower():
                break
        else:
            raise RuntimeError(f"the session never ran: {out}")
        bare_runs, tick_runs, flow_runs = [], [], []
        for i in range(rounds):  # alternating, so drift in the machine's load hits both alike
            bare_runs.append(_timed(bare, kaggle_env, project)[:2])
            wall, cpu, out = _timed(tick, relay_env, project)
            if "nothing to do" not in out:
                raise RuntimeError(f"the tick did not find the relay waiting: {out}")
            tick_runs.append((wall, cpu))
            if i < flow_rounds:
                wall, cpu, out = _timed(flow_tick, relay_env, project)
                assert "'running'" in out, out
                flow_runs.append((wall, cpu))
    finally:
        gate.touch()
        emulator.stop()
    med = lambda runs, k: statistics.median(r[k] for r in runs)  # noqa: E731
    figures = {
        "tick_rounds": rounds, "tick_bare_wall_s": round(med(bare_runs, 0), 2),
        "tick_bare_cpu_s": round(med(bare_runs, 1), 2), "tick_wait_wall_s": round(med(tick_runs, 0), 2),
        "tick_wait_cpu_s": round(med(tick_runs, 1), 2), "tick_flow_wall_s": round(med(flow_runs, 0), 2),
        "tick_flow_cpu_s": round(med(flow_runs, 1), 2), "tick_push_wall_s": round(first_wall, 2),
        "tick_push_cpu_s": round(first_cpu, 2),
    }
    figures["tick_wall_ratio"] = round(figures["tick_wait_wall_s"] / figures["tick_bare_wall_s"], 2)
    figures["tick_cpu_ratio"] = round(figures["tick_wait_cpu_s"] / figures["tick_bare_cpu_s"], 2)
    figures["tick_flow_wall_ratio"] = round(figures["tick_flow_wall_s"] / figures["tick_bare_wall_s"], 2)
    figures["tick_target_ratio"] = TARGET_RATIO
    figures["tick_meets_target"] = figures["tick_wall_ratio"] <= TARGET_RATIO
    if install:
        figures.update(_install(root))
    shutil.rmtree(root, ignore_errors=True)
    return figures


def _install(root: Path) -> dict:
    """The orchestrator-only install of a GitHub Actions tick into a new venv, twice (the second with a warm
    cache, as a runner with a cached setup has it): with uv when it is on PATH (the workflow's way), else pip."""
    uv = shutil.which("uv")
    walls = []
    for _ in range(2):
        venv = root / "venv"
        shutil.rmtree(venv, ignore_errors=True)
        t0 = time.perf_counter()
        if uv:
            subprocess.run([uv, "venv", "-q", str(venv)], check=True)
            subprocess.run([uv, "pip", "install", "-q", "-c", str(REPO / "constraints.txt"), "-e", str(REPO)],
                           check=True, cwd=root, env=dict(os.environ, VIRTUAL_ENV=str(venv)))
        else:
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-c",
                            str(REPO / "constraints.txt"), "-e", str(REPO)], check=True, cwd=root)
        walls.append(time.perf_counter() - t0)
    found = subprocess.run([str(venv / "bin" / "python"), "-c", "import importlib.util as u; print([m for m in"
                            " ('torch', 'transformers') if u.find_spec(m)])"], capture_output=True, text=True)
    return {"tick_install_tool": "uv" if uv else "pip", "tick_install_wall_s": round(walls[-1], 1),
            "tick_install_cold_wall_s": round(walls[0], 1), "tick_install_training_stack": found.stdout.strip()}


def format_lines(f: dict) -> list:
    lines = [f"tick (a relay waiting for a running session; median of {f['tick_rounds']} alternating fresh processes):",
             f"  bare `kaggle kernels status`  {f['tick_bare_wall_s']} s wall, {f['tick_bare_cpu_s']} CPU s",
             f"  `relay run --tick`            {f['tick_wait_wall_s']} s wall, {f['tick_wait_cpu_s']} CPU s:"
             f" {f['tick_wall_ratio']}x wall, {f['tick_cpu_ratio']}x CPU (target <= {f['tick_target_ratio']}x wall)"
             f"  {'OK' if f['tick_meets_target'] else 'MISSED'}",
             f"  the same tick through the flow  {f['tick_flow_wall_s']} s wall, {f['tick_flow_cpu_s']} CPU s"
             f" ({f['tick_flow_wall_ratio']}x; a tick that pushes: {f['tick_push_wall_s']} s)"]
    if "tick_install_wall_s" in f:
        lines.append(f"  orchestrator-only install ({f['tick_install_tool']}, new venv): {f['tick_install_wall_s']} s with a"
                     f" warm cache ({f['tick_install_cold_wall_s']} s the first time);"
                     f" training stack installed: {f['tick_install_training_stack']}")
    return lines


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    figures = run(**({"rounds": 3, "flow_rounds": 1} if quick else {}), install="--install" in sys.argv)
    print("\n".join(format_lines(figures)))
    sys.exit(0 if figures["tick_meets_target"] else 1)
