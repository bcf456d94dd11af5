"""What a relay did: a session table and PNGs (loss/metric curves, session timeline) from its outputs.

Inputs are a session workdir (DIR/progress.json + DIR/metrics.jsonl) or a folder of harvested outputs
(one such folder per session, found recursively). Every reader is tolerant: optional keys may be absent,
and a truncated last line of metrics.jsonl (a session killed mid-write) is skipped.

Longer than most modules (~420 lines) because a table and two figures belong together, and plot_curves and
plot_timeline are drawing scripts (one matplotlib figure each, read top to bottom) that would only scatter
if cut into helpers.
"""
from __future__ import annotations

import json
import math
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from relay.orchestrator import attempts, canvas
from relay.orchestrator.plan import Plan, as_utc, format_duration
from relay.shared import accelerators, runtime

PROGRESS = "progress.json"
METRICS = "metrics.jsonl"
# Keys of a metrics record that are bookkeeping, not metrics.
RECORD_KEYS = {"step", "session", "time", "kind", "epoch", "lr", "samples_per_s", "run_id"}


# ---------------------------------------------------------------- reading

def find_files(root: str | Path, name: str) -> list[Path]:
    """`root/name` if present, else every `name` below root (harvested outputs), in path order."""
    root = Path(root)
    if root.is_file():
        return [root]
    direct = root / name
    return [direct] if direct.is_file() else sorted(root.rglob(name))


def load_progress(root: str | Path) -> dict[str, Any]:
    """progress.json of a workdir; across harvested outputs, the most advanced one with every
    session any of them recorded (later copies of a session replace earlier ones)."""
    found = []
    for path in find_files(root, PROGRESS):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: unreadable progress.json ({err})") from None
    if not found:
        raise FileNotFoundError(f"no {PROGRESS} in {root}")
    found.sort(key=lambda p: p.get("global_step") or 0)
    merged = dict(found[-1])
    sessions: dict[Any, dict] = {}
    for progress in found:
        for s in progress.get("sessions") or []:
            sessions[(s.get("index"), s.get("run_id"))] = s
    merged["sessions"] = sorted(sessions.values(), key=lambda s: (s.get("index") or 0, s.get("started") or 0))
    return merged


def read_metrics(source: str | Path | Iterable[str | Path]) -> list[dict[str, Any]]:
    """All records of one metrics.jsonl, several, or every one under a folder, in file order."""
    paths: list[Path] = []
    for item in [source] if isinstance(source, (str, Path)) else source:
        paths += find_files(item, METRICS) if Path(item).is_dir() else [Path(item)]
    records = []
    for path in paths:
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a partial line from a session killed mid-write
            if isinstance(record, dict) and isinstance(record.get("step"), (int, float)):
                records.append(record)
    return records


