"""CPU seconds per test, in the parallel suite as CI runs it: a pytest plugin and its report.

    PYTHONPATH=bench RELAY_TEST_CPU=/tmp/cpu make test PYTEST_ADDOPTS="-p pytest_cpu"
    python bench/pytest_cpu.py /tmp/cpu [--top 30]

On 2 cores the suite is bounded by CPU, not by its workers' waits (bench/suite_cpu.py: the machine is busy all
the way), so a test's cost is the CPU it makes the machine spend, not its wall time beside 3 other workers. Each
test is charged what its xdist worker spent (its own and its reaped children's rusage) plus what every live
descendant of the worker spent meanwhile (a flow process, the emulator's kernels under their zygote, the
session's Prefect server): read from /proc before and after the test. A descendant that ended during the test
is charged only what it spent since the test began (its earlier CPU went to the tests before). What a process
spends after it left the worker's tree (an orphan) is missed. Linux only.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import sys
import time
from pathlib import Path

import pytest

TICK = os.sysconf("SC_CLK_TCK")


def _descendants() -> dict:
    """(pid, start time) -> CPU seconds with its reaped children, for every process under this one."""
    parent, cpu = {}, {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            text = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue  # ended meanwhile
        fields = text[text.rindex(")") + 2:].split()  # after the command's name, which may hold spaces
        parent[int(name)] = int(fields[1])
        cpu[(int(name), fields[19])] = sum(int(f) for f in fields[11:15]) / TICK  # utime stime cutime cstime
    me, under = os.getpid(), {}
    for (pid, start), seconds in cpu.items():
        ancestor, hops = parent.get(pid), 0
        while ancestor not in (None, 0, me) and hops < 64:
            ancestor, hops = parent.get(ancestor), hops + 1
        if ancestor == me:
            under[(pid, start)] = seconds
    return under


def _own() -> float:
    mine, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return mine.ru_utime + mine.ru_stime + reaped.ru_utime + reaped.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # noqa: ARG001 (pytest's signature)
    start, own, before = time.monotonic(), _own(), _descendants()
    yield
    after = _descendants()
    # a process that ended: its whole life reached a reaper's rusage now, of which `before` was charged already
    ended = sum(seconds for key, seconds in before.items() if key not in after)
    cpu = _own() - own + sum(s - before.get(key, 0.0) for key, s in after.items()) - ended
    out = Path(os.environ.get("RELAY_TEST_CPU", "test-cpu"))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{os.getpid()}.jsonl", "a") as f:
        f.write(json.dumps({"test": item.nodeid, "cpu_s": round(cpu, 2),
                            "wall_s": round(time.monotonic() - start, 2)}) + "\n")


def report(folder: Path, top: int) -> None:
    rows = [json.loads(line) for path in sorted(folder.glob("*.jsonl")) for line in path.read_text().splitlines()]
    if not rows:
        sys.exit(f"{folder}: no *.jsonl here (run the suite with -p pytest_cpu and RELAY_TEST_CPU={folder})")
    total = sum(r["cpu_s"] for r in rows)
    print(f"{len(rows)} tests, {total / 60:.1f} CPU min charged to tests (the workers' start-up and collection not)")
    print(f"\n{'CPU s':>7} {'wall s':>7} {'cum':>5}  test")
    running = 0.0
    for r in sorted(rows, key=lambda r: -r["cpu_s"])[:top]:
        running += r["cpu_s"]
        print(f"{r['cpu_s']:7.1f} {r['wall_s']:7.1f} {running / total:5.0%}  {r['test']}")
    by_file = collections.defaultdict(lambda: [0.0, 0])
    for r in rows:
        by_file[r["test"].split("::")[0]][0] += r["cpu_s"]
        by_file[r["test"].split("::")[0]][1] += 1
    print(f"\n{'CPU s':>7} {'tests':>5}  file")
    for name, (cpu, count) in sorted(by_file.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{cpu:7.1f} {count:5d}  {name}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="CPU seconds per test from a run with -p pytest_cpu")
    parser.add_argument("folder", type=Path, help="the RELAY_TEST_CPU folder of the run")
    parser.add_argument("--top", type=int, default=30, help="how many tests and files to list (default 30)")
    args = parser.parse_args()
    report(args.folder, args.top)
