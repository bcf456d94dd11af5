"""One finish time (issue 47): the plan learns start-up, save and hand-over from the relay's own sessions, `relay
status NAME` plans with the spec the relay's sessions run with (read from its kernel), and `relay status`, the
progress artifact and the summary say the same finish, all from policy.forecast."""
from __future__ import annotations

import json
import logging
import re
import time
from datetime import datetime, timezone
from types import SimpleNamespace

import yaml

NAME = "fin-relay"
SPEC = {"name": NAME, "code": {"folder": "/not/on/this/machine", "entry": "train.py"}, "optim": {"max_steps": 520},
        "session": {"max_steps": 130, "safety_margin": "1s"}, "kaggle": {"startup_overhead": "2m"}}


def _session(index: int, started: float, seconds: float = 130.0) -> dict:
    return {"index": index, "run_id": f"{NAME}-s00{index}-a1", "started": started, "ended": started + seconds,
            "seconds": seconds, "step_start": 130 * (index - 1), "step_end": 130 * index, "save_seconds": 2.0,
            "stop_reason": "steps"}


def _relay_state(t0: float):
    """Two sessions handed over (each started 10 s after its push; 20 s from the first's end to the second's push)
    and the third running at 1 step/s, its lines up to step 293 of its 260 -> 390: the first line of its second
    quarter, an event of the live view's (a summary version), so the summary is made from the newest line too."""
    # the third's first line 30 s after the second's end: a hand-over of 20 s and a start-up of 10 s again
    one, two = _session(1, t0 - 319), _session(2, t0 - 319 + 130 + 20 + 10)
    charges = [{"run_id": s["run_id"], "pushed_at": s["started"] - 10, "process_end": s["ended"],
                "kaggle_end_seen": s["ended"] + 5, "wedged": False} for s in (one, two)]
    progress = {"run_id": two["run_id"], "global_step": 260, "total_steps": 520, "status": "paused",
                "sessions": [one, two], "charges": charges}
    records = [{"kind": "train", "session": 3, "run_id": f"{NAME}-s003-a1", "step_start": 260, "total_steps": 520,
                "step": 260 + i, "time": t0 + i, "loss": 1.0, "time_left_s": 3600.0 - i} for i in range(1, 34)]
    return progress, records


def test_figures_are_measured_from_the_relays_own_sessions_and_say_where_they_come_from():
    from relay.orchestrator import measured
    from relay.orchestrator.status import pushed_spec

    progress, _ = _relay_state(1_800_000_000.0)
    spec = pushed_spec(SimpleNamespace(current_spec_text=lambda kernel: yaml.safe_dump(SPEC)), "alice/fin-relay-session")
    figures = measured.overheads(spec, progress)
    assert (figures.startup.seconds, figures.save.seconds, figures.handover.seconds) == (10.0, 2.0, 20.0)
    assert figures.startup.source == figures.save.source == "measured over 2 sessions"
    assert figures.handover.source == "measured over 1 session"
    while_running = measured.overheads(spec, progress, running_started=1_800_000_000.0 + 1)  # the third's first line
    assert while_running.handover == measured.Figure(20.0, "measured over 2 sessions")
    before = measured.overheads(spec, {})  # nothing measured yet: the spec's, then the default
    assert before.startup == measured.Figure(120.0, "assumed: the spec's startup_overhead")
    assert before.save == measured.Figure(1.0, "assumed: the spec's safety_margin")
    assert before.handover == measured.Figure(measured.HANDOVER_DEFAULT_S, "assumed")


