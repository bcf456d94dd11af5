"""What people look at in the Prefect UI: progress, the session table, the plan and the curves."""
from __future__ import annotations

import base64
import re
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from prefect import task
from prefect.artifacts import create_progress_artifact
from prefect.cache_policies import NO_CACHE

from relay.orchestrator import attempts, goodput, goodput_chart, report
from relay.shared import progress_line, runtime
from relay.shared.progress import Progress, SessionRecord


_TITLES = {"curves": "Loss curves", "timeline": "Sessions timeline"}
_CAPTIONS = {"curves": "Training loss (and eval metrics) by global step; each session shaded, the running one included",
             "timeline": "Each session: when it ran, for how long, and how it ended",
             "goodput": "Each session's charged GPU time by where it went: training kept, and what was lost"}


def _key(name: str, what: str) -> str:
    return re.sub(r"[^a-z0-9-]", "-", f"{name}-{what}".lower())


_LIVE_DRAWN: dict = {}  # the running curves' PNG -> what it was drawn from (a drawing: ~0.1 CPU s alone)
_IN_PLACE: dict = {}  # (flow run id, key) -> the artifact of that key updated in place for the rest of the flow run


def _put(artifact, key: str) -> None:
    """One artifact per key and flow run, updated in place: the summary and the session table change at every
    session event, and a new version each time made a 4-session run 35 artifact cards (issue 47). A new flow run
    (the next tick) makes its own, then the key's latest."""
    import httpx
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactUpdate
    from prefect.runtime import flow_run

    artifact.key = key
    run = flow_run.id
    known = _IN_PLACE.get((run, key)) if run else None
    if known is not None:
        try:
            with get_client(sync_client=True) as client:
                client.update_artifact(known, ArtifactUpdate(data=artifact.format(_sync=True),
                                                             description=artifact.description))
            return
        except httpx.HTTPStatusError as err:  # 404: deleted with its flow run (the server's retention)
            if err.response.status_code != 404:
                raise
    created = artifact.create(_sync=True)
    if run:
        _IN_PLACE[(run, key)] = created.id


def _table(rows: list, key: str, description: str) -> None:
    from prefect.artifacts import TableArtifact

    _put(TableArtifact(table=rows, description=description), key)


def _markdown(markdown: str, key: str, description: str) -> None:
    from prefect.artifacts import MarkdownArtifact

    _put(MarkdownArtifact(markdown=markdown, description=description), key)


def show_progress(name: str, step: int, total: int, text: str, artifact_id: Optional[str] = None) -> str:
    """The relay's progress artifact: `artifact_id` updated in place (no new version), else a new version of the
    `<name>-progress` key, which is then its latest. Returns the id to update next time."""
    from prefect.artifacts import update_progress_artifact

    import httpx

    percent = 100.0 * step / max(1, total)
    if artifact_id:
        try:
            update_progress_artifact(artifact_id, progress=percent, description=text)
            return artifact_id
        except httpx.HTTPStatusError as err:  # 404: deleted with its flow run (the server's retention)
            if err.response.status_code != 404:
                raise
    return str(create_progress_artifact(progress=percent, key=_key(name, "progress"), description=text))


@task(name="report", cache_policy=NO_CACHE)
def publish_report(name: str, progress: Progress | dict, local: Path, metrics: Optional[Path] = None, plan_text: str = "",
                   billed_s: Optional[dict] = None, state: str = "", links: str = "",
                   save_every_s: Optional[float] = None) -> dict:
    """The relay's session table and summary from the latest handed-over progress (and the metrics beside it);
    the progress artifact is the live view's (tasks/live_view.py), updated in place."""
    progress = Progress.read(progress)
    rows = report.session_table(progress, billed_s=billed_s or {})
    if rows:
        _table(report.ui_rows(rows), _key(name, "sessions"), f"{name}: one row per session")
    images = {}
    if metrics is not None and metrics.is_file():
        images["curves"] = report.plot_curves(metrics, local / "curves.png", progress=progress) or local / "curves.png"
    if progress.sessions:
        images["timeline"] = report.plot_timeline(attempts.every_attempt(progress), local / "timeline.png") \
            or local / "timeline.png"  # failed attempts included: a wedge is a bar, not a gap
    ledger = goodput.from_progress(progress, save_every_s)
    if ledger.charged_s > 0:
        images["goodput"] = goodput_chart.plot_goodput(ledger, local / "goodput.png") or local / "goodput.png"
    _markdown(summary_markdown(name, progress, images, plan_text, state, links, ledger=ledger), _key(name, "summary"),
              f"{name}: plan, ETA and curves")
    return {k: str(v) for k, v in images.items()}


