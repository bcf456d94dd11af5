"""The relay's goodput ledger: where every GPU-second a relay was charged went (issue 47).

A pure function of the relay's session records: progress.json's `sessions` (the kernel's own clock: when each
session's clock started, its last save, its steps, its save time) and `charges`, what the orchestrator observed of
each handed-over attempt (relay/orchestrator/handoff.py `charge_record`: its push, its progress lines' last step
and end, when Kaggle showed it ended, whether it was wedged; on the emulator a test may add the quota ledger's
`kaggle_start`/`kaggle_end`). No I/O, no clock: `relay status`, the report and the tests get the same answer.

One attempt's charged time, from Kaggle's start (else its push: the queue counts, the safe side) to Kaggle's end
(else when the relay saw it end, else the process's end), is split, in this order and each at most what is left:
- start-up: to the session's clock start (the image, the kernel bundle, imports; restore is inside the clock);
- saving: what training waited for in the session's saves, as the kernel measured it (`saving_s`, summed over
  the saves its record covers); a record written before that was measured: its save time x the saves its cadence
  implies, at least one;
- training kept / training redone: the rest of the clock, per step; redone are the steps a later session trained
  again (it resumed below this one's recorded end: a corrupt version, a kill mid-save);
- after the last save until the process ended: redone for a session that did not end cleanly (killed, stalled:
  its steps since the save are trained again), the final tail otherwise (the last metrics, the export, exit);
- after the process ended until Kaggle ended it: wedged for a wedged session (until Kaggle or the relay's delete
  ended it), shut-down otherwise (Kaggle's own, plus how late the relay looked);
- an attempt that handed nothing over: failed attempt, until its last sign of life (its `end` line, else its newest
  progress line) when it was wedged, and wedged from there to when Kaggle or the relay's delete ended it;
- other: what is left (clock differences, estimates).
Goodput = training kept / charged.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence

from relay.shared.progress_line import newest, parse

CATEGORIES = ("start-up", "training kept", "training redone", "saving", "final tail", "wedged", "shut-down",
              "failed attempt", "other")
CLEAN_ENDS = {"steps", "budget", "done", "deadline", "diverged", "wrong_accelerator", "session_limit", "sigterm"}


@dataclass(frozen=True)
class AttemptLedger:
    run_id: str
    charged_s: float
    seconds: Dict[str, float]  # category -> seconds; they add up to charged_s
    failed: str = ""           # an attempt that handed nothing over: why (its charge's `failed`)
    wedged: bool = False       # Kaggle ran it on past its process's end until its deadline


@dataclass(frozen=True)
class Ledger:
    attempts: List[AttemptLedger] = field(default_factory=list)

    @property
    def charged_s(self) -> float:
        return sum(a.charged_s for a in self.attempts)

    @property
    def totals(self) -> Dict[str, float]:
        return {c: sum(a.seconds.get(c, 0.0) for a in self.attempts) for c in CATEGORIES}

    @property
    def goodput(self) -> Optional[float]:
        return self.totals["training kept"] / self.charged_s if self.charged_s > 0 else None

    def losses(self, n: int = 3) -> List[tuple]:
        """The n largest categories other than training kept, (name, seconds), largest first."""
        lost = [(c, s) for c, s in self.totals.items() if c != "training kept" and s > 0]
        return sorted(lost, key=lambda cs: -cs[1])[:n]

    def attempts_text(self) -> str:
        """"8 attempts (5 sessions handed over, 3 failed)": how every place counts sessions and attempts (an attempt
        is one push; a session is what an attempt handed over)."""
        failed = sum(1 for a in self.attempts if a.failed)
        n = len(self.attempts)
        return (f"{n} attempt{'s' if n != 1 else ''} ({n - failed} session{'s' if n - failed != 1 else ''} handed over,"
                f" {failed} failed)" if failed else f"{n} session{'s' if n != 1 else ''}")

    def line(self) -> str:
        """One line for `relay status` and the summary."""
        if not self.attempts or self.goodput is None:
            return "goodput: nothing charged yet"
        losses = ", ".join(f"{c} {duration_text(s)}" for c, s in self.losses())
        return (f"goodput {self.goodput:.0%}: {duration_text(self.totals['training kept'])} of training kept of"
                f" {duration_text(self.charged_s)} GPU time charged over {self.attempts_text()}"
                + (f"; largest losses: {losses}" if losses else ""))

    def table(self) -> str:
        """A markdown table, one row per attempt and a total, narrow enough for the Prefect UI's column (a column
        per category was 11 wide and cut at the fifth): the attempt, its charge, the training it kept, and where
        the rest went, its 3 largest shares (a wedged or failed attempt's loss is there, named)."""
        def rest(seconds: Mapping[str, float]) -> str:  # the 3 largest: every category's total is in the chart
            lost = sorted(((c, s) for c, s in seconds.items() if c != "training kept" and s >= 0.05),
                          key=lambda cs: -cs[1])
            return ", ".join(f"{c} {duration_text(s)}" for c, s in lost[:3]) or "nothing"

        def kept(a_kept: float, charged: float) -> str:
            return f"{duration_text(a_kept)} ({a_kept / charged:.0%})" if charged > 0 else duration_text(a_kept)

        head = "| attempt | charged | training kept | where the rest went |\n|---|---|---|---|\n"
        rows = [f"| {short_run_id(a.run_id)}{' (failed)' if a.failed else ''} | {duration_text(a.charged_s)} |"
                f" {kept(a.seconds.get('training kept', 0.0), a.charged_s)} | {rest(a.seconds)} |" for a in self.attempts]
        total = self.totals
        rows.append(f"| **all** | {duration_text(self.charged_s)} | {kept(total['training kept'], self.charged_s)} |"
                    f" {rest(total)} |")
        return head + "\n".join(rows)


def ledger(sessions: Sequence[Mapping], charges: Iterable[Mapping] = (), save_every_s: Optional[float] = None
           ) -> Ledger:
    """The ledger of a relay from progress.json's `sessions` and `charges` (matched by run id; a session without
    one is charged its own clock only). `save_every_s`: the spec's session.save_every, for the count of saves."""
    charges = list(charges)
    by_run = {c.get("run_id"): c for c in charges}
    out = []
    for i, s in enumerate(sessions):
        later = [n.get("step_start") for n in sessions[i + 1:] if n.get("step_start") is not None]
        at = _first(by_run.get(s.get("run_id"), {}).get("pushed_at"), s.get("started"))
        out.append((at, _attempt(s, by_run.get(s.get("run_id")) or {}, min(later) if later else None, save_every_s)))
    # an attempt that handed nothing over (retried, or wedged and deleted without a harvest) has no session record:
    # all of its time is lost (failed_charge recorded it when the relay decided to go on without it)
    handed = {s.get("run_id") for s in sessions}
    for c in charges:
        if c.get("run_id") not in handed and c.get("failed"):
            out.append(_failed_attempt(c))
    return Ledger([attempt for _, attempt in sorted(out, key=lambda pair: pair[0])])


def _failed_attempt(c: Mapping) -> tuple:
    """(start, ledger) of an attempt that handed nothing over: all of it lost; a wedged one's time after its last
    sign of life (its `end` line, else its newest progress line, else its start) is charged to wedged."""
    start = _first(c.get("kaggle_start"), c.get("pushed_at"), c.get("kaggle_end_seen"))
    end = max(start, _first(c.get("kaggle_end"), c.get("kaggle_end_seen"), c.get("process_end"), start))
    seconds = {k: 0.0 for k in CATEGORIES}
    alive = min(end, max(start, _first(c.get("process_end"), c.get("last_line"), start))) if c.get("wedged") else end
    seconds["failed attempt"], seconds["wedged"] = alive - start, end - alive
    return start, AttemptLedger(str(c.get("run_id")), end - start, seconds, failed=str(c.get("failed") or "failed"),
                                wedged=bool(c.get("wedged")))


def _attempt(s: Mapping, c: Mapping, next_start: Optional[int], save_every_s: Optional[float]) -> AttemptLedger:
    started = _num(s.get("started"))
    ended = _num(s.get("ended"), started + _num(s.get("seconds")))
    clean = s.get("stop_reason") in CLEAN_ENDS
    start = _first(c.get("kaggle_start"), c.get("pushed_at"), started)
    # a killed process's newest line (`last_line`) is a floor of its end where nothing else says when it ended
    end = max(_first(c.get("kaggle_end"), c.get("kaggle_end_seen"), c.get("process_end"), ended), start,
              _num(c.get("last_line"), start))
    # a process killed without its `end` line trained on until Kaggle's end, as far as anyone can tell
    process_end = max(ended, _num(c.get("process_end"), ended if clean else end))
    left = [end - start]

    def take(seconds: float) -> float:
        got = min(max(0.0, seconds), left[0])
        left[0] -= got
        return got

    seconds: Dict[str, float] = {c_: 0.0 for c_ in CATEGORIES}
    seconds["start-up"] = take(started - start)
    clock = max(0.0, min(ended, end) - max(started, start))
    if s.get("saving_s") is not None:
        saving = _num(s.get("saving_s"))
    else:  # a record from before the kernel measured it: the estimate
        saving = _num(s.get("save_seconds")) * (1 if not save_every_s else 1 + int(clock // save_every_s))
    seconds["saving"] = take(min(clock, saving))
    train = max(0.0, clock - seconds["saving"])
    step_start, step_end = int(s.get("step_start") or 0), int(s.get("step_end") or 0)
    steps = max(0, step_end - step_start)
    redone_steps = 0 if next_start is None else min(steps, max(0, step_end - int(next_start)))
    redone = train * redone_steps / steps if steps else 0.0
    seconds["training redone"] = take(redone)
    seconds["training kept"] = take(train - redone)
    tail = take(min(process_end, end) - ended)
    seconds["final tail" if clean else "training redone"] += tail
    seconds["wedged" if c.get("wedged") else "shut-down"] += take(end - process_end)
    seconds["other"] = left[0]
    return AttemptLedger(str(s.get("run_id") or f"session {s.get('index')}"), end - start, seconds,
                         wedged=bool(c.get("wedged")))


def charge_record(run_id: str, log_text: str, plan: Optional[Mapping], seen_end: Optional[float],
                  wedged: bool = False) -> dict:
    """What the orchestrator observed of one attempt at its hand-over, kept in the published progress.json's
    `charges` (progress.json's `sessions` come from the checkpoint, so the relay carries these itself): its push
    (the pushed plan's time, when it is this run's), its progress lines' last step and `end` line (the process's
    end, by the kernel's clock) and, for a wedged one, its deadline (`seen_end`: the relay deletes it right after).
    Nothing of the orchestrator's own clock: every orchestrator must stage the same record (handoff.py)."""
    try:  # Kaggle's log is a JSON array of {stream_name, time, data}
        log_text = "".join(entry.get("data", "") for entry in json.loads(log_text))
    except (ValueError, AttributeError, TypeError):
        pass
    lines = [r for r in (parse(t) for t in (log_text or "").splitlines())
             if r is not None and r.get("run_id") in (None, run_id)]
    end = newest(lines, ("end",), has="time")
    steps = [int(r["step"]) for r in lines if isinstance(r.get("step"), (int, float))]
    record = {"run_id": run_id, "wedged": bool(wedged)}
    if seen_end is not None:
        record["kaggle_end_seen"] = round(seen_end, 3)
    if plan and plan.get("run_id") == run_id and plan.get("pushed_at") is not None:
        record["pushed_at"] = float(plan["pushed_at"])
    if end is not None:
        record["process_end"] = float(end["time"])
    else:  # killed or stalled: it ran at least until its newest line (its steps since its last save are redone)
        times = [float(r["time"]) for r in lines if isinstance(r.get("time"), (int, float))]
        if times:
            record["last_line"] = max(times)
    if steps:
        record["last_step"] = max(steps)
    return record


def with_charge(published: Optional[Mapping], progress: dict, record: dict, failed: Iterable[Mapping] = ()) -> dict:
    """progress.json to publish: the charges handed over before (from the published one), the failed attempts
    since (`failed`: carried in this attempt's plan) and this attempt's."""
    new = [dict(c) for c in failed if c.get("run_id") != record["run_id"]] + [record]
    ids = {c["run_id"] for c in new}
    before = [c for c in (published or {}).get("charges") or [] if c.get("run_id") not in ids]
    return {**progress, "charges": before + new}


def failed_charge(run_id: str, log_text: str, plan: Optional[Mapping], ended_at: float, why: str,
                  wedged: bool = False) -> dict:
    """An attempt that hands nothing over (retried from the same checkpoint, or wedged and deleted without a
    harvest), as the relay saw it when it decided to go on without it: charged from its push to `ended_at` (when
    the relay saw it end, or deleted it), `failed` saying why. It is carried in the next attempt's pushed plan
    (failed_charges) and listed in `charges` at the next hand-over: the same record for every orchestrator."""
    record = charge_record(run_id, log_text, plan, ended_at, wedged=wedged)
    return {**record, "failed": why.split("\n")[0][:200]}


def carried(plan: Optional[Mapping], run_id: Optional[str]) -> List[dict]:
    """The failed attempts' charges the kernel's plan carries, when the plan is `run_id`'s."""
    if not plan or (run_id is not None and plan.get("run_id") != run_id):
        return []
    return [dict(c) for c in plan.get("charges") or [] if isinstance(c, Mapping) and c.get("run_id")]


def failed_charges(plan: Optional[Mapping], record: dict) -> List[dict]:
    """What the next push carries: the failed attempts the failed one's own plan carried, and it."""
    return [c for c in carried(plan, record["run_id"]) if c["run_id"] != record["run_id"]] + [record]


def from_progress(progress: Optional[Mapping], save_every_s: Optional[float] = None) -> Ledger:
    progress = progress or {}
    return ledger(progress.get("sessions") or [], progress.get("charges") or [], save_every_s)


def _num(value, default: float = 0.0) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return default
    return v if math.isfinite(v) else default


def _first(*values) -> float:
    return next(_num(v) for v in (*values, 0.0) if v is not None)


def short_run_id(run_id: str) -> str:
    """<relay>-s002-a1 -> s002-a1: the relay's name is the page's."""
    parts = str(run_id).split("-")
    return "-".join(parts[-2:]) if len(parts) > 2 and parts[-2][:1] == "s" and parts[-1][:1] == "a" else str(run_id)


def duration_text(seconds: float) -> str:
    """12s, 1.5s, 7m, 2h05m: how the ledger and the plan's figures write a duration."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f}s" if seconds >= 10 or seconds == 0 else f"{seconds:.1f}s"
    minutes = seconds / 60
    return f"{minutes:.0f}m" if minutes < 60 else f"{int(minutes // 60)}h{int(minutes % 60):02d}m"
