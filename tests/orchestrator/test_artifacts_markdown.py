"""What the Prefect UI shows in the `<name>-summary` artifact: the markdown is parsed as CommonMark (what the UI's
renderer does), and the loss-curve and timeline PNGs must be image nodes (not text in a code block), the plan
and its ETA must be there in a closed fence, with or without a plan.

The progress, metrics and PNGs come from a real two-session toy run (relay.kernel.run), the plan from the
flow's own `plan_text`, and one test stores the artifact in a real Prefect server and parses what it serves.
"""
from __future__ import annotations

import base64
from datetime import datetime, timezone
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from conftest import load_toy_spec
from relay.orchestrator import goodput, goodput_chart, report
from tasks.artifacts import fit_lines


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A workdir after two sessions of the toy recipe (6 steps each): progress.json, metrics.jsonl, PNGs."""
    from relay.kernel.run import run_session

    workdir = tmp_path_factory.mktemp("artifacts") / "work"
    spec = load_toy_spec({"optim.epochs": None, "optim.max_steps": 12, "optim.eval_every_steps": 4,
                          "optim.log_every_steps": 2, "session.max_steps": 6})
    run_session(spec, workdir)
    progress = run_session(spec, workdir)
    assert len(progress["sessions"]) == 2 and progress["status"] == "done"
    images = {"curves": report.plot_curves(workdir / "metrics.jsonl", workdir / "curves.png", progress=progress),
              "timeline": report.plot_timeline(progress["sessions"], workdir / "timeline.png"),
              "goodput": goodput_chart.plot_goodput(goodput.from_progress(progress), workdir / "goodput.png")}
    return spec, workdir, progress, images


def plan_for(spec, progress) -> str:
    from flows.one_relay import plan_text

    halfway = {**progress, "status": "paused", "global_step": 6, "sessions": progress["sessions"][:1]}
    return plan_text(spec, halfway, None, datetime.now(timezone.utc))


def parse(markdown: str):
    tokens = MarkdownIt("commonmark").parse(markdown)
    images = [child for token in tokens if token.type == "inline" for child in token.children if child.type == "image"]
    fences = [token for token in tokens if token.type in ("fence", "code_block")]
    headings = [tokens[i + 1].content for i, token in enumerate(tokens) if token.type == "heading_open"]
    return tokens, images, fences, headings


def assert_images_render(images, expected: dict[str, Path]) -> None:
    """In the page's order: the goodput chart in its section, above the curves and the timeline."""
    expected = {k: expected[k] for k in sorted(expected, key=lambda k: k != "goodput")}
    assert [image.content for image in images] == list(expected)  # alt text: goodput, curves, timeline
    for image, png in zip(images, expected.values()):
        src = image.attrGet("src")
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1]) == Path(png).read_bytes()


def test_summary_has_image_nodes_and_the_plan(run):
    from tasks.artifacts import summary_markdown

    spec, workdir, progress, images = run
    plan = plan_for(spec, progress)
    assert "finish" in plan and "sessions" in plan  # a real plan with an ETA, not "(no plan yet: ...)"
    markdown = summary_markdown(spec.name, progress, images, plan, state="done")
    tokens, image_nodes, fences, headings = parse(markdown)
    assert_images_render(image_nodes, images)
    # the plan, its lines wrapped to the UI's code block (tests/orchestrator/test_ui_width.py)
    assert len(fences) == 1 and fences[0].type == "fence" and fences[0].content == fit_lines(plan.strip("\n")) + "\n"
    assert not any("base64" in f.content or "![" in f.content for f in fences)  # nothing swallowed by the fence
    assert headings == [f"{spec.name}: done", "Plan and ETA", "Goodput", "Loss curves", "Sessions timeline"]
    assert "goodput " in markdown and "| **all** |" in markdown  # where the GPU time went (issue 47), drawn too
    goodput_section = markdown.split("## Goodput")[1].split("## Loss curves")[0]
    assert "![goodput](data:image/png;base64," in goodput_section and "| **all** |" in goodput_section
    html = MarkdownIt("commonmark").render(markdown)
    assert html.count('<img src="data:image/png;base64,') == 3 and "![" not in html
    assert f"step <strong>{progress['global_step']} / {progress['total_steps']}</strong>" in html


