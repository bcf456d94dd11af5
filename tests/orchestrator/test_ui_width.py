"""The summary artifact fits the Prefect UI's column: what a person saw in headless Chromium, kept as a check that
needs no browser. The summary's markdown is parsed as CommonMark (markdown-it, as test_artifacts_markdown.py) and
each table and code block measured with a width model of the UI's artifact page, calibrated on screenshots
(Chromium 150, a 1440x1200 window, Prefect 3's artifact page, a relay with a kill and a wedge):
- a table cell never wraps (the 11-column goodput table was cut at "shut-do...", the failed-attempt column hidden):
  a column is its longest cell's characters plus ~3 characters of padding (7.4 px a character, 21 px of padding),
  and the column holds ~116 such characters (859 px);
- a code block (the plan) shows ~105 monospace characters a line (8 px each); a longer line was cut on the right.
The ledger is a real one (goodput.from_progress) of a relay's records with a session killed mid-save, a wedged
attempt deleted and its retry, as the relay published them (a run of `relay run` against a local server).
The last test opens the same markdown in headless Chromium, when there is one (CI has none), to check the model.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from relay.orchestrator import attempts, goodput, report
from tasks import artifacts

TABLE_COLUMN_CHARS = 112   # the UI's column in the table model's characters (116 seen, a little kept back)
CELL_PADDING_CHARS = 3
CODE_COLUMN_CHARS = 105

T0 = 1795929780.0
# As the relay published it (the run's progress.json, times shifted): s002 killed in a save and salvaged at step
# 268, s003-a1 wedged (its process ended at step 418, Kaggle ran it on) and deleted, retried as s003-a2.
SESSIONS = [
    {"index": 1, "run_id": "ui-look-s001-a1", "started": T0 + 6.0, "ended": T0 + 27.8, "seconds": 21.8,
     "step_start": 0, "step_end": 150, "stop_reason": "steps", "saving_s": 0.6, "samples_per_s": 9132.0},
    {"index": 2, "run_id": "ui-look-s002-a1", "started": T0 + 40.1, "ended": T0 + 51.0, "seconds": 10.9,
     "step_start": 150, "step_end": 268, "stop_reason": "running", "saving_s": 0.2},
    {"index": 3, "run_id": "ui-look-s003-a2", "started": T0 + 93.3, "ended": T0 + 112.3, "seconds": 19.0,
     "step_start": 268, "step_end": 418, "stop_reason": "steps", "saving_s": 0.5},
    {"index": 4, "run_id": "ui-look-s004-a1", "started": T0 + 122.5, "ended": T0 + 134.3, "seconds": 11.8,
     "step_start": 418, "step_end": 568, "stop_reason": "steps", "saving_s": 0.3},
    {"index": 5, "run_id": "ui-look-s005-a1", "started": T0 + 140.5, "ended": T0 + 143.6, "seconds": 3.1,
     "step_start": 568, "step_end": 600, "stop_reason": "done", "saving_s": 0.1},
]
CHARGES = [
    {"run_id": "ui-look-s001-a1", "pushed_at": T0, "process_end": T0 + 27.8, "last_step": 150, "wedged": False},
    {"run_id": "ui-look-s002-a1", "pushed_at": T0 + 33.8, "last_line": T0 + 46.9, "last_step": 290, "wedged": False},
    {"run_id": "ui-look-s003-a1", "pushed_at": T0 + 52.4, "process_end": T0 + 76.3, "kaggle_end_seen": T0 + 86.9,
     "last_step": 418, "wedged": True,
     "failed": "retry: session 3 (ui-look-s003-a1) is still reported running 1 s past its deadline: wedged"},
    {"run_id": "ui-look-s003-a2", "pushed_at": T0 + 89.9, "process_end": T0 + 112.4, "last_step": 418},
    {"run_id": "ui-look-s004-a1", "pushed_at": T0 + 118.7, "process_end": T0 + 134.4, "last_step": 568},
    {"run_id": "ui-look-s005-a1", "pushed_at": T0 + 138.8, "process_end": T0 + 143.6, "last_step": 600},
]
PROGRESS = {"global_step": 600, "total_steps": 600, "status": "done", "epoch": 149, "sessions": SESSIONS,
            "charges": CHARGES, "metrics": {"loss": 0.04209, "mse": 0.04209, "step": 600}}


def plan_text() -> str:
    """The flow's plan of a relay halfway, with its figures line (the longest line the plan writes)."""
    from conftest import load_toy_spec
    from flows.one_relay import plan_text as flow_plan

    spec = load_toy_spec({"optim.epochs": None, "optim.max_steps": 1200, "session.max_steps": 150})
    halfway = {**PROGRESS, "status": "paused", "global_step": 600}
    return flow_plan(spec, halfway, None, datetime.now(timezone.utc))


