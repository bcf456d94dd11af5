"""The relay's Prefect step lock after its holder was SIGKILLed while holding it: the next run takes the slot
back one lease after the holder's last renewal, says what it waits for, and logs no error. Both places a
holder's lease can live: the shared server both use, and a server of the holder's own (what `relay run`
starts for itself without PREFECT_API_URL), which died with it. Real Prefect server, real processes."""
from __future__ import annotations

import logging
import os
import signal
import subprocess

import pytest

from relay_fixtures import PYTHON, REPO, clean_env

LEASE_S = 2.0  # how long after the holder's last renewal its slot is taken back (production: 60 s)
LIVE_S = 300.0  # a live holder's lease where a check needs it live: no check but the lapse waits on the wall clock
HOLDER = """
import sys, time
from tasks.step_lock import StepLock
lock = StepLock(sys.argv[1], wait_s=60, lease_s=float(sys.argv[2]))
assert lock.acquire(), "the holder could not take a free slot"
print("held", flush=True)
time.sleep(600)
"""


LOGGERS = [logging.getLogger(name) for name in ("", "prefect", "tasks.step_lock")]  # Prefect's do not propagate


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.mark.parametrize("holder_server", ["shared", "own"])
def test_a_killed_holders_slot_is_taken_back_after_its_lease(prefect_api, tmp_path, holder_server):
    from prefect.settings import PREFECT_API_DATABASE_CONNECTION_URL

    from tasks.step_lock import StepLock

    name = f"killed-holder-{holder_server}"
    env = clean_env(HOME=str(tmp_path), TMPDIR=str(tmp_path), PREFECT_HOME=os.environ["PREFECT_HOME"],
                    PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
    if holder_server == "shared":
        env["PREFECT_API_URL"] = prefect_api
    else:  # its own ephemeral server on the same database, as two `relay run`s with one PREFECT_HOME
        env["PREFECT_API_DATABASE_CONNECTION_URL"] = PREFECT_API_DATABASE_CONNECTION_URL.value()
        env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "120"
    holder = subprocess.Popen([PYTHON, "-c", HOLDER, name, str(LEASE_S)], cwd=REPO, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        lines = []
        for line in holder.stdout:  # the holder has the slot: an event, not a wait
            lines.append(line)
            if line.strip() == "held":
                break
        assert lines and lines[-1].strip() == "held", "".join(lines)
        os.killpg(holder.pid, signal.SIGKILL)  # its own server (a child in its group) dies with it
        assert holder.wait() == -signal.SIGKILL
    finally:
        if holder.poll() is None:
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait()

    seen = _Records()
    for logger in LOGGERS:
        logger.addHandler(seen)
    logging.getLogger("tasks.step_lock").setLevel(logging.INFO)
    waiter = StepLock(name, wait_s=300, lease_s=LIVE_S, poll_s=0.2)  # the wait is never spent unless it fails
    try:
        assert waiter.acquire(), "the killed holder's slot was not taken back"
    finally:
        waiter.release()
        for logger in LOGGERS:
            logger.removeHandler(seen)
    said = list(dict.fromkeys(r.getMessage() for r in seen.records if r.name == "tasks.step_lock"))
    # "waiting for it" first unless the holder's lease had already run out when the waiter first looked (a
    # busy machine takes longer than LEASE_S from the kill to that look): either way, the slot is taken back
    taken = [i for i, m in enumerate(said) if "stopped renewing it" in m and "taking its slot back" in m]
    assert taken, said
    assert all("held by holder" in m and "waiting for it" in m for m in said[:taken[0]]), said
    assert not [r.getMessage() for r in seen.records if r.levelno >= logging.ERROR]

    again = StepLock(name, wait_s=300, lease_s=LIVE_S, poll_s=0.2)  # the slot is free, and counted once
    try:
        assert again.acquire()
        assert not StepLock(name, wait_s=0.5, lease_s=LIVE_S, poll_s=0.2).acquire()
    finally:
        again.release()
