"""`relay run` on a machine with no Prefect server: the embedded one's start-up failure is one line saying what to
do (never a traceback, nothing pushed), and a `relay run` stopped by SIGTERM (a supervisor, a CI cancel) takes its
embedded server down with it instead of leaving it running orphaned. Events, not sleeps: the start-up fails
because no server starts in no time (a limit of 0 s); the SIGTERM is sent once the server process exists."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from byo_fixtures import RELAYED, copy_example, relay_in_shell
from kaggle_fixtures import FAKE_KEY, KERNEL_ENV, USER, isolated_env, make_emulator  # noqa: F401

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_prefect_that_does_not_start_is_one_line_and_nothing_is_pushed(make_emulator, tmp_path, spawns_processes):
    emulator = make_emulator(kernel_env=dict(KERNEL_ENV))
    project = tmp_path / "my-project"
    copy_example("byo-plain", project, **RELAYED)
    ran = relay_in_shell(tmp_path, emulator, project, "run", "spec.yaml", "--tick",
                         env_extra={"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "0"})
    assert ran.returncode == 1, ran.stdout + ran.stderr[-3000:]
    assert "relay: the embedded Prefect server did not start within 0 s" in ran.stdout, ran.stdout
    assert "Traceback" not in ran.stdout + ran.stderr
    assert not emulator.store.kernels  # nothing pushed


def test_a_sigterm_takes_the_embedded_prefect_server_down_too(make_emulator, tmp_path, spawns_processes):
    emulator = make_emulator(kernel_env=dict(KERNEL_ENV))
    project = tmp_path / "my-project"
    copy_example("byo-plain", project, **RELAYED)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path / "home"), "PYTHONPATH": REPO, "KAGGLE_USERNAME": USER,
           "KAGGLE_KEY": FAKE_KEY, "RELAY_KAGGLE_ENDPOINT": emulator.url, "PREFECT_HOME": str(tmp_path / "prefect"),
           "DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "HF_HUB_OFFLINE": "1",
           "MPLCONFIGDIR": str(tmp_path / "mpl")}  # no start-up timeout: the relay sets its own
    (tmp_path / "home").mkdir(exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "relay", "run", "spec.yaml", "--poll", "0.3"], cwd=project,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    relay = psutil.Process(proc.pid)
    servers, deadline = [], time.monotonic() + 600  # a hang guard, not a speed bound
    while not servers and proc.poll() is None and time.monotonic() < deadline:
        servers = [p for p in relay.children(recursive=True) if "uvicorn" in " ".join(_cmdline(p))]
        time.sleep(0.2)
    assert servers, "the embedded Prefect server never started"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert "interrupted; nothing is lost" in out, out[-3000:]
    gone, alive = psutil.wait_procs(servers, timeout=120)
    assert not alive, f"left running: {[p.pid for p in alive]}\n{out[-3000:]}"


def _cmdline(process: psutil.Process) -> list[str]:
    """A child's command line; [] for one that ended between the listing and the read (a short-lived kernel)."""
    try:
        return process.cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return []