def summary() -> str:
    return artifacts.summary_markdown("ui-look", PROGRESS, {}, plan_text(), "done")


def tables(markdown: str) -> list[list[list[str]]]:
    """Each table of the rendered markdown as rows of cell texts (what the UI shows: no `**`)."""
    out, rows, cells, inside = [], [], [], False
    for token in MarkdownIt("commonmark").enable("table").parse(markdown):
        if token.type == "table_open":
            rows = []
        elif token.type == "tr_open":
            cells = []
        elif token.type == "inline" and token.map is not None and inside:
            cells.append("".join(child.content for child in token.children or [] if child.type == "text"))
        elif token.type in ("th_open", "td_open"):
            inside = True
        elif token.type in ("th_close", "td_close"):
            inside = False
        elif token.type == "tr_close":
            rows.append(cells)
        elif token.type == "table_close":
            out.append(rows)
    return out


def table_chars(rows: list[list[str]]) -> int:
    """The table's width in the model's characters: each column its longest cell, plus padding (no wrapping)."""
    return sum(max(len(row[i]) for row in rows if i < len(row)) + CELL_PADDING_CHARS for i in range(len(rows[0])))


def code_lines(markdown: str) -> list[str]:
    return [line for token in MarkdownIt("commonmark").parse(markdown) if token.type in ("fence", "code_block")
            for line in token.content.splitlines()]


def test_the_goodput_table_fits_the_uis_column_and_names_the_wedge():
    md = summary()
    found = tables(md)
    assert found, "the summary has its goodput table"
    for rows in found:
        assert table_chars(rows) <= TABLE_COLUMN_CHARS, (table_chars(rows), rows[0])
    goodput_table = found[0]
    wedged = next(row for row in goodput_table if row[0].startswith("s003-a1"))
    assert "(failed)" in wedged[0] and "wedged" in wedged[3], wedged  # where the rest went: the wedge, named
    assert goodput_table[-1][0] == "all"
    # the eleven-column table of before, on the same ledger, is what the screenshot showed cut
    ledger = goodput.from_progress(PROGRESS)
    eleven = [["session", "charged", *goodput.CATEGORIES]] + [
        [a.run_id, goodput.duration_text(a.charged_s), *(goodput.duration_text(a.seconds[c]) for c in goodput.CATEGORIES)]
        for a in ledger.attempts]
    assert table_chars(eleven) > TABLE_COLUMN_CHARS


def test_the_plan_block_is_not_cut_on_the_right():
    lines = code_lines(summary())
    assert any(line.startswith("figures:") for line in lines)
    assert max(len(line) for line in lines) <= CODE_COLUMN_CHARS, max(lines, key=len)
    raw = plan_text()  # the plan as the flow's log prints it: a line the block would cut, before it was wrapped
    assert max(len(line) for line in raw.splitlines()) > CODE_COLUMN_CHARS


def test_one_count_of_sessions_and_attempts_and_one_way_to_write_gpu_time():
    md = summary()
    ledger = goodput.from_progress(PROGRESS)
    assert "6 attempts (5 sessions handed over, 1 failed), 2m GPU time charged" in md  # the head line
    assert f"charged over {ledger.attempts_text()}" in md  # the goodput line says the same
    assert "h of sessions" not in md and "session(s)" not in md


