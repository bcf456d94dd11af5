"""A session that Kaggle stops at its session limit (CANCEL_ACKNOWLEDGED, "exceeded the max allowed execution
duration") is a budget set too long, not a transient failure: the relay hands over what the session saved,
does not push the same budget again, and stops with a message that says what to change; the plan of the next
run says it too. The limit is reached on an event (the session committed its first checkpoint), through the
emulator's `expire_now`, so the test holds on any machine."""
from __future__ import annotations

import threading
from datetime import datetime, timezone

import pytest

from relay.shared import spec as spec_mod

from relay_fixtures import wait_for  # noqa: E402


def test_a_session_stopped_at_the_limit_is_handed_over_and_stops_the_relay_with_advice(relay_env, both_flows,
                                                                                       monkeypatch):
    import flows.one_relay as one_relay

    emu = relay_env.start()
    # a session that would train far longer than the test: only the limit ends it
    relay_env.write_spec(**{"optim.max_steps": 10 ** 6, "session.max_steps": None})

    def expire_after_first_checkpoint() -> None:
        folder = emu.store.kernel_dir(relay_env.kernel, 1) / "working" / "relay" / "checkpoints"
        wait_for(lambda: folder.is_dir() and any(p.name.startswith("step-") for p in folder.iterdir()), 300,
                 "the first committed checkpoint")
        emu.runner.expire_now(relay_env.kernel, 1)

    trigger = threading.Thread(target=expire_after_first_checkpoint, daemon=True)
    trigger.start()
    with pytest.raises(one_relay.RelayFailed) as failed:
        relay_env.run_flow(monkeypatch, mode="watch")
    trigger.join(5)
    message = str(failed.value)
    assert "session 1 was stopped by Kaggle at its session limit" in message
    assert "exceeded the max allowed execution duration" in message
    assert "not a transient failure" in message and "lower session.budget" in message
    assert "handed over" in message

    runs = relay_env.kernel_runs()
    assert [(r.run_id, r.status) for r in runs] == [("toy-relay-s001-a1", "CANCEL_ACKNOWLEDGED")]  # no retry
    assert runs[0].failure == "Your notebook was stopped because it exceeded the max allowed execution duration"
    published = relay_env.published_progress()
    assert published["run_id"] == "toy-relay-s001-a1" and published["global_step"] > 0
    assert published["stop_reason"] == "session_limit"
    assert published["sessions"][-1]["stop_reason"] == "session_limit"
    gpus = published["sessions"][-1]["gpus"]  # what the session saw, recorded at its start
    assert gpus["count"] == len(gpus["names"])

    # the plan the next run prints says so too
    spec = spec_mod.load(relay_env.spec)
    plan = one_relay.plan_text(spec, published, None, datetime.now(timezone.utc))
    assert "warning: session 1 was stopped by Kaggle at its session limit" in plan


def test_a_limit_hit_with_nothing_saved_is_retried_only_once_the_budget_is_lowered(relay_env, both_flows, monkeypatch):
    """/kaggle/working of a run stopped at the limit may not be kept: nothing to hand over. The relay stops
    (the same budget would hit the limit again) until the spec asks for less; then it pushes a new attempt."""
    import flows.one_relay as one_relay

    emu = relay_env.start(timeout_keeps_output=False)  # disputed on Kaggle: here the working folder is lost
    relay_env.write_spec(**{"optim.max_steps": 10 ** 6, "session.max_steps": None, "session.budget": "4m"})

    def expire_after_first_checkpoint() -> None:
        folder = emu.store.kernel_dir(relay_env.kernel, 1) / "working" / "relay" / "checkpoints"
        wait_for(lambda: folder.is_dir() and any(p.name.startswith("step-") for p in folder.iterdir()), 300,
                 "the first committed checkpoint")
        emu.runner.expire_now(relay_env.kernel, 1)

    trigger = threading.Thread(target=expire_after_first_checkpoint, daemon=True)
    trigger.start()
    for _ in range(2):  # running it again with the same spec changes nothing
        with pytest.raises(one_relay.RelayFailed) as failed:
            relay_env.run_flow(monkeypatch, mode="watch")
        assert "session 1 was stopped by Kaggle at its session limit" in str(failed.value)
        assert "Nothing was handed over" in str(failed.value)
        assert [r.run_id for r in relay_env.kernel_runs()] == ["toy-relay-s001-a1"]
    trigger.join(5)
    assert relay_env.ckpt_versions() == []

    # the budget lowered (and, to keep the test short, the whole run): the next run retries session 1
    relay_env.write_spec(**{"optim.max_steps": 150, "session.max_steps": None, "session.budget": "3m"})
    done = relay_env.run_flow(monkeypatch, mode="watch")
    assert done["state"] == "done" and done["step"] == 150
    runs = relay_env.kernel_runs()
    assert [(r.run_id, r.status) for r in runs] == [("toy-relay-s001-a1", "CANCEL_ACKNOWLEDGED"),
                                                     ("toy-relay-s001-a2", "COMPLETE")]
