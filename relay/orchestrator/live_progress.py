"""The running session, live: its progress lines read from Kaggle's log stream while it trains.

A thread follows `backend.log_stream` (the client's kernels_logs_stream: server-sent events while the session
runs, the stored log after) and keeps the session's `relay-progress` records (relay/shared/progress_line.py)
of one run id. The stream replays from the start on every connection, so after a drop it reconnects and skips
the events it has already counted: nothing is counted twice. Early warnings are pure functions of the records.
What the live view shows of it is session_view.py's (written into Prefect by tasks/live_view.py); `relay logs`
and handoff.deadline_from_log read it too.
"""
from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Callable, List, Optional

from relay.shared.progress_line import newest, parse

log = logging.getLogger(__name__)


class LiveSession:
    def __init__(self, backend, kernel: str, run_id: str, max_reconnects: int = 30,
                 sleep: Callable[[float], None] = time.sleep, on_event: Optional[Callable[[dict], None]] = None):
        self.backend, self.kernel, self.run_id = backend, kernel, run_id
        self.on_event = on_event  # given every log event once, in order (`relay logs`)
        self.records: List[dict] = []
        self.reconnects = 0
        self.ended = False           # the stream said END_OF_LOG, or served the stored log
        self.last_record_at: Optional[float] = None  # time.monotonic() of the newest record
        self.started_at = time.monotonic()
        self._seen = 0
        self._max_reconnects, self._sleep = max_reconnects, sleep
        self._closed = False
        self._new = threading.Condition()
        self._thread = threading.Thread(target=self._follow, name=f"live-{run_id}", daemon=True)

    def start(self) -> "LiveSession":
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop following: the reader ends at the stream's next event or read timeout (a daemon thread)."""
        self._closed = True

    def _follow(self) -> None:
        while not self.ended and not self._closed and self.reconnects <= self._max_reconnects:
            try:
                for index, event in enumerate(self.backend.log_stream(self.kernel)):
                    if self._closed:
                        return
                    if index < self._seen:
                        continue  # a replay after a reconnect
                    self._seen += 1
                    if self.on_event is not None:
                        self.on_event(event)
                    self._take(event)
                self.ended = True
            except Exception as err:  # noqa: BLE001 - a dropped stream is reconnected, never fatal
                self.reconnects += 1
                log.info("log stream of %s dropped (%s); reconnect %d", self.kernel, err, self.reconnects)
                self._sleep(min(30.0, 0.5 * 2 ** min(self.reconnects, 6)))
        with self._new:
            self._new.notify_all()

    def _take(self, event: dict) -> None:
        record = parse(str(event.get("data", "")))
        if record is None or record.get("run_id") != self.run_id:
            return  # another line, or the previous version's log (Kaggle's lag right after a push)
        with self._new:
            self.records.append(record)
            self.last_record_at = time.monotonic()
            self._new.notify_all()

    def wait(self, seconds: float, until: Callable[[List[dict]], bool] = lambda records: False) -> List[dict]:
        """Wait up to `seconds` for `until(records)` or the stream's end; the records so far."""
        deadline = time.monotonic() + seconds
        with self._new:
            while not until(self.records) and not self.ended and self._thread.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._new.wait(left)
            return list(self.records)

    @property
    def finished(self) -> bool:
        """The stream ended, or its reader gave up after too many drops."""
        return self.ended or not self._thread.is_alive()

    @property
    def latest(self) -> Optional[dict]:
        return newest(self.records)

    def silent_for(self) -> float:
        """Seconds since the newest progress line (since following began, before the first)."""
        return time.monotonic() - (self.last_record_at or self.started_at)