def test_the_session_table_and_timeline_list_the_failed_attempt_with_why_and_steps_lost(tmp_path):
    rows = report.session_table(PROGRESS)
    assert [r["run_id"].split("-", 2)[2] for r in rows] == ["s001-a1", "s002-a1", "s003-a1", "s003-a2", "s004-a1",
                                                            "s005-a1"]
    shown = {r["session"]: r for r in report.ui_rows(rows)}
    assert shown["3 (s003-a1)"]["ended"] == "wedged: ran past its deadline, deleted"
    assert shown["3 (s003-a1)"]["steps"] == "0 (+150 lost)"  # trained 268 -> 418, nothing kept
    assert shown["2 (s002-a1)"]["ended"] == "killed" and shown["2 (s002-a1)"]["steps"] == "118 (+22 lost)"
    assert report.format_table(rows).splitlines()[-1].startswith("5 sessions (6 attempts)")
    drawn = []
    save = report.save_figure
    try:
        report.save_figure = lambda fig, out, **kw: drawn.append(fig) or save(fig, out, **kw)
        report.plot_timeline(attempts.every_attempt(PROGRESS), tmp_path / "timeline.png")
    finally:
        report.save_figure = save
    ax = drawn[0].axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["S1", "S2", "S3 a1", "S3 a2", "S4", "S5"]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(text.startswith("wedged") for text in legend) and any(text.startswith("killed") for text in legend)
    assert any("150 steps lost" in t.get_text() for t in ax.texts)


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="no headless Chromium here (CI has none): the width model alone checks")
def test_in_chromium_no_table_or_code_block_is_wider_than_the_uis_column(tmp_path, spawns_processes):
    """The same markdown rendered to HTML in a column as wide as the UI's (859 px, nowrap cells, Prefect's fonts
    approximated by the system's sans and mono at 14 px): every table and code block fits."""
    body = MarkdownIt("commonmark").enable("table").render(summary())
    page = tmp_path / "summary.html"
    page.write_text(f"""<!doctype html><html><head><style>
      body {{ margin: 0; font: 14px sans-serif; }} main {{ width: 859px; }}
      td, th {{ white-space: nowrap; padding: 8px 10px; }} table {{ border-collapse: collapse; }}
      pre {{ font: 13.4px monospace; padding: 0; margin: 0; }}
    </style></head><body><main>{body}</main><script>
      const wide = [...document.querySelectorAll('table, pre')].filter(e => e.scrollWidth > 859)
        .map(e => e.tagName + ':' + e.scrollWidth);
      document.title = 'WIDE=' + JSON.stringify(wide);
    </script></body></html>""")
    dom = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                          "--disable-background-networking", "--disable-component-update", "--disable-sync",
                          f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    assert "<title>WIDE=" in dom, dom[-2000:]
    wide = json.loads(dom.split("<title>WIDE=", 1)[1].split("</title>", 1)[0].replace("&quot;", '"'))
    assert wide == [], wide


def test_a_failed_attempt_is_said_once_with_the_steps_it_lost():
    """The flow's one line for an attempt that handed nothing over ends with the steps it cost, read from its log's
    newest progress line against the published step; the hand-over task no longer says it a second time."""
    import inspect
    from types import SimpleNamespace

    from relay.shared.progress_line import PREFIX
    from relay.orchestrator import relay_step
    from tasks import relay_tasks

    log = "\n".join(PREFIX + json.dumps({"kind": "train", "run_id": "r-s003-a1", "step": step, "time": T0 + step})
                    for step in (280, 350, 418))
    obs = SimpleNamespace(published={"global_step": 268})
    assert relay_step._steps_lost("r-s003-a1", log, obs) == (
        "; 150 steps lost (it trained to step 418; the relay goes on from step 268)")
    assert relay_step._steps_lost("r-s003-a1", "", obs) == ""
    assert "not handed over" not in inspect.getsource(relay_tasks.hand_over)