def dedupe_metrics(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One record per (kind, step): the last one written. A killed session's steps are redone by the
    next one, whose record wins (ordered by session, then by input order). Sorted by kind, step."""
    ordered = sorted(enumerate(records), key=lambda ir: (ir[1].get("session") or 0, ir[0]))
    latest: dict[tuple[str, int], dict] = {}
    for _, r in ordered:
        latest[(r.get("kind") or "train", int(r["step"]))] = dict(r)
    return [latest[k] for k in sorted(latest)]


def _coerce_records(metrics: Any) -> list[dict[str, Any]]:
    if isinstance(metrics, (str, Path)) or (isinstance(metrics, Sequence) and metrics
                                            and isinstance(metrics[0], (str, Path))):
        return read_metrics(metrics)
    return [dict(r) for r in metrics]


# ---------------------------------------------------------------- session table

COLUMNS = [  # (row key, terminal heading)
    ("session", "session"), ("run_id", "run id"), ("start", "start (UTC)"), ("duration_s", "duration"),
    ("billed_gpu_s", "billed GPU"), ("steps", "steps"), ("world_size", "procs"), ("samples_per_s", "samples/s"),
    ("peak_mem_mb", "peak mem"), ("loss_end", "loss at end"), ("stop_reason", "stop"), ("gpus", "GPUs"),
    ("runtime", "runtime"), ("changed", "changed since the session before"), ("stage", "stage"),
    ("memory_rungs", "OOM rungs"), ("steps_lost", "steps lost"), ("why", "why it failed"),
]
# shown only when some session has them
OPTIONAL_COLUMNS = ("runtime", "changed", "stage", "memory_rungs", "steps_lost", "why")


def _round(value: Any, digits: int) -> Any:
    return round(float(value), digits) if isinstance(value, (int, float)) and math.isfinite(value) else None


def session_table(progress: Mapping[str, Any], billed_s: Mapping[Any, float] | None = None) -> list[dict]:
    """One row per attempt of progress.json: each session handed over, and each attempt that handed nothing over
    (killed and retried, wedged and deleted: relay/orchestrator/attempts.py), with why it failed and the steps it
    lost. `billed_s` maps a session index or run id to the GPU seconds Kaggle billed (known to the orchestrator,
    not to the session); else a session's own "billed_s" key is used when present."""
    billed_s = billed_s or {}
    rows, before = [], None
    for s in attempts.every_attempt(progress):
        started, ended = s.get("started"), s.get("ended")
        seconds = s.get("seconds")
        if seconds is None and started is not None and ended is not None:
            seconds = (as_utc(ended) - as_utc(started)).total_seconds()
        billed = billed_s.get(s.get("index"), billed_s.get(s.get("run_id"), s.get("billed_s")))
        steps = None
        if s.get("step_end") is not None and s.get("step_start") is not None:
            steps = int(s["step_end"]) - int(s["step_start"])
        rows.append({
            "session": s.get("index"),
            "run_id": s.get("run_id"),
            "start": as_utc(started).strftime("%Y-%m-%d %H:%M:%S") if started is not None else None,
            "duration_s": _round(seconds, 1),
            "billed_gpu_s": _round(billed, 1),
            "steps": steps,
            "world_size": s.get("world_size", 1),
            "samples_per_s": _round(s.get("samples_per_s"), 1),
            "peak_mem_mb": _round(s.get("peak_mem_mb"), 0),
            "loss_end": _round(s.get("loss_end"), 5),
            "stop_reason": s.get("stop_reason"),
            "gpus": _gpus(s.get("gpus")),
        })
        for key in ("steps_lost", "why"):  # a kill or a failed attempt: what it cost, and why
            if s.get(key) is not None:
                rows[-1][key] = s[key]
        if s.get("failed_attempt"):
            continue  # it ran nothing a later session compares its machine with
        # optional columns, only for runs that have them: what it ran on and what changed (exact resume is
        # unproven from there), curriculum stage(s), OOM rungs taken
        if runtime.describe(s) is not None:
            rows[-1]["runtime"] = runtime.describe(s)
        changed = runtime.changes(before, s) if before is not None else []
        if changed:
            rows[-1]["changed"] = ", ".join(changed)
        before = s
        if s.get("stage") is not None:
            rows[-1]["stage"] = s["stage"]
        if s.get("memory_rungs"):
            rows[-1]["memory_rungs"] = ", ".join(s["memory_rungs"])
    return rows


def _gpus(inventory: Any) -> str | None:
    """"2 x Tesla T4" / "no GPU" from a session's {"count", "names"}; None when the session did not record it."""
    if not isinstance(inventory, Mapping):
        return None
    return accelerators.describe(list(inventory.get("names") or []))


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key in ("duration_s", "billed_gpu_s"):
        return format_duration(value) if value >= 60 else f"{value:.0f}s"
    if key == "peak_mem_mb":
        return f"{value / 1024:.1f} GB" if value >= 1024 else f"{value:.0f} MB"
    if key == "loss_end":
        return f"{value:.4g}"
    if key == "samples_per_s":
        return f"{value:,.1f}"
    return str(value)


def ui_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict]:
    """The session table as the Prefect UI shows it (a table artifact: its keys are the headings): the cells
    of the terminal's table, with what the machine was (GPUs, processes, peak memory) in one column, so that
    it fits a 1600-pixel-wide page; the optional columns only when a session has them."""
    out = []
    for row in rows:
        machine = [_cell(k, row.get(k)) for k in ("gpus", "peak_mem_mb") if row.get(k) is not None]
        if (row.get("world_size") or 1) > 1:
            machine.insert(1, f"{row['world_size']} procs")
        start, run_id = row.get("start"), str(row.get("run_id") or "")
        attempt = "-".join(run_id.split("-")[-2:])  # <relay>-s002-a1 -> s002-a1: the relay's name is the page's
        shown = {"session": f"{row.get('session')} ({attempt})" if attempt else row.get("session"),
                 "start (UTC)": start[5:16] if isinstance(start, str) else None,  # 2026-11-25 14:03:07 -> 11-25 14:03
                 "ran": _cell("duration_s", row.get("duration_s")), "billed": _cell("billed_gpu_s", row.get("billed_gpu_s")),
                 "steps": _steps_cell(row), "samples/s": _cell("samples_per_s", row.get("samples_per_s")),
                 "loss": _cell("loss_end", row.get("loss_end")),
                 "ended": _cell("stop_reason", row.get("stop_reason")) + (f": {row['why']}" if row.get("why") else ""),
                 "machine": " · ".join(machine)}
        for key, heading in COLUMNS:
            if key in OPTIONAL_COLUMNS and key not in ("steps_lost", "why") and any(r.get(key) for r in rows):
                shown[heading] = _cell(key, row.get(key))
        # an unknown cell is left empty: the UI renders cells as markdown, where "-" is a list bullet
        out.append({k: ("" if v in (None, "-") else v) for k, v in shown.items()})
    return out