def summary_markdown(name: str, progress: Progress | dict, images: dict[str, Path], plan_text: str = "", state: str = "",
                     links: str = "", save_every_s: Optional[float] = None,
                     ledger: Optional[goodput.Ledger] = None) -> str:
    """The summary as CommonMark the Prefect UI renders: blocks separated by blank lines, the plan in a
    closed fence, each PNG an image node (a data URI: the UI cannot reach files on the worker)."""
    progress = Progress.read(progress)
    done, total = progress.global_step, max(1, progress.total_steps or 1)
    best = progress.best or {}
    sessions = len(progress.sessions)
    evals = progress.metrics or {}
    last_eval = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in evals.items())
    if ledger is None:  # the caller's, when it drew it
        ledger = goodput.from_progress(progress, save_every_s)
    # sessions and attempts, and GPU time, said as the ledger says them (its line, its table, its chart)
    spend = (f"{ledger.attempts_text()}, {goodput.duration_text(ledger.charged_s)} GPU time charged"
             if ledger.attempts else f"{sessions} session{'' if sessions == 1 else 's'} handed over")
    md = [f"# {name}: {state or progress.status or ''}",
          f"step **{done} / {total}** (epoch {(progress.epoch or 0) + 1}), {spend}; updated"
          f" {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
          f"last eval: {last_eval or 'none yet'}"]
    if best:
        md.append(f"best {best.get('metric', '')}: {best.get('value', float('nan')):.4g}"
                  f" at step {best.get('step', '-')}")
    for note in runtime.change_notes([s.as_mapping() for s in progress.sessions]):  # another CPU, GPU, torch ...
        md.append(f"**warning**: {note}")
    if links:
        md.append(links)
    if plan_text.strip():
        fence = "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", plan_text)), default=0))
        md.append(f"## Plan and ETA\n\n{fence}text\n{fit_lines(plan_text.strip(chr(10)))}\n{fence}")
    if ledger.attempts:  # where the GPU time charged went (relay/orchestrator/goodput.py), drawn and in figures
        chart = f"\n\n{_image('goodput', images['goodput'])}" if "goodput" in images else ""
        md.append(f"## Goodput\n\n{ledger.line()}{chart}\n\n{ledger.table()}")
    for label, png in images.items():
        if label != "goodput":
            md.append(f"## {_TITLES.get(label, label)}\n\n{_image(label, png)}")
    return "\n\n".join(md) + "\n"


# Characters of monospace text one line of the Prefect UI's code block shows in a 1440-px-wide window (headless
# Chromium, Prefect 3's artifact page: ~105 seen): a longer plan line was cut on the right, behind a scroll bar.
# tests/orchestrator/test_ui_width.py holds the summary to it.
CODE_COLUMNS = 100


def fit_lines(text: str, width: int = CODE_COLUMNS) -> str:
    """Each line of `text` wrapped at a space to `width` characters, its continuation indented two."""
    import textwrap

    out = []
    for line in text.split("\n"):
        out += textwrap.wrap(line, width, subsequent_indent="  ", break_on_hyphens=False, break_long_words=False,
                             drop_whitespace=True) if len(line) > width else [line]
    return "\n".join(out)


def _image(label: str, png: Path) -> str:
    data = base64.b64encode(Path(png).read_bytes()).decode()
    return f"![{label}](data:image/png;base64,{data})\n\n*{_CAPTIONS.get(label, label)}*"


def publish_running(name: str, progress: Progress | dict, records: list, local: Path, metrics: Optional[Path], text: str,
                    kernel_state: str, plan_text: str = "", links: str = "") -> None:
    """The running session's table row and the summary with its loss curve: the `<name>-sessions` and
    `<name>-summary` artifacts of this flow run updated in place, at the session's events (tasks/live_view.py)."""
    from relay.orchestrator import live_progress as live

    progress = Progress.read(progress) or Progress()
    latest = live.running_row(records, kernel_state)
    last = progress_line.newest(records)
    if latest is None or last is None:
        return
    total = max(1, last.get("total_steps") or progress.total_steps or 1)
    rows = report.session_table(progress) + [latest]
    _table(report.ui_rows(rows), _key(name, "sessions"), f"{name}: one row per session, the last {kernel_state}")
    previous = report.read_metrics(metrics) if metrics is not None and metrics.is_file() else []
    images = {}
    points = previous + live.as_metrics(records)
    if points:
        running = SessionRecord(index=last.get("session"), step_start=records[0].get("step_start"))
        png, drawn_from = local / "curves-live.png", (len(points), repr(points[-1]), running, len(progress.sessions))
        if _LIVE_DRAWN.get(str(png)) != drawn_from or not png.is_file():  # a summary with no new point: as drawn
            report.plot_curves(points, png, progress=progress.with_sessions([*progress.sessions, running]))
            _LIVE_DRAWN[str(png)] = drawn_from
        images["curves"] = png
    if (local / "goodput.png").is_file():  # the handed-over sessions' ledger, drawn at the last hand-over
        images["goodput"] = local / "goodput.png"
    md = summary_markdown(name, replace(progress, global_step=last["step"], total_steps=total), images,
                          "\n\n".join(p for p in (text, plan_text) if p.strip()),
                          f"session {last.get('session')} {kernel_state}", links)
    _markdown(md, _key(name, "summary"), f"{name}: plan, ETA and curves")


def publish_stop(name: str, reason: str) -> None:
    """Why the relay stopped, as the run's summary artifact: on the flow run's page, not only in a worker's log."""
    first, _, rest = reason.partition("\n")
    fence = "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", rest)), default=0))
    md = f"# {name}: stopped, needs you\n\n**{first}**\n"
    if rest.strip():
        md += f"\n{fence}text\n{rest.strip()}\n{fence}\n"
    _markdown(md, _key(name, "summary"), f"{name}: why the relay stopped")