@pytest.mark.parametrize("plan", ["", "\n", "(no plan yet: no session measured a step)\nline with ``` inside"])
def test_summary_is_well_formed_whatever_the_plan(run, plan):
    """The bug this guards: an empty plan opened a fence that was never closed, so the images became text."""
    from tasks.artifacts import summary_markdown

    spec, _, progress, images = run
    tokens, image_nodes, fences, headings = parse(summary_markdown(spec.name, progress, images, plan))
    assert_images_render(image_nodes, images)
    if plan.strip():
        assert [f.content for f in fences] == [fit_lines(plan.strip("\n")) + "\n"]
    else:
        assert fences == [] and "Plan and ETA" not in headings


def test_the_artifact_prefect_serves_renders(run, prefect_api):
    """publish_report inside a flow on a real Prefect server; the markdown read back from its API parses
    to the same image nodes and plan."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    from tasks.artifacts import publish_report

    spec, workdir, progress, images = run
    plan = plan_for(spec, progress)
    out = workdir.parent / "flow-out"
    out.mkdir(exist_ok=True)

    @flow(name="artifact-check")
    def publish() -> tuple:
        from prefect.runtime import flow_run

        written = publish_report(spec.name, progress, out, workdir / "metrics.jsonl", plan_text=plan, state="done")
        return written, flow_run.id

    def summary_of(run_id: str) -> list:  # that flow run's version of the key: other runs write it too
        with get_client(sync_client=True) as client:
            return client.read_artifacts(artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[f"{spec.name}-summary"]),
                flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))

    written, run_id = publish()
    stored = summary_of(run_id)
    assert len(stored) == 1 and stored[0].type == "markdown"
    _, image_nodes, fences, _ = parse(stored[0].data)
    assert_images_render(image_nodes, {k: Path(v) for k, v in written.items()})
    assert [f.content for f in fences] == [fit_lines(plan.strip("\n")) + "\n"]

    # while the next session runs, its live summary keeps the handed-over sessions' goodput chart
    from tasks.artifacts import publish_running

    records = [{"run_id": "s003-a1", "session": 3, "step_start": 12, "total_steps": 24, "step": 14, "kind": "train",
                "loss": 0.5, "time": progress["sessions"][-1]["ended"] + 60}]

    @flow(name="artifact-check-running")
    def running() -> str:
        from prefect.runtime import flow_run

        publish_running(spec.name, progress, records, out, workdir / "metrics.jsonl", "", "running")
        return flow_run.id

    stored = summary_of(running())
    assert len(stored) == 1 and "session 3 running" in stored[0].data
    assert [image.content for image in parse(stored[0].data)[1]] == ["goodput", "curves"]


def test_a_flow_run_keeps_one_artifact_per_key_updated_in_place_and_no_completed_line_per_task(run, prefect_api):
    """Issue 47: a 4-session run had 35 artifact cards (a new version of the summary and the session table at
    every event) and a "Finished in state Completed()" line per task run. Now: one of each key per flow run,
    holding the latest; the relay's task runs end silently, another flow's as Prefect logs them."""
    import logging

    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    from tasks import quiet_logs
    from tasks.artifacts import publish_report, publish_stop

    spec, workdir, progress, _ = run
    out = workdir.parent / "in-place-out"
    out.mkdir(exist_ok=True)
    seen: list = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append((getattr(record, "flow_name", None), record.getMessage()))
    logging.getLogger("prefect.task_runs").addHandler(handler)

    @task(name="noop")
    def noop() -> None:
        return None

    def body() -> str:
        from prefect.runtime import flow_run

        for state in ("running", "handed-over", "done"):
            publish_report(spec.name, progress, out, None, plan_text="", state=state)
        noop()
        publish_stop(spec.name, "stopped here: one line")
        return flow_run.id

    try:
        quiet_logs.install()
        run_id = flow(name="relay")(body)()
        flow(name="other")(lambda: noop())()
    finally:
        logging.getLogger("prefect.task_runs").removeHandler(handler)
    with get_client(sync_client=True) as client:
        stored = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[f"{spec.name}-summary", f"{spec.name}-sessions"]),
            flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))
    assert sorted(a.key for a in stored) == [f"{spec.name}-sessions", f"{spec.name}-summary"], stored
    summary = next(a for a in stored if a.key.endswith("summary"))
    assert summary.data.startswith(f"# {spec.name}: stopped, needs you")  # the latest, in place
    finished = [flow for flow, message in seen if message.startswith("Finished in state Completed(")]
    assert "relay" not in finished and "other" in finished, seen