def test_the_hand_over_is_measured_over_clean_hand_overs_only():
    """A gap after a killed session, after a wedged one, or with a failed attempt pushed within it measures the
    fault (the relay waited for a deadline, retried), not a hand-over: only the clean 20 s one counts."""
    from relay.orchestrator import measured

    t0 = 1_800_000_000.0
    one, two = _session(1, t0), _session(2, t0 + 130 + 30)            # clean: 30 s between clocks
    three = _session(3, two["ended"] + 300)                            # after a failed attempt pushed between
    four = _session(4, three["ended"] + 200)                           # after a wedged one
    five = _session(5, four["ended"] + 400)                            # after a killed one
    four["stop_reason"] = "running"                                    # salvaged at its last save
    charges = [{"run_id": s["run_id"], "pushed_at": s["started"] - 10, "wedged": s is three} for s in
               (one, two, three, four, five)]
    charges.append({"run_id": f"{NAME}-s003-a1", "pushed_at": two["ended"] + 20, "failed": "wedged", "wedged": True})
    progress = {"sessions": [one, two, three, four, five], "charges": charges}
    assert measured.session_gaps(progress) == [30.0]
    spec = SimpleNamespace(kaggle=SimpleNamespace(startup_overhead=120.0), session=SimpleNamespace(safety_margin=1.0))
    assert measured.overheads(spec, progress, startup=10).handover == measured.Figure(20.0, "measured over 1 session")


def test_status_the_progress_artifact_and_the_summary_say_one_finish(monkeypatch, tmp_path):
    """A constructed relay: `relay status fin-relay` (by name, the spec read from the kernel), the flow's progress
    artifact text and its summary (tasks/live_view.py writing what relay/orchestrator/session_view.py shows of the
    running session) show the same finish."""
    import tasks.live_view as live_view
    from relay.orchestrator import chain, handoff, policy, status
    from relay.orchestrator.session_view import SessionView
    from tasks import artifacts

    t0 = time.time() - 33  # the running session ends in the future: the finish does not depend on when it is asked
    progress, records = _relay_state(t0)
    backend = SimpleNamespace(
        username="alice", quota=lambda: None, current_spec_text=lambda kernel: yaml.safe_dump(SPEC),
        dataset_versions=lambda dataset: [],  # what the relay stores (relay status says it): nothing here
        log_stream=lambda kernel: iter([{"data": "relay-progress " + json.dumps(r) + "\n"} for r in records]))
    names = chain.Names("alice", NAME)
    obs = chain.Observation(published=progress, kernel_run=f"{NAME}-s003-a1", kernel_state="running",
                            kernel_version=3, observed_at=time.time())

    monkeypatch.setattr(handoff, "observe", lambda *args: obs)  # what Kaggle shows
    monkeypatch.setattr(handoff, "published_metrics", lambda *a, **k: None)
    said = []
    assert status.report(NAME, lambda: backend, tmp_path / "status", emit=said.append) == 0
    by_status = "\n".join(said)
    assert "spec: the one its sessions run with" in by_status and "at step 390 (its step cap" in by_status, by_status

    spec = status.pushed_spec(backend, names.kernel)  # the flow runs with the spec it pushed
    plan, finish = policy.view_forecasts(spec, backend)
    view = live_view.LiveView(SessionView(backend, names, tmp_path, session_max_steps=130, plan=plan, finish=finish))
    view.session.live = SimpleNamespace(run_id=f"{NAME}-s003-a1", records=records, silent_for=lambda: 0.0)
    shown, summaries = [], []
    monkeypatch.setattr(live_view, "get_run_logger", lambda: logging.getLogger("test"))
    monkeypatch.setattr(artifacts, "show_progress", lambda name, step, total, text, artifact_id=None: shown.append(text))
    monkeypatch.setattr(artifacts, "_markdown", lambda md, key, description: summaries.append(md))
    monkeypatch.setattr(artifacts, "_table", lambda rows, key, description: None)
    view.refresh(progress, "running")
    assert shown and summaries

    def finishes(text: str) -> set:
        return set(re.findall(r"finish ~?(\w{3} \d{4}-\d\d-\d\d \d\d:\d\d UTC)", text))

    # session 3 ends at step 390, then saves (2 s), hands over (20 s); session 4 starts up (10 s), trains 130 steps
    # at the measured 128/130 s a step and saves: as the plan's session 4 ends
    ends = t0 + 130 + 2 + 20 + 10 + 130 * (128 / 130) + 2
    expected = policy.planner.when(datetime.fromtimestamp(ends, timezone.utc))
    assert finishes(by_status) == {expected}, by_status
    assert finishes(shown[-1]) == {expected}, shown[-1]
    assert finishes(summaries[-1]) == {expected}, summaries[-1]
    assert "start-up 10s (measured over 2 sessions)" in by_status and "hand-over 20s (measured over 2 sessions)" \
        in summaries[-1]