def early_warnings(records: List[dict], *, median_window: int = 20, blowup: float = 10.0,
                   slow_below: Optional[float] = None) -> List[tuple]:
    """(key, message) of each warning the records show, each key once per session:
    - the loss is not finite, or above `blowup` x the median of the previous `median_window` train losses;
    - the session backed off memory (its micro-batch shrank);
    - it trains slower than `slow_below` samples/s (the speed the plan assumed), after its first minute."""
    out, losses, micro = {}, [], None
    for r in records:
        if r.get("kind") != "train":
            continue
        loss, step = r.get("loss"), r.get("step")
        if loss is not None:
            if not math.isfinite(loss):
                out.setdefault("nonfinite", f"the loss is {loss} at step {step}")
            elif len(losses) >= 3 and loss > blowup * statistics.median(losses[-median_window:]):
                out.setdefault("blowup", f"the loss is blowing up: {loss:.4g} at step {step}, over {blowup:g}x the"
                                         f" median of the last {min(len(losses), median_window)} ({statistics.median(losses[-median_window:]):.4g})")
            losses.append(loss)
        if micro is not None and r.get("micro_batch") is not None and r["micro_batch"] < micro:
            out.setdefault("oom", f"the session backed off memory at step {step}: micro-batch {micro} ->"
                                  f" {r['micro_batch']} (grad_accum {r.get('grad_accum')})")
        micro = r.get("micro_batch", micro)
    speeds = [r["samples_per_s"] for r in records if r.get("kind") == "train" and r.get("samples_per_s")]
    if slow_below and len(speeds) >= 3 and statistics.median(speeds[-3:]) < 0.5 * slow_below:
        out.setdefault("slow", f"the session trains at {statistics.median(speeds[-3:]):.3g} samples/s, under half"
                               f" the {slow_below:.3g} the plan assumed from earlier sessions")
    return list(out.items())


def running_row(records: List[dict], kernel_state: str = "running") -> Optional[dict]:
    """The running session as a row of report.session_table (stop_reason "running")."""
    latest = newest(records)
    if latest is None:
        return None
    first = records[0]
    losses = [r["loss"] for r in records if r.get("kind") == "train" and r.get("loss") is not None]
    return {"session": latest.get("session"), "run_id": latest.get("run_id"), "start": None, "duration_s": None,
            "billed_gpu_s": None, "steps": int(latest["step"]) - int(first.get("step_start", 0)),
            "world_size": None, "samples_per_s": _round(latest.get("samples_per_s"), 1),
            "peak_mem_mb": latest.get("gpu_peak_mb"), "loss_end": _round(losses[-1], 5) if losses else None,
            "stop_reason": kernel_state if latest.get("kind") != "end" else
            f"process ended ({latest.get('stop_reason')}); Kaggle: {kernel_state}",
            "gpus": None}


def as_metrics(records: List[dict]) -> List[dict]:
    """Progress records as metrics.jsonl records (for the loss curve with the running session)."""
    out = []
    for r in records:
        if r.get("kind") == "train":
            out.append({k: v for k, v in r.items() if k not in ("run_id", "step_start", "total_steps", "time_left_s")})
        elif r.get("kind") == "eval":
            out.append({"kind": "eval", "step": r["step"], "session": r.get("session"),
                        **{k[len("eval_"):]: v for k, v in r.items() if k.startswith("eval_")}})
    return out


@dataclass(frozen=True)
class Eta:
    """The one estimate of the running session: the progress text, the plan and `relay status` all say this."""

    session: Optional[int]
    step: int
    step_start: int
    total_steps: int
    steps_per_s: float
    session_end_step: int      # where the session stops: its step cap, its budget or the run's end
    ends_by: str               # which of the three: "its step cap", "its budget", "the run's end"
    session_left_s: float
    run_left_s: float          # training left for the whole run at this speed
    started_at: float          # unix time of the session's first progress line
    as_of: float               # unix time of the newest progress line

    @property
    def session_ends_at(self) -> float:
        return self.as_of + self.session_left_s

    @property
    def fraction(self) -> float:
        """How far the session is, 0..1, by its steps."""
        span = self.session_end_step - self.step_start
        return 1.0 if span <= 0 else min(1.0, max(0.0, (self.step - self.step_start) / span))


