"""relay.orchestrator.report: session table, metrics de-duplication, PNGs."""
from __future__ import annotations

import json
import struct
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from relay.orchestrator.plan import HOUR, QuotaState, plan_sessions
from relay.orchestrator.report import (dedupe_metrics, format_table, load_progress, plot_curves, plot_timeline, read_metrics,
                          session_table, ui_rows)

T0 = datetime(2026, 11, 21, 8, 0, tzinfo=timezone.utc).timestamp()
SESSIONS = [
    {"index": 1, "run_id": "r1", "started": T0, "ended": T0 + 7200, "seconds": 7200, "step_start": 0,
     "step_end": 400, "samples_per_s": 851.26, "peak_mem_mb": 5123.4, "loss_end": 0.84281, "stop_reason": "budget",
     "save_seconds": 12.0},
    # Killed by SIGTERM after step 780 but its last checkpoint was at 760: session 3 redoes 760..780.
    {"index": 2, "run_id": "r2", "started": T0 + 9000, "ended": T0 + 15000, "step_start": 400, "step_end": 780,
     "stop_reason": "sigterm"},
    {"index": 3, "run_id": "r3", "started": T0 + 4 * 86400, "ended": T0 + 4 * 86400 + 3600, "seconds": 3600,
     "step_start": 760, "step_end": 1000, "loss_end": 0.2, "stop_reason": "done"},
]


def metrics_records() -> list[dict]:
    records = []
    for s in SESSIONS:
        for step in range(s["step_start"] + 10, s["step_end"] + 1, 10):
            t = s["started"] + (step - s["step_start"]) * 10
            records.append({"step": step, "session": s["index"], "time": t, "kind": "train",
                            "loss": 2.0 / (1 + step / 100) + 0.01 * s["index"], "lr": 1e-3})
            if step % 100 == 0:
                records.append({"step": step, "session": s["index"], "time": t, "kind": "eval",
                                "loss": 2.2 / (1 + step / 100), "smape": 40.0 / (1 + step / 300)})
    return records


def write_workdir(root: Path, records: list[dict], progress_extra: dict | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    progress = {"status": "done", "global_step": 1000, "total_steps": 1000, "sessions": SESSIONS,
                **(progress_extra or {})}
    (root / "progress.json").write_text(json.dumps(progress))
    # The last line is what a session killed mid-write leaves behind.
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 10')
    return root


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def test_session_table_from_progress(tmp_path):
    rows = session_table(load_progress(write_workdir(tmp_path, [])), billed_s={1: 7500, "r3": 3700})
    assert [r["session"] for r in rows] == [1, 2, 3]
    first, second, third = rows
    assert first == {"session": 1, "run_id": "r1", "start": "2026-11-21 08:00:00", "duration_s": 7200.0,
                     "billed_gpu_s": 7500.0, "steps": 400, "world_size": 1, "samples_per_s": 851.3, "peak_mem_mb": 5123.0,
                     "loss_end": 0.84281, "stop_reason": "budget", "gpus": None}
    # Missing optional keys: duration from started/ended, the rest unknown.
    assert second["duration_s"] == 6000.0 and second["samples_per_s"] is None and second["billed_gpu_s"] is None
    assert third["billed_gpu_s"] == 3700.0 and third["steps"] == 240


def test_format_table_is_aligned_with_placeholders_and_totals():
    rows = session_table({"sessions": SESSIONS}, billed_s={1: 7500})
    lines = format_table(rows).splitlines()
    assert lines[0].split()[:3] == ["session", "run", "id"] and "billed GPU" in lines[0]
    assert len(lines) == 2 + len(SESSIONS) + 1
    assert "2h00m" in lines[2] and "5.0 GB" in lines[2] and "851.3" in lines[2] and "budget" in lines[2]
    assert " - " in lines[3] and "sigterm" in lines[3]
    assert lines[-1] == "3 sessions, 4h40m wall, 1020 steps, 2.1 GPU h billed"
    assert format_table([]) == "no sessions yet"


def test_the_ui_table_is_nine_short_columns_with_the_machine_in_one():
    rows = session_table({"sessions": [{**SESSIONS[0], "world_size": 2, "gpus": {"count": 2, "names": ["Tesla T4"] * 2}},
                                       *SESSIONS[1:]]}, billed_s={1: 7500})
    shown = ui_rows(rows)
    assert list(shown[0]) == ["session", "start (UTC)", "ran", "billed", "steps", "samples/s", "loss", "ended",
                              "machine"]
    assert shown[0]["session"] == f"1 ({'-'.join(SESSIONS[0]['run_id'].split('-')[-2:])})"
    assert shown[0]["start (UTC)"] == "11-21 08:00" and shown[0]["ran"] == "2h00m" and shown[0]["steps"] == 400
    assert shown[0]["machine"] == "2 x Tesla T4 · 2 procs · 5.0 GB" and shown[0]["loss"] == "0.8428"
    assert shown[1]["billed"] == "" and shown[1]["machine"] == ""  # empty, not "-" (a markdown bullet in the UI)
    # every cell is short: the table fits a 1600-pixel-wide page (checked in Chromium, docs/prefect.md)
    assert all(len(str(value)) <= 32 for row in shown for value in row.values()), shown


def test_duplicate_steps_keep_the_last_record(tmp_path):
    write_workdir(tmp_path, metrics_records())
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert len(records) == len(metrics_records())  # the truncated line is skipped
    unique = dedupe_metrics(records)
    train_770 = [r for r in unique if r["kind"] == "train" and r["step"] == 770]
    assert len(train_770) == 1 and train_770[0]["session"] == 3
    train_steps = [r["step"] for r in unique if r["kind"] == "train"]
    assert train_steps == sorted(set(train_steps)) and len(train_steps) == 100
    # Input order does not decide: the later session wins even when its lines come first.
    assert dedupe_metrics(list(reversed(records))) == unique
    assert {r["kind"] for r in unique} == {"train", "eval"}


def test_harvested_outputs_are_merged(tmp_path):
    for i, s in enumerate(SESSIONS, 1):
        out = tmp_path / f"session-{i}"
        out.mkdir()
        progress = {"status": "paused", "global_step": s["step_end"], "sessions": SESSIONS[:i]}
        (out / "progress.json").write_text(json.dumps(progress))
        mine = [r for r in metrics_records() if r["session"] == i]
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mine))
    progress = load_progress(tmp_path)
    assert progress.global_step == 1000 and [s.index for s in progress.sessions] == [1, 2, 3]
    assert len(read_metrics(tmp_path)) == len(metrics_records())
    with pytest.raises(FileNotFoundError):
        load_progress(tmp_path / "session-1" / "nothing-here")


