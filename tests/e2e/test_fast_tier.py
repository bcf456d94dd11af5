"""The fast tier's guard (tests/conftest.py): under `-m "not slow"` a test that is not marked slow and starts a
process fails, whichever way it starts it. (Patching `_posixsubprocess.fork_exec` alone missed `subprocess`,
which binds it at its import: 36 process-starting tests ran in `make test-fast` unnoticed.)"""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import pytest

STARTS = {
    "subprocess.run": lambda: subprocess.run([sys.executable, "-c", "pass"], check=True),
    "subprocess.Popen": lambda: subprocess.Popen(["true"]).wait(),
    "os.posix_spawn": lambda: os.waitpid(os.posix_spawn("/bin/true", ["true"], dict(os.environ)), 0),
    "os.system": lambda: os.system("true"),
    "os.fork": lambda: os.fork() or os._exit(0),
    "multiprocessing spawn": lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
}


@pytest.mark.parametrize("start", list(STARTS))
def test_in_the_fast_tier_a_test_that_starts_a_process_fails_and_says_how_to_mark_it(start, request):
    if "not slow" not in (request.config.option.markexpr or ""):
        pytest.skip("the guard is on in the fast tier only (-m 'not slow'); unguarded this would start a process")
    with pytest.raises(RuntimeError, match="starts a process but is not marked slow: request the "
                                           "`spawns_processes` fixture"):
        STARTS[start]()
