"""The session's plan crosses the wire as one typed JSON object (relay/shared/session_plan.py): the kernel script
writes it, `relay train --plan FILE` trusts it as it is (nothing written back into a re-parsed spec), a flag given
beside it wins, and the flags alone (by hand, kernels pushed before the plan) work as they did."""
from __future__ import annotations

from pathlib import Path

import pytest

from relay.shared.errors import InputError
from relay.shared.session_plan import SessionPlan


def test_a_plan_round_trips_and_a_bad_one_is_one_line(tmp_path):
    plan = SessionPlan(run_id="r-s001-a1", budget=1800.0, deadline=1767225600.0, resume_from=("/in/ckpt",),
                       data="/in/data", features=("/in/feat",))
    assert SessionPlan.from_json(plan.to_json()) == plan
    assert SessionPlan.from_json('{"format": 1, "budget": 30, "later": "ignored"}') == SessionPlan(budget=30.0)
    for text, why in (("[]", "not a session plan"), ('{"format": 2}', "not a session plan"), ("{", "not JSON"),
                      ('{"format": 1, "budget": "1h"}', "budget")):
        with pytest.raises(InputError, match=why):
            SessionPlan.from_json(text)
    with pytest.raises(InputError, match="cannot read the session plan"):
        SessionPlan.read(tmp_path / "absent.json")


def _train(monkeypatch, toy_spec, tmp_path, *args) -> dict:
    import relay.kernel.run as run_mod
    from relay import cli

    seen: dict = {}

    def fake(spec, workdir, **kwargs):
        seen.update(kwargs, spec=spec)
        return {"status": "paused", "global_step": 0, "total_steps": 1, "epoch": 0, "sessions": [],
                "stop_reason": "budget", "metrics": {}, "weights_sha256": "0" * 64}

    monkeypatch.setattr(run_mod, "run_session", fake)
    spec = toy_spec(tmp_path, session={"budget": "1h"})
    assert cli.main(["train", str(spec), "--workdir", str(tmp_path / "w"), *args]) == 0
    return seen


def test_relay_train_trusts_the_plan_and_a_flag_beside_it_wins(monkeypatch, toy_spec, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(SessionPlan(run_id="r-9", budget=30.0, resume_from=(str(tmp_path / "ckpt"),),
                                data=str(tmp_path / "data")).to_json())
    seen = _train(monkeypatch, toy_spec, tmp_path, "--plan", str(plan))
    assert seen["budget"] == 30.0 and seen["run_id"] == "r-9" and seen["deadline"] is None
    assert seen["resume_from"] == [tmp_path / "ckpt"] and seen["data_dir"] == tmp_path / "data"
    assert seen["spec"].session.budget == 3600  # the spec as written: the plan is not written back into it
    seen = _train(monkeypatch, toy_spec, tmp_path, "--plan", str(plan), "--budget", "none", "--run-id", "r-10")
    assert seen["budget"] is None and seen["run_id"] == "r-10"
    # the flags alone: what a kernel pushed before the plan runs
    seen = _train(monkeypatch, toy_spec, tmp_path, "--budget", "45", "--run-id", "r-1", "--resume-from", "c")
    assert seen["budget"] == 45 and seen["run_id"] == "r-1" and seen["resume_from"] == [Path("c")]
    # a plan without a budget: the spec's
    plan.write_text(SessionPlan(run_id="r-2").to_json())
    assert _train(monkeypatch, toy_spec, tmp_path, "--plan", str(plan))["budget"] == 3600