def test_plot_curves_writes_a_real_png(tmp_path):
    workdir = write_workdir(tmp_path / "wd", metrics_records())
    out = plot_curves(workdir / "metrics.jsonl", tmp_path / "out" / "curves.png", progress=load_progress(workdir))
    width, height = png_size(out)
    assert width >= 800 and height >= 600
    assert out.stat().st_size > 30_000  # two panels of curves, not an empty canvas
    # Records work as input too; no eval records still draws the loss.
    train_only = [r for r in metrics_records() if r["kind"] == "train"]
    assert png_size(plot_curves(train_only, tmp_path / "train.png"))[0] >= 800
    with pytest.raises(ValueError, match="no metrics"):
        plot_curves([], tmp_path / "empty.png")


def test_plot_timeline_with_plan_and_running_session(tmp_path):
    now = datetime.fromtimestamp(SESSIONS[-1]["ended"], tz=timezone.utc) + timedelta(hours=2)
    quota = QuotaState(total_allowed_s=30 * HOUR, used_s=29 * HOUR, reserved_s=0,
                       refresh_at=datetime(2026, 11, 28, tzinfo=timezone.utc), observed_at=now)
    plan = plan_sessions(10_000, 10.0, quota, now)
    sessions = [dict(SESSIONS[0]), dict(SESSIONS[1]), dict(SESSIONS[2], waited_for_quota=True),
                {"index": 4, "started": now - timedelta(hours=1)}]  # still running
    out = plot_timeline(sessions, tmp_path / "timeline.png", plan=plan, now=now)
    width, height = png_size(out)
    assert width >= 800 and height >= 300 and out.stat().st_size > 15_000
    with pytest.raises(ValueError, match="no sessions"):
        plot_timeline([], tmp_path / "none.png")


def test_a_reused_figure_draws_the_pixels_of_a_new_one(tmp_path):
    """The flow draws its figures again and again in one process: reused (relay/orchestrator/canvas.py, its tick
    objects kept), each must be pixel for pixel what a new figure draws, whatever the drawing before it set (a log
    scale, no eval panel, stage lines, a plan, more or fewer sessions)."""
    from relay.orchestrator import canvas

    records = metrics_records()
    train_only = [r for r in records if r["kind"] == "train"]
    blow_up = [dict(r, loss=r["loss"] * (1000 if r["step"] < 50 else 1)) for r in train_only]  # a log scale
    staged = records + [{"step": 1, "kind": "stage", "stage": "A"}, {"step": 500, "kind": "stage", "stage": "B"}]
    few = [r for r in records if r["step"] <= 20]
    curves = [lambda out: plot_curves(records, out, progress={"sessions": SESSIONS}),
              lambda out: plot_curves(blow_up, out), lambda out: plot_curves(staged, out, metric="smape"),
              lambda out: plot_curves(few, out), lambda out: plot_curves(train_only, out),
              lambda out: plot_curves(records, out, progress={"sessions": SESSIONS})]
    now = datetime.fromtimestamp(SESSIONS[-1]["ended"], tz=timezone.utc) + timedelta(hours=2)
    quota = QuotaState(total_allowed_s=30 * HOUR, used_s=29 * HOUR, reserved_s=0,
                       refresh_at=datetime(2026, 11, 28, tzinfo=timezone.utc), observed_at=now)
    timelines = [lambda out: plot_timeline(SESSIONS, out, plan=plan_sessions(10_000, 10.0, quota, now), now=now),
                 lambda out: plot_timeline(SESSIONS[:1], out), lambda out: plot_timeline(SESSIONS, out),
                 lambda out: plot_timeline(SESSIONS[:2], out, title="Relays timeline")]
    from test_goodput_chart import CLEAN, FAULTED

    from relay.orchestrator.goodput_chart import plot_goodput

    ledgers = [lambda out: plot_goodput(FAULTED, out), lambda out: plot_goodput(CLEAN, out),
               lambda out: plot_goodput(FAULTED, out)]
    for i, draw in enumerate(curves + timelines + ledgers):
        reused = draw(tmp_path / f"reused-{i}.png")
        vars(canvas._HELD).clear()  # noqa: SLF001 - the next drawing on a new figure
        new = draw(tmp_path / f"new-{i}.png")
        assert reused.read_bytes() == new.read_bytes(), f"drawing {i}: a reused figure drew other pixels"
        draw(tmp_path / "keep.png")  # the figure the next drawing reuses is this drawing's
