"""The Prefect a relay starts for itself when no PREFECT_API_URL names one (`relay run`, its ticks, `make demo`):
`configure()` sets it up, once, before Prefect is imported.

- A startup timeout for a busy machine (EMBEDDED_STARTUP_S).
- No usage heartbeat: the server is ours, for this run only (on its SQLite, busy with the flow's writes, the
  heartbeat can also fail with a traceback that says nothing about the relay).
- No traceback for a write it retries by itself. Prefect's task-run recorder (a service of the server) stores
  task-run states in SQLite in batches. When another write holds the database (a busy machine: "database is
  locked"), it logs an ERROR with a ~60-line traceback and puts the batch back to be written again ("... (1 to
  retry, 0 dropped)"). Nothing is lost, but a newcomer's `relay run` showed it, and it failed a CI run's
  no-traceback check (docs/prefect.md, SQLite under load). `RetriedWrite` turns that record, and only that one,
  into a WARNING line; a batch dropped after its retries, or any other error, keeps its traceback. The server runs
  in a child process, so the filter goes there through Prefect's own logging settings: Prefect's default file with
  the filter added (`settings_file`), named by PREFECT_LOGGING_SETTINGS_PATH.
"""
from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import Optional

import yaml

from relay.shared import atomic

RECORDER = "prefect.server.services.task_run_recorder"
EMBEDDED_STARTUP_S = 180  # Prefect's own default (20 s) fails 4 first runs in 5 on a busy 2-core machine


def configure(folder: Path) -> None:
    """The environment of the embedded Prefect (what a user set stays), its logging settings written into
    `folder`. Call before Prefect is imported: it reads its settings then, and its server inherits them."""
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", str(EMBEDDED_STARTUP_S))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if "PREFECT_LOGGING_SETTINGS_PATH" not in os.environ and (quieter := settings_file(folder)):
        os.environ["PREFECT_LOGGING_SETTINGS_PATH"] = str(quieter)


class RetriedWrite(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if record.levelno >= logging.ERROR and exc is not None and "database is locked" in str(exc) \
                and record.getMessage().endswith(", 0 dropped)"):
            record.msg = (f"{record.getMessage()}: SQLite was busy with another write; the batch is written"
                          " again, nothing is lost")
            record.args, record.exc_info, record.exc_text = (), None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def settings_file(folder: Path) -> Optional[Path]:
    """Prefect's default logging settings with RetriedWrite on the recorder's logger, written into `folder`; None
    when Prefect's file is not where its package keeps it (the default settings stay)."""
    spec = importlib.util.find_spec("prefect")  # not imported: it reads its settings at import, after configure()
    default = Path(spec.origin).parent / "logging" / "logging.yml" if spec and spec.origin else None
    if default is None or not default.is_file():
        return None
    config = yaml.safe_load(default.read_text())  # its ${PREFECT_...} templates stay strings, filled in by Prefect
    config.setdefault("filters", {})["relay_retried_write"] = {"()": f"{__name__}.RetriedWrite"}
    config.setdefault("loggers", {})[RECORDER] = {"level": "NOTSET", "filters": ["relay_retried_write"]}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ".prefect-logging.yml"
    atomic.write_bytes(path, yaml.safe_dump(config, sort_keys=False).encode())  # another relay may be reading it
    return path
