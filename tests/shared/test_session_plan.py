"""The session's plan crosses the wire as one typed JSON object (relay/shared/session_plan.py): the orchestrator
makes it, the kernel script embeds its JSON, `relay train --plan FILE` reads it once into the session's settings
(nothing written back into a re-parsed spec), a plan flag beside it is refused, and the flags alone make a plan by
hand."""
from __future__ import annotations

from pathlib import Path

import pytest

from relay.shared.errors import InputError
from relay.shared.session_plan import SessionPlan


def test_a_plan_round_trips_and_a_bad_one_is_one_line(tmp_path):
    plan = SessionPlan(run_id="r-s001-a1", budget=1800.0, deadline=1767225600.0, resume_from=("/in/ckpt",),
                       data_dir="/in/data", feature_dirs=("/in/feat",), resume=("u/ckpt",), data="u/data",
                       features=("u/feat",), pip=("x==1",), canary=("u/data",), pushed_at=1.5, timeout_s=60,
                       charges=({"run_id": "r-s001-a0", "failed": "oom"},))
    assert SessionPlan.from_json(plan.to_json()) == plan
    assert SessionPlan.from_json('{"format": 2, "budget": 30, "later": "ignored"}') == SessionPlan(budget=30.0)
    for text, why in (("[]", "not a session plan"), ('{"format": 1}', "not a session plan of format 2"),
                      ("{", "not JSON"), ('{"format": 2, "budget": "1h"}', "budget"),
                      ('{"format": 2, "resume": "u/ckpt"}', "resume: expected a list")):
        with pytest.raises(InputError, match=why):
            SessionPlan.from_json(text)
    with pytest.raises(InputError, match="cannot read the session plan"):
        SessionPlan.read(tmp_path / "absent.json")


def _train(monkeypatch, toy_spec, tmp_path, *args) -> dict:
    import relay.kernel.run as run_mod
    from relay import cli
    from relay.kernel.session.settings import SessionSettings

    seen: dict = {}

    def fake(spec, workdir, plan=None):
        seen.update(spec=spec, settings=SessionSettings.from_spec(spec, workdir, plan))
        return {"status": "paused", "global_step": 0, "total_steps": 1, "epoch": 0, "sessions": [],
                "stop_reason": "budget", "metrics": {}, "weights_sha256": "0" * 64}

    monkeypatch.setattr(run_mod, "run_session", fake)
    spec = toy_spec(tmp_path, session={"budget": "1h"})
    assert cli.main(["train", str(spec), "--workdir", str(tmp_path / "w"), *args]) == 0
    return seen


def test_relay_train_reads_the_plan_into_its_settings_and_finds_its_mounts(monkeypatch, toy_spec, tmp_path):
    (tmp_path / "input" / "datasets" / "u" / "ckpt").mkdir(parents=True)  # Kaggle's nested layout
    (tmp_path / "input" / "data").mkdir()                                  # the older flat one
    monkeypatch.setenv("KAGGLE_INPUT_DIR", str(tmp_path / "input"))
    plan = tmp_path / "plan.json"
    plan.write_text(SessionPlan(run_id="r-9", budget=30.0, resume=("u/ckpt", "u/gone"), data="u/data",
                                features=("u/feat",)).to_json())
    seen = _train(monkeypatch, toy_spec, tmp_path, "--plan", str(plan))
    s = seen["settings"]
    assert s.budget == 30.0 and s.run_id == "r-9" and s.deadline is None
    assert s.resume_from == (str(tmp_path / "input" / "datasets" / "u" / "ckpt"),)  # u/gone: not mounted, skipped
    assert s.data == str(tmp_path / "input" / "data") and s.features == ()
    assert seen["spec"].session.budget == 3600  # the spec as written: the plan is not written back into it
    # a plan without a budget: the spec's
    plan.write_text(SessionPlan(run_id="r-2").to_json())
    assert _train(monkeypatch, toy_spec, tmp_path, "--plan", str(plan))["settings"].budget == 3600
    # the flags alone make the plan (by hand)
    seen = _train(monkeypatch, toy_spec, tmp_path, "--budget", "45", "--run-id", "r-1", "--resume-from", "c",
                  "--data", "d")
    s = seen["settings"]
    assert s.budget == 45 and s.run_id == "r-1"
    assert s.resume_from == (str(Path("c").resolve()),) and s.data == str(Path("d").resolve())


def test_a_plan_flag_beside_the_plan_is_one_line(toy_spec, tmp_path, capsys):
    from relay import cli

    plan = tmp_path / "plan.json"
    plan.write_text(SessionPlan(run_id="r-9").to_json())
    spec = toy_spec(tmp_path)
    for flags in (["--budget", "none"], ["--run-id", "r-10"], ["--resume-from", "c", "--data", "d"]):
        assert cli.main(["train", str(spec), "--workdir", str(tmp_path / "w"), "--plan", str(plan), *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"given with --plan {plan}" in err[0] and flags[0] in err[0], err
    assert not (tmp_path / "w").exists()
