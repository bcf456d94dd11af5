"""The session's progress as log lines meant to be parsed: `relay-progress {json}`.

Kaggle streams a running session's log (docs/kaggle.md, "Live log streaming"); the orchestrator follows it and
shows the running session in Prefect while it trains (relay/orchestrator/live_progress.py). One line per metrics
record at most every RELAY_PROGRESS_EVERY seconds (default 30), evals, stage changes and the session's end always: a
12 h session prints ~1.5k lines, nothing a log viewer or the stream chokes on.
"""
from __future__ import annotations

import json
import math
import sys
import time
from typing import Any, Callable, Optional, Sequence
from relay.shared.environment import SessionEnvironment

PREFIX = "relay-progress "
_KEYS = ("step", "kind", "loss", "lr", "samples_per_s", "micro_batch", "grad_accum", "stage", "epoch",
         "gpu_peak_mb", "gpu_alloc_mb", "rss_mb")


class ProgressLines:
    def __init__(self, session: int, step_start: int, total_steps: int,
                 time_left: Callable[[], Optional[float]] = lambda: None, every_s: Optional[float] = None,
                 write: Callable[[str], Any] = None, run_id: Optional[str] = None):
        self.base = {"run_id": run_id, "session": session, "step_start": step_start, "total_steps": total_steps}
        self.time_left = time_left
        self.every_s = SessionEnvironment.read().progress_every_s if every_s is None else every_s
        self._write = write or (lambda line: print(line, file=sys.stdout, flush=True))
        self._last = -math.inf
        self._stage: Optional[str] = None

    def __call__(self, record: dict, force: bool = False) -> None:
        now = time.monotonic()
        stage = record.get("stage")
        due = force or record.get("kind", "train") != "train" or stage != self._stage or now - self._last >= self.every_s
        self._stage = stage or self._stage
        if not due:
            return
        self._last = now
        if record.get("kind") == "eval":  # every value an eval metric: eval_loss, eval_smape ...
            line = {**self.base, "step": record.get("step"), "kind": "eval",
                    **{f"eval_{k}": v for k, v in record.items() if k not in ("session", "time", "kind", "step", "epoch")}}
        else:
            line = {**self.base, **{k: record[k] for k in (*_KEYS, "status", "stop_reason", "why") if k in record}}
        line["time"] = round(time.time(), 1)
        left = self.time_left()
        if left is not None and math.isfinite(left):
            line["time_left_s"] = round(left, 1)
        self._write(PREFIX + json.dumps(line, default=float, allow_nan=True))

    def end(self, step: int, status: str, stop_reason: Optional[str], why: Optional[str] = None) -> None:
        """The session's last line; `why` says what a stop reason alone does not ("stalled at step 5 after 10m")."""
        self({"kind": "end", "step": step, "status": status, "stop_reason": stop_reason,
              **({"why": why} if why else {})}, force=True)


def parse(text: str) -> Optional[dict]:
    """The record of one log line, None for any other line."""
    at = text.find(PREFIX)
    if at < 0:
        return None
    try:
        value = json.loads(text[at + len(PREFIX):].strip())
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def newest(records: Sequence[dict], kinds: tuple = ("train", "end"), has: Optional[str] = None) -> Optional[dict]:
    """The newest record of one of `kinds` with a value for `has`: by default where the session is (its latest
    train line, or its end line); None when there is none."""
    return next((r for r in reversed(records) if r.get("kind") in kinds and (has is None or r.get(has) is not None)),
                None)
