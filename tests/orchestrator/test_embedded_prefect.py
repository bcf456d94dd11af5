"""The embedded Prefect server of `relay run` and the demo logs a SQLite write its task-run recorder retries by
itself as one WARNING line, not an ERROR with a traceback (seen by a newcomer, and failing tests/e2e/test_control.py's
no-traceback check on a loaded CI machine); a batch it drops, or any other error, keeps its traceback. Checked the way the server
gets it: a fresh process whose Prefect reads the settings file relay writes (PREFECT_LOGGING_SETTINGS_PATH)."""
from __future__ import annotations

import os
import subprocess
import sys

from relay.orchestrator import embedded_prefect

SERVER = r'''
import logging, sqlite3
from prefect.logging.configuration import setup_logging
setup_logging()
log = logging.getLogger("prefect.server.services.task_run_recorder")
for message, error in [("Error flushing 3 events (3 to retry, 0 dropped)", sqlite3.OperationalError("database is locked")),
                       ("Error flushing 3 events (0 to retry, 3 dropped)", sqlite3.OperationalError("database is locked")),
                       ("Error flushing 2 events (2 to retry, 0 dropped)", ValueError("a real bug"))]:
    try:
        raise error
    except Exception:
        log.error(message, exc_info=True)
'''


def test_the_embedded_servers_retried_sqlite_write_is_one_warning_line_and_real_errors_keep_their_traceback(tmp_path, spawns_processes):
    settings = embedded_prefect.settings_file(tmp_path)
    assert settings is not None and settings.parent == tmp_path
    env = {**os.environ, "PREFECT_LOGGING_SETTINGS_PATH": str(settings), "PREFECT_SERVER_LOGGING_LEVEL": "WARNING"}
    ran = subprocess.run([sys.executable, "-c", SERVER], env=env, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr[-3000:]
    out = ran.stdout + ran.stderr
    retried = [line for line in out.splitlines() if "(3 to retry, 0 dropped)" in line]
    assert len(retried) == 1 and "WARNING" in retried[0], out
    assert "SQLite was busy with another write; the batch is written again, nothing is lost" in retried[0]
    assert out.count("Traceback") == 2, out  # the dropped batch's and the other error's
    assert "sqlite3.OperationalError: database is locked" in out and "ValueError: a real bug" in out


def test_configure_keeps_what_the_user_set_and_names_the_settings_it_wrote(tmp_path, monkeypatch):
    for name in ("PREFECT_LOGGING_SETTINGS_PATH", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS",
                 "PREFECT_SERVER_ANALYTICS_ENABLED"):
        monkeypatch.delenv(name, raising=False)
    embedded_prefect.configure(tmp_path / "runs")  # made if missing: the demo's folder is, at first
    assert os.environ["PREFECT_LOGGING_SETTINGS_PATH"] == str(tmp_path / "runs" / ".prefect-logging.yml")
    assert os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] == str(embedded_prefect.EMBEDDED_STARTUP_S)
    assert os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"
    monkeypatch.setenv("PREFECT_LOGGING_SETTINGS_PATH", "/theirs.yml")
    monkeypatch.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "30")
    embedded_prefect.configure(tmp_path / "other")
    assert os.environ["PREFECT_LOGGING_SETTINGS_PATH"] == "/theirs.yml"
    assert os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] == "30"
