"""bench/suite_cpu.py: a command's CPU by kind of process, its descendants included, its exit code passed on."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BURN = "import time; t = time.process_time()\nwhile time.process_time() - t < {s}: pass"


def test_it_counts_the_command_and_its_children_by_kind_and_passes_the_exit_code_on(tmp_path, spawns_processes):
    # the command (a python that burns 1 s) starts a `-m pytest`-looking child that burns 1 s and exits 3
    child = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {BURN.format(s=1)!r}, '-m pytest'])"
    script = f"{BURN.format(s=1)}\nimport subprocess, sys\nsubprocess.run([sys.executable, '-c', {child!r}])\nsys.exit(3)"
    out = tmp_path / "cpu.json"
    done = subprocess.run([sys.executable, "bench/suite_cpu.py", "--json", str(out), "--", sys.executable, "-c",
                           script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    kinds = json.loads(out.read_text())["kinds"]
    assert kinds["pytest (in-process tests, flows, emulators)"]["processes"] == 1
    # CPU when last seen: up to one interval (0.3 s) of a process's end is not counted
    assert 0.5 < kinds["pytest (in-process tests, flows, emulators)"]["cpu_s"] < 3
    assert 0.5 < kinds["other"]["cpu_s"] < 4 and kinds["other"]["processes"] == 2  # the command, the middle child
    assert "CPU min" in done.stdout and "processes  pytest" in done.stdout


def test_a_missing_command_is_one_line_exit_2(spawns_processes):
    done = subprocess.run([sys.executable, "bench/suite_cpu.py"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].endswith(
        "command: expected the command to measure after --, e.g. -- make test")
