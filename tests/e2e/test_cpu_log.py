"""RELAY_TEST_CPU_LOG (tests/cpu_log.py): each test charged the CPU it made its process and the process's
descendants spend, a child that ends in a later test charged to each what it spent meanwhile (not its whole life
twice)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BURN = "import time\ndef burn(s):\n    t = time.process_time()\n    while time.process_time() - t < s: pass\n"
INNER = BURN + '''
import subprocess, sys, time
from pathlib import Path

CHILD = {child!r}
held = []

def test_in_process():
    burn(0.6)

def test_a_child_waited_for():
    subprocess.run([sys.executable, "-c", {burn_child!r}], check=True)

def test_starts_a_child_that_outlives_it():
    flag = Path({flag!r})
    held.append(subprocess.Popen([sys.executable, "-c", CHILD, str(flag)]))
    while not flag.exists():
        time.sleep(0.01)

def test_reaps_it():
    assert held.pop().wait(60) == 0
'''


def test_each_test_is_charged_its_own_cpu_and_a_childs_life_once(tmp_path, spawns_processes):
    child = BURN + "import sys\nburn(0.4)\nopen(sys.argv[1], 'w').close()\nburn(0.4)\n"
    (tmp_path / "test_inner.py").write_text(INNER.format(child=child, burn_child=BURN + "burn(0.6)",
                                                         flag=str(tmp_path / "flag")))
    out = tmp_path / "cpu.log"
    env = dict(os.environ, PYTHONPATH=str(REPO / "tests"), RELAY_TEST_CPU_LOG=str(out))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "cpu_log", "-p", "no:cacheprovider",
                           "-p", "no:xdist", "test_inner.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    cpu = {line.split()[1].split("::")[1]: float(line.split()[0]) for line in out.read_text().splitlines()}
    assert 0.55 < cpu["test_in_process"] < 1.0, cpu
    assert 0.55 < cpu["test_a_child_waited_for"] < 1.5, cpu  # its interpreter's start-up too
    # the outliving child burned 0.4 s before its flag, 0.4 after: split between the two tests, counted once
    assert 0.35 < cpu["test_starts_a_child_that_outlives_it"] < 1.2, cpu
    assert cpu["test_reaps_it"] < 0.6, cpu
    assert 0.75 < cpu["test_starts_a_child_that_outlives_it"] + cpu["test_reaps_it"] < 1.6, cpu

