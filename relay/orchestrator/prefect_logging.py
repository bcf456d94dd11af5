"""The embedded Prefect server of `relay run`, without a traceback for a write it retries by itself.

Prefect's task-run recorder (a service of the server) stores task-run states in SQLite in batches. When another
write holds the database (a busy machine: "database is locked"), it logs an ERROR with a ~60-line traceback and
puts the batch back to be written again ("... (1 to retry, 0 dropped)"). Nothing is lost, but a newcomer's
`relay run` shows a traceback that says nothing about the relay (docs/prefect.md, SQLite under load).
`RetriedWrite` turns that record, and only that one, into a WARNING line; a batch dropped after its retries, or
any other error, keeps its traceback. The server runs in a child process, so the filter goes there through
Prefect's own logging settings: Prefect's default file with the filter added (`settings_file`), named by
PREFECT_LOGGING_SETTINGS_PATH.
"""
from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Optional

import yaml

from relay.shared import atomic

RECORDER = "prefect.server.services.task_run_recorder"


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
    spec = importlib.util.find_spec("prefect")  # not imported: its settings are read at import, after ours
    default = Path(next(iter(spec.submodule_search_locations or []), "")) / "logging" / "logging.yml" if spec else None
    if default is None or not default.is_file():
        return None
    config = yaml.safe_load(default.read_text())  # its ${PREFECT_...} templates stay strings, filled in by Prefect
    config.setdefault("filters", {})["relay_retried_write"] = {"()": f"{__name__}.RetriedWrite"}
    config.setdefault("loggers", {})[RECORDER] = {"level": "NOTSET", "filters": ["relay_retried_write"]}
    path = folder / ".prefect-logging.yml"
    atomic.write_bytes(path, yaml.safe_dump(config, sort_keys=False).encode())  # another relay may be reading it
    return path