PLAN_SPEC = {"name": "plan-relay", "recipe": "toy", "params": {"n_train": 256, "n_eval": 64, "hidden": 64},
             "optim": {"micro_batch": 8, "lr": 0.003, "max_steps": 36_000}, "session": {"threads": 1}}


def test_relay_plan_states_the_goodput_it_expects_and_of_which_figures(tmp_path, capsys, monkeypatch):
    """One session of 10 h of training (36,000 steps of 1 s): charged its start-up, its training and its final
    save; its 20 periodic saves (session.save_every 30 m) are not training. From the flags, then from a previous
    relay's records (--from NAME: its published progress.json)."""
    from relay import cli
    from relay.orchestrator import status

    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(PLAN_SPEC))
    assert cli.main(["plan", str(spec), "--step-seconds", "1", "--startup", "2m", "--save", "20s",
                     "--handover", "1m"]) == 0
    out = capsys.readouterr().out
    train = 36_000 - 20 * 20
    goodput = train / (120 + 36_000 + 20)
    assert (f"expected goodput {goodput:.0%} (start-up 2m (--startup), save 20s (--save), hand-over 1m (--handover));"
            f" the week's 30 h buy {goodput * 30:.1f} h of training") in out, out

    progress, _ = _relay_state(1_800_000_000.0)  # a previous relay: start-up 10 s, save 2 s, hand-over 20 s
    published = SimpleNamespace(published=progress)
    monkeypatch.setattr(status, "find_relay", lambda name, factory, command: (name, None, None, None, published))
    assert cli.main(["plan", str(spec), "--step-seconds", "1", "--from", NAME]) == 0
    out = capsys.readouterr().out
    goodput = (36_000 - 20 * 2) / (10 + 36_000 + 2)
    assert (f"expected goodput {goodput:.0%} (start-up 10s (measured over 2 sessions), save 2.0s (measured over 2"
            f" sessions), hand-over 20s (measured over 1 session)); the week's 30 h buy {goodput * 30:.1f} h of"
            f" training; figures of relay {NAME}") in out, out


def test_a_session_kaggle_still_runs_after_its_process_ended_moves_the_finish_with_the_wait():
    """A session whose process ended (its last line said so) while Kaggle still shows it running, as a wedged one
    until its deadline: the relay hands it over only once Kaggle ends it, so the finish is no earlier than now plus
    its save, a hand-over and the sessions after it (the save and the hand-over used to be counted from its last
    line, in the past, and the next sessions from now: 22 s early here, a save and a hand-over, whatever the wait)."""
    from datetime import timedelta

    from relay.orchestrator import live_progress, policy
    from relay.orchestrator.status import pushed_spec

    t0 = 1_800_000_000.0
    progress, records = _relay_state(t0)
    last = records[-1]
    records.append({**last, "step": 390, "time": last["time"] + 97, "time_left_s": 0.0})  # the process's last line
    eta = live_progress.estimate(records, session_max_steps=130)
    spec = pushed_spec(SimpleNamespace(current_spec_text=lambda kernel: yaml.safe_dump(SPEC)), "alice/fin-relay-session")
    at_end = datetime.fromtimestamp(eta.session_ends_at, timezone.utc)
    finish_then = policy.forecast(spec, progress, None, at_end, running=eta).finish
    an_hour_on = at_end + timedelta(hours=1)  # Kaggle still shows it running an hour later
    finish_now = policy.forecast(spec, progress, None, an_hour_on, running=eta).finish
    assert finish_then is not None and finish_now - finish_then == timedelta(hours=1)
