"""The session's parseable progress lines (relay/shared/progress_line.py): bounded in rate, evals, stage
changes and the end always, and parsed back from a log line."""
from __future__ import annotations

from relay.shared.progress_line import ProgressLines, parse


def test_lines_are_rate_bounded_but_evals_stages_and_the_end_always_print():
    out = []
    lines = ProgressLines(session=2, step_start=40, total_steps=100, time_left=lambda: 12.5, every_s=3600,
                          write=out.append)
    lines({"kind": "train", "step": 41, "loss": 1.0, "stage": "a"})
    lines({"kind": "train", "step": 42, "loss": 0.9, "stage": "a"})  # within the interval: dropped
    lines({"kind": "eval", "step": 42, "loss": 0.8, "smape": 30.0})
    lines({"kind": "train", "step": 43, "loss": 0.7, "stage": "b"})  # a stage change
    lines.end(43, "paused", "steps")
    records = [parse("2026-11-24 12:00:00 " + line) for line in out]
    assert all(isinstance(r.pop("time"), float) for r in records)
    assert [r["step"] for r in records] == [41, 42, 43, 43]
    assert records[0] == {"run_id": None, "session": 2, "step_start": 40, "total_steps": 100, "step": 41, "kind": "train",
                          "loss": 1.0, "stage": "a", "time_left_s": 12.5}
    assert records[1]["eval_loss"] == 0.8 and records[1]["eval_smape"] == 30.0 and "loss" not in records[1]
    assert records[2]["stage"] == "b"
    assert records[3]["kind"] == "end" and records[3]["status"] == "paused" and records[3]["stop_reason"] == "steps"


def test_parse_ignores_other_lines():
    assert parse("session 1: 10%| loss=0.3") is None
    assert parse("relay-progress {not json") is None


def test_newest_is_where_the_session_is():
    from relay.shared.progress_line import newest

    records = [{"kind": "train", "step": 10, "time": 1.0}, {"kind": "train", "step": None},
               {"kind": "end", "step": 20}, {"kind": "eval", "step": 20}]
    assert newest(records) == {"kind": "end", "step": 20}
    assert newest(records, ("train",), has="step") == {"kind": "train", "step": 10, "time": 1.0}
    assert newest(records, ("end",), has="time") is None and newest([]) is None
