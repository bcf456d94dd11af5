"""How soon a step logged in a running Kaggle session is visible in Prefect (watch mode), on the emulator.

A user script relayed by the `relay` flow (real Prefect, real `kaggle` client, the emulator's log stream) stands
for a session whose steps take `step_s` each (a sleep: the latency is of the plumbing, not of training). The
session prints a progress line at most every `progress_every_s` (the kernel default is 30 s) and the flow
refreshes the run's progress artifact every `live_seconds` (default 30 s). For every progress line, the latency
is the time from the line's own timestamp to the first artifact that shows its step. Goal: <= 60 s.

    python bench/bench_live.py [--quick]
"""
from __future__ import annotations

import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

TARGET_S = 60.0
SCRIPT = '''
import time, torch, relay
session = relay.open_session()
model = torch.nn.Linear(4, 1)
session.register(model=model)
session.restore()
for idx in session.batches(64, 8):
    time.sleep(%r)  # a step of the stand-in workload
    session.step_done(loss=torch.tensor(1.0 / (1 + session.step)))
session.close()
'''


def run(steps: int = 150, step_s: float = 1.0, progress_every_s: float = 30.0, live_seconds: float = 30.0) -> dict:
    import yaml
    from prefect.artifacts import Artifact
    from prefect.testing.utilities import prefect_test_harness

    root = Path(tempfile.mkdtemp(prefix="bench-live-"))
    for d in ("home", "tmp"):
        (root / d).mkdir()
    os.environ.update(HOME=str(root / "home"), TMPDIR=str(root / "tmp"), KAGGLE_USERNAME="bench",
                      KAGGLE_KEY="bench-key", HF_HUB_OFFLINE="1", PREFECT_SERVER_ANALYTICS_ENABLED="false")
    from relay.emulator import Emulator, EmulatorConfig

    emulator = Emulator(root / "emulator", EmulatorConfig(users={"bench": "bench-key"}, kernel_env={
        "OMP_NUM_THREADS": "1", "RELAY_PROGRESS_EVERY": str(progress_every_s)})).start()
    os.environ["RELAY_KAGGLE_ENDPOINT"] = emulator.url
    (root / "code").mkdir()
    (root / "code" / "train.py").write_text(SCRIPT % step_s)
    spec = root / "code" / "spec.yaml"
    spec.write_text(yaml.safe_dump({"name": "bench-live", "code": {"folder": ".", "entry": "train.py"},
                                    "optim": {"max_steps": steps, "log_every_steps": 1},
                                    "session": {"threads": 1, "safety_margin": "0.5s"},
                                    "kaggle": {"session_timeout": "1h", "startup_overhead": "1s"}}))
    seen: dict = {}  # step -> wall time the progress artifact first showed it
    try:
        with prefect_test_harness(server_startup_timeout=120):
            from flows.one_relay import relay

            result: dict = {}
            flow = threading.Thread(target=lambda: result.update(relay(
                spec=str(spec), poll_seconds=1.0, live_seconds=live_seconds, state_dir=str(root / "orch"))))
            flow.start()
            while flow.is_alive():
                artifact = Artifact.get("bench-live-progress")
                match = re.search(r"step (\d+) of", (artifact.description or "") if artifact else "")
                if match:
                    seen.setdefault(int(match.group(1)), time.time())
                time.sleep(0.5)
            flow.join()
    finally:
        emulator.stop()
    lines = _progress_lines(emulator, root)
    latencies = [min(t for s, t in seen.items() if s >= line["step"]) - line["time"]
                 for line in lines if any(s >= line["step"] for s in seen)]
    latencies = [x for x in latencies if x >= 0]
    worst = max(latencies) if latencies else float("inf")
    return {"live_lines": len(lines), "live_samples": len(latencies), "live_progress_every_s": progress_every_s,
            "live_refresh_s": live_seconds, "live_latency_median_s": round(statistics.median(latencies), 1)
            if latencies else None, "live_latency_max_s": round(worst, 1), "live_target_s": TARGET_S,
            "live_meets_target": worst <= TARGET_S, "live_state": result.get("state")}


def _progress_lines(emulator, root: Path) -> list:
    """The session's own progress lines, from the kernel log the emulator stored."""
    from relay.emulator.runner import read_log
    from relay.shared.progress_line import parse

    log = read_log(emulator.store.kernel_dir("bench/bench-live-session", 1) / "log.json")
    records = [parse(entry.get("data", "")) for entry in log]
    return [r for r in records if r and r.get("kind") == "train"]


def format_lines(f: dict) -> list:
    return [f"live view (a session's progress line -> the Prefect progress artifact, watch mode; lines every"
            f" {f['live_progress_every_s']} s, refresh every {f['live_refresh_s']} s):",
            f"  latency median {f['live_latency_median_s']} s, max {f['live_latency_max_s']} s over"
            f" {f['live_samples']} lines (target <= {f['live_target_s']} s)"
            f"  {'OK' if f['live_meets_target'] else 'MISSED'}"]


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    figures = run(**({"steps": 40, "step_s": 0.5, "progress_every_s": 5.0, "live_seconds": 5.0} if quick else {}))
    print("\n".join(format_lines(figures)))
