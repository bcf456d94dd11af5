"""RELAY_TEST_CPU_LOG=FILE (tests/conftest.py loads this then): each test's CPU seconds appended to FILE as
"seconds nodeid worker start end" lines, to find what makes the suite long on any machine (its wall time depends
on the machine's load; CPU time much less; on 2 cores the suite is bound by CPU, so CPU is what to cut).

A test is charged what its process spent (its own and its reaped children's rusage) plus what every live
descendant of the process spent meanwhile (a flow process, the emulator's kernels under their zygote, the
worker's Prefect harness server): read from /proc before and after. A descendant that ended during the test is
charged only what it spent since the test began: its earlier CPU went to the tests before (once, a process was
charged whole to the test that reaped it: a harness server's ~50 s on a worker's last test). CPU spent by a
process after it left the tree (an orphan) is missed. Linux only."""
from __future__ import annotations

import os
import resource
import time
from pathlib import Path

import pytest

TICK = os.sysconf("SC_CLK_TCK")


def descendants() -> dict:
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


def own() -> float:
    mine, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return mine.ru_utime + mine.ru_stime + reaped.ru_utime + reaped.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # noqa: ARG001 (pytest's signature)
    began, spent, before = time.time(), own(), descendants()
    yield
    after = descendants()
    # a process that ended reached its reaper's rusage whole, of which `before` was charged already
    ended = sum(seconds for key, seconds in before.items() if key not in after)
    cpu = own() - spent + sum(s - before.get(key, 0.0) for key, s in after.items()) - ended
    with open(os.environ["RELAY_TEST_CPU_LOG"], "a") as log:
        log.write(f"{cpu:.2f} {item.nodeid} {os.environ.get('PYTEST_XDIST_WORKER', '-')} {began:.1f}"
                  f" {time.time():.1f}\n")