def _steps_cell(row: Mapping[str, Any]) -> Any:
    """150, or "118 (+50 lost)" where a kill or a failed attempt trained steps no checkpoint kept."""
    lost = row.get("steps_lost")
    if not lost:
        return row.get("steps")
    kept = row.get("steps") if row.get("stop_reason") not in (attempts.WEDGED, attempts.FAILED) else 0
    return f"{kept or 0} (+{lost} lost)"


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The session table for a terminal: aligned columns, '-' where unknown, a totals line."""
    if not rows:
        return "no sessions yet"
    columns = [(k, h) for k, h in COLUMNS if k not in OPTIONAL_COLUMNS or any(r.get(k) for r in rows)]
    header = [heading for _, heading in columns]
    cells = [[_cell(key, row.get(key)) for key, _ in columns] for row in rows]
    widths = [max(len(r[i]) for r in [header, *cells]) for i in range(len(header))]
    left = {i for i, (k, _) in enumerate(columns)
            if k in ("run_id", "start", "stop_reason", "gpus", *OPTIONAL_COLUMNS)}
    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
    total_s = sum(r.get("duration_s") or 0 for r in rows)
    handed = [r for r in rows if r.get("stop_reason") not in (attempts.WEDGED, attempts.FAILED)]
    total_steps = sum(r.get("steps") or 0 for r in handed)  # kept: a failed attempt's steps are all lost
    billed = [r["billed_gpu_s"] for r in rows if r.get("billed_gpu_s") is not None]
    totals = f"{len(handed)} sessions" + (f" ({len(rows)} attempts)" if len(rows) > len(handed) else "")
    totals += f", {format_duration(total_s)} wall, {total_steps} steps"
    if billed:
        totals += f", {sum(billed) / 3600:.1f} GPU h billed"
    return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, cells), totals])


# ---------------------------------------------------------------- plots

def quiet_matplotlib() -> None:
    import logging

    # its font cache, built on a fresh HOME, is announced at INFO: not a line a person running `relay` needs
    logging.getLogger("matplotlib").setLevel(logging.WARNING)


DPI = 110  # the figures are made at the dpi they are saved at: their text is measured once, for both
# The curves figure's margins in inches, fixed: its size is, and its text (tick labels of a few characters, the
# axis labels, one title line) fits in them. tight_layout, which measures every text first, was 35 % of drawing it.
CURVES_MARGINS_IN = {"left": 0.95, "right": 0.2, "top": 0.55, "bottom": 0.6}


def _fixed_margins(fig, hspace: float) -> None:
    width, height = fig.get_size_inches()
    m = CURVES_MARGINS_IN
    fig.subplots_adjust(left=m["left"] / width, right=1 - m["right"] / width, top=1 - m["top"] / height,
                        bottom=m["bottom"] / height, hspace=hspace)


def save_figure(fig, out_png: str | Path, measure_layout: bool = True) -> Path:
    if measure_layout:
        fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=DPI)
    return out_png


def _eval_metric(evals: list[dict], metric: str | None) -> str | None:
    if metric:
        return metric
    for r in evals:  # the first non-loss metric the recipe reports (e.g. smape), else eval loss
        for key, value in r.items():
            if key not in RECORD_KEYS and key != "loss" and not key.startswith("mem") \
                    and isinstance(value, (int, float)):
                return key
    return "loss" if any("loss" in r for r in evals) else None


def _session_starts(records: list[dict], progress: Mapping[str, Any] | None) -> list[tuple[int, int]]:
    """(session, first step) for every session after the first: where the boundary lines go."""
    if progress and progress.get("sessions"):
        starts = [(s.get("index"), s.get("step_start")) for s in progress["sessions"]]
        starts = [(i, int(st)) for i, st in starts if i is not None and st is not None]
    else:
        first: dict[int, int] = {}
        for r in records:
            if r.get("session") is not None:
                first[r["session"]] = min(first.get(r["session"], r["step"]), r["step"])
        starts = sorted(first.items())
    return starts[1:]


def stage_changes(records: list[dict]) -> list[tuple[int, str]]:
    """(step, new stage) wherever the curriculum stage differs from the one before ("stage" records are
    written at every change and at each session's start; repeats are not changes)."""
    changes, current = [], None
    for r in sorted((r for r in records if r.get("kind") == "stage"), key=lambda r: r["step"]):
        if r.get("stage") != current:
            if current is not None:
                changes.append((r["step"], str(r.get("stage"))))
            current = r.get("stage")
    return changes


def _series(records: list[dict], kind: str, key: str) -> tuple[list[float], list[float]]:
    points = [(r["step"], r[key]) for r in records if (r.get("kind") or "train") == kind
              and isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [p[0] for p in points], [p[1] for p in points]


def _smooth(values: list[float], span: int) -> list[float]:
    """Exponential moving average, so the trend is visible through noisy per-step losses."""
    alpha, out, avg = 2 / (span + 1), [], None
    for v in values:
        avg = v if avg is None else alpha * v + (1 - alpha) * avg
        out.append(avg)
    return out


def plot_curves(metrics: Any, out_png: str | Path, *, metric: str | None = None,
                metric_mode: str = "min", progress: Mapping[str, Any] | None = None,
                title: str = "Training across sessions") -> Path:
    """Training loss (top) and the eval metric (bottom) against the global step, one PNG, with
    vertical lines where each session started. `metrics`: metrics.jsonl path(s), a folder or records."""
    quiet_matplotlib()
    records = dedupe_metrics(_coerce_records(metrics))
    if not records:
        raise ValueError("plot_curves: no metrics records to draw")
    evals = [r for r in records if r.get("kind") == "eval"]
    best = (progress or {}).get("best") or {}
    if metric is None and best.get("metric"):  # the recipe's watched metric and its direction (e.g. f1, max)
        metric, metric_mode = best["metric"], best.get("mode", metric_mode)
    metric = _eval_metric(evals, metric)
    drawn = [r["step"] for r in records if isinstance(r.get("step"), (int, float))]  # the x axis's steps
    fig, (ax_loss, ax_metric) = canvas.figure("curves", (11, 7.5), DPI, lambda new: new.subplots(
        2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]}))
    steps, losses = _series(records, "train", "loss")
    if losses:
        # with few points (a session's first progress lines) each is marked: one point is no line
        ax_loss.plot(steps, losses, "o-" if len(losses) < 20 else "-", color="#9ecae1", lw=0.8, ms=4,
                     label="train loss")
        if len(losses) >= 20:
            ax_loss.plot(steps, _smooth(losses, max(5, len(losses) // 40)), color="#08519c", lw=1.8,
                         label="train loss (smoothed)")
        if min(losses) > 0 and max(losses) / min(losses) > 30:
            ax_loss.set_yscale("log")
    e_steps, e_losses = _series(records, "eval", "loss")
    if e_losses:
        ax_loss.plot(e_steps, e_losses, "o-", color="#e6550d", ms=4, lw=1.2, label="eval loss")
    ax_loss.set_ylabel("loss")
    ax_loss.legend(loc="lower left", frameon=False)  # losses fall left to right: that corner is free
    if metric:
        m_steps, m_values = _series(records, "eval", metric)
        ax_metric.plot(m_steps, m_values, "o-", color="#31a354", ms=4, lw=1.4, label=f"eval {metric}")
        if m_values:
            pick = max if metric_mode == "max" else min
            best = pick(range(len(m_values)), key=m_values.__getitem__)
            # toward the middle of the axis: a label centred on the last (often the best) point left the figure
            where = (m_steps[best] - min(drawn)) / ((max(drawn) - min(drawn)) or 1)
            align = "right" if where > 0.85 else "left" if where < 0.15 and max(drawn) > min(drawn) else "center"
            ax_metric.annotate(f"best {m_values[best]:.4g} @ step {m_steps[best]}", (m_steps[best], m_values[best]),
                               xytext=(0, 12), textcoords="offset points", ha=align, fontsize=9,
                               arrowprops={"arrowstyle": "-", "color": "0.4"})
        ax_metric.set_ylabel(f"eval {metric}")
        ax_metric.legend(loc="upper right", frameon=False)
    else:
        ax_metric.text(0.5, 0.5, "no eval records yet", transform=ax_metric.transAxes, ha="center", color="0.5")
        ax_metric.set_yticks([])
    boundaries = _session_starts(records, progress)
    for ax in (ax_loss, ax_metric):
        ax.grid(alpha=0.3)
        for _, step in boundaries:
            ax.axvline(step, color="0.35", ls="--", lw=0.9)
    for session, step in boundaries:
        ax_loss.annotate(f"S{session}", (step, 1.0), xycoords=("data", "axes fraction"), xytext=(3, -12),
                         textcoords="offset points", fontsize=9, color="0.25")
    for step, stage in stage_changes(records):
        for ax in (ax_loss, ax_metric):
            ax.axvline(step, color="#756bb1", ls=":", lw=1.4)
        ax_loss.annotate(stage, (step, 0.0), xycoords=("data", "axes fraction"), xytext=(3, 4),
                         textcoords="offset points", fontsize=9, color="#54278f", rotation=90)
    ax_metric.set_xlabel("global step")
    n_sessions = len({r.get("session") for r in records if r.get("session") is not None})
    dotted = ", dotted = stage changes" if stage_changes(records) else ""
    from matplotlib.ticker import MaxNLocator

    ax_metric.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole, also with one point
    if drawn and max(drawn) - min(drawn) < 4:  # a session's first lines: a few steps wide, not fractions of one
        ax_metric.set_xlim(min(drawn) - 2, max(drawn) + 2)
    fig.suptitle(f"{title} ({n_sessions} session{'s' if n_sessions != 1 else ''}, dashed lines = session starts"
                 f"{dotted})", fontsize=13)
    _fixed_margins(fig, hspace=0.08)
    return save_figure(fig, out_png, measure_layout=False)


OUTCOME_COLORS = {  # stop reason or status -> (legend label, color)
    "done": ("done", "#2ca25f"),
    "budget": ("paused at budget", "#3182bd"),
    "deadline": ("paused at deadline", "#3182bd"),
    "steps": ("paused at session.max_steps", "#6baed6"),
    "sigterm": ("stopped by SIGTERM", "#fd8d3c"),
    "killed": ("killed (resumed from its last save)", "#fdae6b"),
    "wedged": ("wedged (Kaggle ran it past its end)", "#7a0177"),
    "error": ("failed", "#de2d26"),
    "running": ("running", "#9e9ac8"),
    "planned": ("planned", "#d9d9d9"),
}


def _outcome(session: Mapping[str, Any]) -> str:
    value = str(session.get("outcome") or session.get("stop_reason") or session.get("status") or "").lower()
    if value in OUTCOME_COLORS:
        return value
    if value == "final":  # older progress files named the last session's save "final"
        return "done"
    if value in ("failed", "crash", "oom", "cancelled", "stale"):
        return "error"
    return "running" if session.get("ended") is None else "error"


def plot_timeline(sessions: Iterable[Mapping[str, Any]], out_png: str | Path, *, plan: Plan | None = None,
                  now: datetime | None = None, title: str = "Relay timeline") -> Path:
    """Sessions as bars over wall time, colored by outcome; gaps between them (quota waits, handoffs)
    are shaded and labelled. With `plan`, its future sessions are drawn as grey planned bars and the
    quota refreshes as dotted lines. A session without "ended" is running and drawn up to `now`."""
    quiet_matplotlib()
    import matplotlib.dates as mdates

    bars = []  # (label, start, end, outcome, waited_for_quota, note)
    sessions = list(sessions)
    tries = {}  # session index -> its attempts drawn: a failed attempt and its retry are "S3 a1", "S3 a2"
    for s in sessions:
        tries[s.get("index")] = tries.get(s.get("index"), 0) + 1
    for s in sessions:
        if s.get("started") is None:
            continue
        start = as_utc(s["started"], "started")
        end = as_utc(s["ended"], "ended") if s.get("ended") is not None else (as_utc(now, "now") if now else None)
        if end is None:
            end = start + timedelta(seconds=float(s.get("seconds") or 0))
        label = f"S{s.get('index', len(bars) + 1)}"
        if tries.get(s.get("index"), 0) > 1 and "-a" in str(s.get("run_id") or ""):
            label += f" a{str(s['run_id']).rsplit('-a', 1)[1]}"
        outcome = "wedged" if s.get("stop_reason") == "wedged" or s.get("wedged") else _outcome(s)
        note = f", {s['steps_lost']} steps lost" if s.get("steps_lost") else ""
        bars.append((label, start, end, outcome, bool(s.get("waited_for_quota")), note))
    done_count = len({label.split(" ")[0] for label, *_ in bars})  # sessions, not attempts
    if plan is not None:
        for p in plan.sessions:
            bars.append((f"S{done_count + p.index} (plan)", p.starts, p.ends, "planned", p.waited_for_quota, ""))
    if not bars:
        raise ValueError("plot_timeline: no sessions with a start time")
    fig, (ax,) = canvas.figure("timeline", (12, 1.6 + 0.45 * len(bars)), DPI, lambda new: [new.subplots()])
    span_s = max((max(b[2] for b in bars) - min(b[1] for b in bars)).total_seconds(), 1.0)
    seen = set()
    for row, (label, start, end, outcome, _, note) in enumerate(bars):
        name, color = OUTCOME_COLORS[outcome]
        # A minimum drawn width keeps a short session visible on a timeline of weeks.
        width_days = max((end - start).total_seconds(), 0.004 * span_s) / 86400
        ax.barh(row, width_days, left=mdates.date2num(start), height=0.6,
                color=color, edgecolor="0.3", hatch="//" if outcome == "planned" else None,
                label=None if outcome in seen else name)
        seen.add(outcome)
        ax.annotate(format_duration((end - start).total_seconds()) + note, (mdates.date2num(end), row), xytext=(4, 0),
                    textcoords="offset points", va="center", fontsize=8, color="0.2")
    for row in range(1, len(bars)):  # the gap before each session: a handoff or a wait for quota
        prev_end, start, waited = bars[row - 1][2], bars[row][1], bars[row][4]
        gap_s = (start - prev_end).total_seconds()
        if gap_s > 0.02 * span_s or waited:
            kind = "quota wait" if waited else "gap"
            ax.axvspan(mdates.date2num(prev_end), mdates.date2num(start), color="#fee391" if waited else "0.93",
                       alpha=0.7, zorder=0, label=None if kind in seen else
                       ("waiting for quota" if waited else "between sessions"))
            seen.add(kind)
            if gap_s < 0.1 * span_s:
                continue  # too narrow for a label: the shading and the legend say it
            mid = prev_end + (start - prev_end) / 2
            ax.annotate(f"{kind} {format_duration(gap_s)}",
                        (mdates.date2num(mid), row - 0.5), ha="center", va="center", fontsize=8, color="0.3")
    if plan is not None:
        refresh, last = plan.quota.refresh_at, max(b[2] for b in bars)
        while refresh <= last:
            ax.axvline(mdates.date2num(refresh), color="#8c6d31", ls=":", lw=1.2)
            ax.annotate("quota refresh", (mdates.date2num(refresh), 1.0), xycoords=("data", "axes fraction"),
                        xytext=(3, -10), textcoords="offset points", fontsize=8, color="#8c6d31")
            refresh += timedelta(seconds=plan.quota.period_s)
    if now is not None:
        ax.axvline(mdates.date2num(as_utc(now, "now")), color="#de2d26", lw=1.2, label="now")
    ax.set_yticks(range(len(bars)), [b[0] for b in bars])
    ax.invert_yaxis()
    ax.set_ylim(len(bars) - 0.4, -0.9)
    locator = mdates.AutoDateLocator(minticks=4, maxticks=10)
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
    ax.set_xlabel("wall time (UTC)")
    ax.grid(axis="x", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: labels[i] in ("waiting for quota", "between sessions", "now"))
    # beside the axes, not under them: below, a one-session figure (a short axis) had it over the axis label
    ax.legend([handles[i] for i in order], [labels[i] for i in order], loc="center left", fontsize=9,
              bbox_to_anchor=(1.01, 0.5), ncol=1, frameon=False)
    ax.set_title(title, fontsize=13)
    return save_figure(fig, out_png)
