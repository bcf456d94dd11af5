"""Where a command's CPU goes, by kind of process: `python bench/suite_cpu.py [--json FILE] -- make test`.

Runs the command and samples /proc every 0.3 s: every process descended from it (a kernel's `relay train`, a
Prefect server, a flow process, a pytest-xdist worker) is counted with its CPU seconds (user + system) when last
seen, so a process that lives less than one interval is missed (a few, cheap ones). Prints CPU minutes per kind
and the command's wall time; the suite is bounded by CPU on a 2-core machine, so this says what to cut. Linux only.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time

HZ = os.sysconf("SC_CLK_TCK")
KINDS = (  # the first pattern a command line holds names its kind
    (" -m relay train", "relay train (a session, a reference or split run)"),
    ("flow_preimports", "relay flows forked warm (tests: the processes they SIGKILL) and their zygote"),
    ("warm_zygote.py", "warm session processes (the emulator's zygote and its forks: launchers, relay train)"),
    ("source.py", "kernel launcher (the emulator's kernels)"),
    ("prefect.server.api.server:create_app", "Prefect server (test harness, ephemeral)"),
    ("prefect server start", "Prefect server (deployment tests)"),
    ("flow_driver", "relay flow in a child process (tests)"),
    ("exec(eval(sys.stdin", "pytest-xdist worker (in-process tests, flows, emulators)"),
    (" -m pytest", "pytest (in-process tests, flows, emulators)"),
    ("relay.kernel.verify", "verify-resume runs"),
    (" -m relay ", "relay CLI (run, status, doctor, ...)"),
    ("_workspace_supervisor", "Prefect worker's flow supervisor"),
    ("prefect worker", "Prefect worker"),
    ("postgres", "PostgreSQL"),
    ("multiprocessing", "DDP ranks and their forkserver (multiprocessing)"),
)


TOP = 25  # the costliest single processes are listed too: what "other" holds, which server worked hardest


def kind(cmdline: str) -> str:
    return next((name for pattern, name in KINDS if pattern in cmdline), "other")


def _stat(pid: str) -> tuple:
    text = open(f"/proc/{pid}/stat").read()
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), int(fields[19]), (int(fields[11]) + int(fields[12])) / HZ  # ppid, start, cpu


def sample(root: int, interval: float = 0.3) -> tuple:
    """({(pid, start): [cmdline, cpu seconds]} of `root` and its descendants, root's exit code) once it exits."""
    seen: dict = {}
    tree = {root}
    while True:
        done, status = os.waitpid(root, os.WNOHANG)
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                ppid, start, cpu = _stat(pid)
                if int(pid) not in tree and ppid not in tree:
                    continue
                tree.add(int(pid))
                key = (int(pid), start)
                if key not in seen:
                    seen[key] = [open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace"), 0.0]
                seen[key][1] = cpu
            except (OSError, ValueError, IndexError):  # it ended while we looked
                continue
        if done:
            return seen, os.waitstatus_to_exitcode(status)
        time.sleep(interval)


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the per-kind figures here")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command, e.g. -- make test")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("command: expected the command to measure after --, e.g. -- make test")
    started = time.monotonic()
    proc = subprocess.Popen(command)
    seen, rc = sample(proc.pid)  # it reaps the command
    wall = time.monotonic() - started
    by_kind, count = collections.Counter(), collections.Counter()
    for cmdline, cpu in seen.values():
        by_kind[kind(cmdline)] += cpu
        count[kind(cmdline)] += 1
    total = sum(by_kind.values())
    print(f"\n{' '.join(command)}: wall {wall / 60:.1f} min, CPU {total / 60:.1f} min "
          f"({100 * total / max(wall, 1e-9):.0f} % of one core; {os.cpu_count()} cores)")
    for name, cpu in by_kind.most_common():
        print(f"{cpu / 60:7.2f} CPU min {100 * cpu / max(total, 1e-9):5.1f} %  {count[name]:5d} processes  {name}")
    costliest = sorted(seen.values(), key=lambda seen_one: -seen_one[1])[:TOP]
    print(f"the {TOP} costliest processes:")
    for cmdline, cpu in costliest:
        print(f"{cpu:7.1f} CPU s  {kind(cmdline)[:40]:40}  {cmdline[:110]}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"wall_s": wall, "cpu_s": total, "kinds": {k: {"cpu_s": v, "processes": count[k]}
                                                                 for k, v in by_kind.items()},
                       "costliest": [{"cpu_s": cpu, "command": cmdline} for cmdline, cpu in costliest]}, out, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