def estimate(records: List[dict], session_max_steps: Optional[int] = None) -> Optional[Eta]:
    """The running session's end and the run's remaining training at the speed measured since its first
    progress line; None before two timed lines. A session stops at the first of: its step cap
    (`session.max_steps`), its budget (the time left its lines report), the run's last step."""
    timed = [r for r in records if r.get("kind") == "train" and r.get("time") is not None and r.get("step") is not None]
    if len(timed) < 2 or timed[-1]["time"] <= timed[0]["time"] or timed[-1]["step"] <= timed[0]["step"]:
        return None
    first, latest = timed[0], timed[-1]
    speed = (latest["step"] - first["step"]) / (latest["time"] - first["time"])
    step, start = int(latest["step"]), int(latest.get("step_start") or 0)
    total = int(latest.get("total_steps") or step)
    ends = [(total, "the run's end")]
    if session_max_steps:
        ends.append((start + int(session_max_steps), "its step cap"))
    left = latest.get("time_left_s")
    if left is not None and math.isfinite(left):
        ends.append((step + int(left * speed), "its budget"))
    end_step, ends_by = min(ends, key=lambda e: e[0])
    end_step = max(end_step, step)
    return Eta(latest.get("session"), step, start, total, speed, end_step, ends_by, (end_step - step) / speed,
               max(0, total - step) / speed, float(first["time"]), float(latest["time"]))


def session_fraction(records: List[dict], session_max_steps: Optional[int] = None) -> float:
    """How far the running session is, 0..1, by its steps: against the estimate's end when there is one, else
    against its step cap or the run's end (a session bounded only by its budget: 0 until its speed is known)."""
    eta = estimate(records, session_max_steps)
    if eta is not None:
        return eta.fraction
    latest = newest(records, ("train",), has="step")
    if latest is None:
        return 0.0
    start = int(latest.get("step_start") or 0)
    ends = [e for e in (latest.get("total_steps"), start + session_max_steps if session_max_steps else None) if e]
    if not ends or latest.get("time_left_s") is not None and not session_max_steps:
        return 0.0
    span = min(ends) - start
    return 1.0 if span <= 0 else min(1.0, max(0.0, (int(latest["step"]) - start) / span))


def eta_text(records: List[dict], session_max_steps: Optional[int] = None, deadline: Optional[float] = None,
             kernel_state: Optional[str] = None, now: Optional[float] = None) -> str:
    """This session's end and the run's remaining training time at the measured speed; once its `end` line came:
    that Kaggle ended the session (`kernel_state` finished), or that Kaggle still runs it and until when it waits
    before calling it wedged (`deadline`, unix time), or, past it, that it is wedged and charging quota."""
    latest = newest(records)
    if latest is not None and latest.get("kind") == "end":
        ended = time.strftime("%H:%M UTC", time.gmtime(latest["time"])) if latest.get("time") else "?"
        said = f"its process ended at step {latest.get('step')} ({latest.get('stop_reason') or 'end'}, {ended})"
        if kernel_state in ("complete", "error", "cancelled", "cancel_acknowledged"):
            return f"{said}; Kaggle ended the session ({kernel_state})"
        if deadline is None:
            return f"{said}; waiting for Kaggle to end the session (wedged if it still runs at its deadline)"
        at = time.strftime("%H:%M:%S UTC", time.gmtime(deadline))
        if (time.time() if now is None else now) < deadline:
            return (f"{said}; Kaggle still shows the session running: wedged if it still does at its deadline,"
                    f" {at} (the relay waits until then)")
        return (f"{said}; WEDGED: Kaggle still runs the session past its deadline ({at}), charging GPU time that"
                " trains nothing; the relay acts on it (kaggle.on_wedged)")
    if deadline is not None and kernel_state == "running" and (time.time() if now is None else now) >= deadline:
        at = time.strftime("%H:%M:%S UTC", time.gmtime(deadline))
        return (f"WEDGED: Kaggle still runs the session past its deadline ({at}), its newest line at step"
                f" {latest.get('step') if latest else '?'}; the relay acts on it (kaggle.on_wedged)")
    eta = estimate(records, session_max_steps)
    if eta is None:
        return "ETA: after the next progress lines"
    ends = time.strftime("%H:%M UTC", time.gmtime(eta.session_ends_at))
    return (f"session ends in ~{_hm(eta.session_left_s)} at step {eta.session_end_step} ({eta.ends_by}, ~{ends});"
            f" the run needs ~{_hm(eta.run_left_s)} of training at {eta.steps_per_s:.3g} steps/s")


def _round(value: Optional[float], digits: int) -> Optional[float]:
    return round(value, digits) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _hm(seconds: float) -> str:
    h, m = divmod(int(seconds) // 60, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{int(seconds) % 60:02d}s"
