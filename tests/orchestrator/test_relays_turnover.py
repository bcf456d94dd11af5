"""A freed session slot goes to the queue's head without another look at Kaggle (issue 60: a slot's turnover).

Two toy relays of one account with `kaggle.account_sessions: 1`, two sessions each, through one `relays` watch
on the emulator and the tests' Prefect server. The relay that waits for the slot was looked at (ready) before
the slot freed; when the other's session ends, its push follows on that look (flows/relay_rounds.py,
looked_lately: younger than a quarter of the claims' lease, so the push's claim on Kaggle still guards against
another orchestrator's push). Spies (the real steps, recorded) say what each relay's steps found: exactly one
look found a relay ready before each of its pushes. Before the change, a relay that waited for the slot was
looked at again once the slot freed: two ready looks before that push.
"""
from __future__ import annotations

import threading

from relay_fixtures import STEPS_PER_SESSION, write_spec  # noqa: E402

NAMES = ("toy-turn-a", "toy-turn-b")


def test_a_freed_slot_goes_to_the_queues_head_on_its_earlier_look(relay_env, monkeypatch, tmp_path):
    import flows.relays_sharing_quota as relays_sharing_quota
    import tasks.relay_host as relay_host
    from relay.orchestrator import relay_step
    from relay.orchestrator.relay_state import State
    from tasks.account_slots import AccountSessions

    relay_env.start()
    specs = [write_spec(tmp_path / name, **{"name": name, "seed": 3 + i, "optim.max_steps": 2 * STEPS_PER_SESSION,
                                            "kaggle.account_sessions": 1,
                                            "kaggle.lease": "20m"})  # a look pushed on: within lease / 4
             for i, name in enumerate(NAMES)]
    monkeypatch.setattr(relay_host, "make_backend", lambda credentials_block=None: relay_env.backend())

    events, guard = {name: [] for name in NAMES}, threading.Lock()
    advance, push, full = relay_step.advance, relay_step.push, AccountSessions.full

    def looked(ctx):
        step = advance(ctx)
        with guard:
            events[ctx.spec.name].append(f"look:{step.state.value}")
        return step

    def pushed(ctx, ready, budget_s, quota):
        step = push(ctx, ready, budget_s, quota)
        with guard:
            events[ctx.spec.name].append(f"push:{step.state.value}")
        return step

    waited = []

    def no_slot(self):
        waited.append(1)
        return full(self)

    monkeypatch.setattr(relay_step, "advance", looked)
    monkeypatch.setattr(relay_step, "push", pushed)
    monkeypatch.setattr(AccountSessions, "full", no_slot)
    res = relays_sharing_quota.relays(specs=[str(s) for s in specs], mode="watch", poll_seconds=0.3,
                                      state_dir=str(tmp_path / "orchestrator"))
    assert {r["state"] for r in res["relays"].values()} == {"done"}, res
    assert waited, "no relay waited for the slot: the test did not exercise the queue's head"
    for name, seen in events.items():
        assert seen.count(f"push:{State.PUSHED.value}") == 2, (name, seen)
        looks = []  # ready looks before each push
        for event in seen:
            if event == f"look:{State.READY.value}":
                looks.append(event)
            elif event.startswith("push:"):
                assert len(looks) == 1, (name, seen)  # pushed on the look that found it ready, none again
                looks = []
