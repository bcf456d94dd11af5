"""What each kind of Prefect write a relay makes costs, in CPU of the flow's process and of Prefect's server.

Against a `prefect_test_harness` server (SQLite, the tests' and a newcomer's `relay run`), in rounds that
alternate the kinds, a batch of `n` writes of each kind in one flow run:
    task run   a task with the relay's retry settings and no cache (tasks/relay_tasks.py RETRY), returning at once
    table      `create_table_artifact` of 5 rows (a relay's session table)
    summary    `create_markdown_artifact` holding one curves PNG as a data URI (a relay's summary, ~100 KB)
    progress   `update_progress_artifact` of one progress artifact (the live view's)
and the baseline, measured in the same run: the server's CPU while nothing is written (it runs its services all
the time), over each batch's own wall time, subtracted from the batch's server CPU. A batch ends when the server
is idle again (its CPU over 1 s back at the idle rate): the events it records after the last call count too.
Figures: CPU ms per write, flow process and server, medians over rounds; and each kind against a task run.

    python bench/bench_prefect_writes.py   (or bench/run.py --only prefect, which also writes bench/results.json)
"""
from __future__ import annotations

import base64
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

KINDS = ("task run", "table", "summary", "progress")


def _summary_markdown(folder: Path) -> str:
    from relay.orchestrator import report

    records = [{"kind": "train", "step": s, "loss": 2.0 / (1 + s / 50), "session": s // 150 + 1}
               for s in range(0, 450, 10)]
    png = report.plot_curves(records, folder / "curves.png")
    return f"# toy\n\n![curves](data:image/png;base64,{base64.b64encode(png.read_bytes()).decode()})\n"


def _server_cpu(proc) -> float:
    times = proc.cpu_times()
    return times.user + times.system + times.children_user + times.children_system


def _settle(proc, idle_per_s: float) -> None:
    """Until the server's CPU over one second is back within twice its idle rate (+10 ms)."""
    while True:
        before = _server_cpu(proc)
        time.sleep(1.0)
        if _server_cpu(proc) - before <= 2 * idle_per_s + 0.01:
            return


def run(n: int = 30, rounds: int = 3) -> dict:
    os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="bench-prefect-"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
    import psutil
    from prefect import flow, task
    from prefect.artifacts import create_markdown_artifact, create_progress_artifact, create_table_artifact
    from prefect.artifacts import update_progress_artifact
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.testing.utilities import prefect_test_harness

    from tasks.relay_tasks import RETRY

    markdown = _summary_markdown(Path(os.environ["PREFECT_HOME"]))

    @task(**RETRY)
    def noop(i: int) -> int:
        return i

    @flow
    def writes(kind: str, count: int) -> None:
        progress = create_progress_artifact(progress=0.0, key="bench-progress") if kind == "progress" else None
        for i in range(count):
            if kind == "task run":
                noop(i)
            elif kind == "table":
                create_table_artifact(table=[{"session": s, "steps": 150, "outcome": "steps"} for s in range(5)],
                                      key="bench-sessions")
            elif kind == "summary":
                create_markdown_artifact(markdown=markdown, key="bench-summary")
            else:
                update_progress_artifact(progress, progress=100.0 * i / count)

    per_write: dict = {(kind, side): [] for kind in KINDS for side in ("flow", "server")}
    with prefect_test_harness(server_startup_timeout=600):
        server = psutil.Process(SubprocessASGIServer._instances[None].server_process.pid)
        for kind in KINDS:
            writes(kind, 2)  # warm: imports, the flow's and each kind's first call
        start, began = _server_cpu(server), time.monotonic()
        time.sleep(10.0)
        idle_per_s = (_server_cpu(server) - start) / (time.monotonic() - began)
        for _ in range(rounds):
            for kind in KINDS:
                for count in (0, n):  # the empty flow run, so its own cost is left out
                    _settle(server, idle_per_s)
                    flow_cpu, server_cpu, wall = time.process_time(), _server_cpu(server), time.monotonic()
                    writes(kind, count)
                    _settle(server, idle_per_s)
                    spent = (time.process_time() - flow_cpu,
                             _server_cpu(server) - server_cpu - idle_per_s * (time.monotonic() - wall))
                    if count == 0:
                        empty = spent
                    else:
                        per_write[(kind, "flow")].append((spent[0] - empty[0]) / n)
                        per_write[(kind, "server")].append((spent[1] - empty[1]) / n)
    figures = {"prefect_writes_n": n, "prefect_writes_rounds": rounds,
               "prefect_server_idle_cpu_s_per_min": round(60 * idle_per_s, 2)}
    for kind in KINDS:
        key = kind.replace(" ", "_")
        for side in ("flow", "server"):
            figures[f"prefect_{key}_{side}_ms"] = round(1000 * statistics.median(per_write[(kind, side)]), 1)
    task_run = figures["prefect_task_run_flow_ms"] + figures["prefect_task_run_server_ms"]
    for kind in KINDS[1:]:
        key = kind.replace(" ", "_")
        figures[f"prefect_{key}_vs_task_run"] = round(
            (figures[f"prefect_{key}_flow_ms"] + figures[f"prefect_{key}_server_ms"]) / task_run, 2)
    return figures


def format_lines(f: dict) -> list[str]:
    lines = [f"Prefect writes, CPU ms per write (flow process + server; {f['prefect_writes_n']} writes a batch,"
             f" medians of {f['prefect_writes_rounds']} alternating rounds; the server's idle"
             f" {f['prefect_server_idle_cpu_s_per_min']} CPU s/min subtracted):"]
    for kind in KINDS:
        key = kind.replace(" ", "_")
        ratio = f"  ({f[f'prefect_{key}_vs_task_run']}x a task run)" if kind != "task run" else ""
        lines.append(f"  {kind:9s} {f[f'prefect_{key}_flow_ms']:6.1f} + {f[f'prefect_{key}_server_ms']:6.1f}{ratio}")
    return lines


if __name__ == "__main__":
    print("\n".join(format_lines(run())))
