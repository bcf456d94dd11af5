"""The relay's flows log what a person reads: Prefect's own "Finished in state Completed()" line, one per task run
(an observe, a quota read, a push: dozens per session), is dropped for the relay's flows. A task that fails or
crashes still logs its end (at ERROR), and every other flow's task runs log as Prefect does."""
from __future__ import annotations

import logging

RELAY_FLOWS = ("relay", "relays")


class DropCompletedTaskRuns(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.INFO and getattr(record, "flow_name", None) in RELAY_FLOWS
                    and str(record.msg).startswith("Finished in state Completed("))


def install() -> None:
    """Once per process (the filter sits on the logger every task run's logger adapts)."""
    logger = logging.getLogger("prefect.task_runs")
    if not any(isinstance(f, DropCompletedTaskRuns) for f in logger.filters):
        logger.addFilter(DropCompletedTaskRuns())
