"""The relay's states and moves (relay/orchestrator/relay_state.py) and the account's slot scheduler both flows use
(tasks/account_slots.py AccountSessions), without Kaggle or a Prefect server: the slots' Prefect side is
replaced by a recorder (tests/e2e/test_accounts.py covers it on a real server)."""
from __future__ import annotations

import json

import pytest

from relay.orchestrator.relay_state import (FINAL, IN_FLIGHT, MOVES, State, Wait, holds_slot, label, move,
                                            overall)


def test_states_are_the_words_the_flows_always_reported():
    assert State.HANDED_OVER == "handed-over" and f"{State.DONE}" == "done" and "%s" % State.WAITING == "waiting"
    assert json.dumps({"state": State.PUSHED}) == '{"state": "pushed"}'
    assert State("running") is State.RUNNING


def test_moves_allow_what_a_flow_does_and_refuse_the_rest():
    assert move(State.NEW, State.READY) is State.READY
    assert move(State.READY, State.PUSHED) is State.PUSHED
    assert move(State.DONE, State.DONE) is State.DONE  # the relays flow looks at a done relay while others run
    assert move(State.STOPPED, State.READY) is State.READY  # `relay resume`
    for before, after in ((State.READY, State.RUNNING), (State.READY, State.DONE), (State.FAILED, State.READY),
                          (State.RUNNING, State.PUSHED), (State.NEW, State.PUSHED)):
        with pytest.raises(ValueError, match=f"no move from {before.value} to {after.value}"):
            move(before, after)
    assert set(MOVES) == set(State)


def test_a_slot_is_held_while_a_session_runs_and_given_back_once_none_does():
    assert {s for s in State if holds_slot(s)} == IN_FLIGHT == {State.PUSHED, State.RUNNING}
    assert {s for s in State if holds_slot(s) is False} == {State.HANDED_OVER, State.DONE, State.STOPPED}
    assert holds_slot(State.WAITING) is None and holds_slot(State.READY) is None


def test_labels_and_the_overall_state():
    assert label(State.WAITING, Wait.QUOTA) == "waiting for quota"
    assert label(State.WAITING, Wait.SLOT) == "waiting for a slot"
    assert label(State.WAITING, None, "claimed by x" * 20) == ("waiting: " + "claimed by x" * 20)[:120]
    assert label(State.HANDED_OVER) == "handed-over"
    assert overall([State.DONE, State.DONE]) is State.DONE
    assert overall([State.DONE, State.FAILED]) is State.FAILED
    assert overall([State.STOPPED, State.FAILED, State.DONE]) is State.STOPPED
    assert overall([State.DONE, State.WAITING]) is State.RUNNING
    assert FINAL == {State.DONE, State.STOPPED, State.FAILED}


class Recorder:
    """AccountSlot's Prefect side: takes while the account's (shared) limit has room, records the calls."""

    calls: list = []
    taken: set = set()
    limit = 2

    def __init__(self, username, relay, sessions, hold_s, local=None):
        self.relay = relay

    def take(self, run_id=None):
        self.calls.append(("take", self.relay))
        if self.relay not in self.taken and len(self.taken) >= self.limit:
            return False
        self.taken.add(self.relay)
        return True

    def keep(self):
        self.calls.append(("keep", self.relay))

    def release(self, forget=False):  # forget: the relay's record goes too (it needs no more slots)
        self.calls.append(("release", self.relay))
        self.taken.discard(self.relay)

    def settle(self, run_id, pushed):  # which of two runs' slots stands for a session: test_slot_queue.py
        pass

    def close(self):
        pass


@pytest.fixture
def slots(monkeypatch):
    from tasks import account_slots

    monkeypatch.setattr(account_slots, "AccountSlot", Recorder)
    Recorder.calls, Recorder.taken, Recorder.limit = [], set(), 99
    sessions = account_slots.AccountSessions("ann", 2)
    for name in ("a", "b", "c"):
        sessions.add(name, 600)
    return sessions


def test_the_scheduler_counts_the_cap_one_way_by_the_accounts_limit(slots):
    Recorder.limit = 2  # the account's limit, made with the spec's kaggle.account_sessions
    assert slots.take("a") and slots.take("b")
    slots.stepped("a", State.PUSHED)
    slots.stepped("b", State.PUSHED)
    assert not slots.take("c") and ("take", "c") in Recorder.calls  # the cap, counted by the limit alone
    slots.stepped("a", State.RUNNING)
    assert Recorder.calls[-1] == ("keep", "a") and slots.in_flight == ["a", "b"]
    slots.stepped("a", State.HANDED_OVER)
    assert Recorder.calls[-1] == ("release", "a") and slots.in_flight == ["b"]
    assert slots.take("c")
    Recorder.limit = len(Recorder.taken)  # another flow run of the account fills its Prefect limit
    slots.stepped("b", State.READY)  # its session ended (the hand-over another orchestrator's): not counted here
    assert slots.in_flight == [] and not slots.take("a")
    assert slots.full() == "account ann: its 2 GPU sessions run (Prefect limit kaggle-account-ann); waiting for a slot"


def test_a_failed_relay_gives_its_slot_back_unless_its_session_runs(slots):
    slots.take("a")
    slots.stepped("a", State.PUSHED)
    slots.failed("a")
    assert ("release", "a") not in Recorder.calls  # kept until its lease ends: its session still runs
    assert slots.in_flight == []  # stepped no more: the account's limit counts its session from now on
    slots.stepped("b", State.WAITING)
    slots.failed("b")
    assert Recorder.calls[-1] == ("release", "b")


def test_the_relay_flow_is_the_scheduler_with_one_relay(slots, monkeypatch):
    """flows/one_relay.py's loop over scripted steps: a push waits for a slot of the account's limit (held by
    another flow run's relay), takes one when it is free, and gives it back once the session is handed over."""
    import logging
    from types import SimpleNamespace

    import flows.one_relay as one_relay
    import flows.relay_rounds as relay_rounds
    from relay.orchestrator import chain
    from relay.orchestrator.relay_context import Step

    obs = chain.Observation(None, None, None)
    script: list = []
    pushed: list = []
    monkeypatch.setattr(one_relay.relay_step, "advance", lambda ctx: Step(script.pop(0), chain.Action(chain.Do.PUSH),
                                                                          obs))
    monkeypatch.setattr(one_relay.relay_step, "plan", lambda *a: None)
    monkeypatch.setattr(one_relay.relay_step, "push", lambda ctx, ready, budget, quota:
                        pushed.append(budget) or Step(State.PUSHED, ready.action, obs))
    monkeypatch.setattr(relay_rounds.relay_tasks, "read_quota", lambda backend: None)
    monkeypatch.setattr(relay_rounds, "push_budget", lambda spec, quota, progress: 100.0)
    monkeypatch.setattr(one_relay, "get_run_logger", lambda: logging.getLogger("test"))
    ctx = SimpleNamespace(spec=SimpleNamespace(name="a", session=SimpleNamespace(safety_margin=1)), backend=None,
                          pause=lambda: None)
    pace = one_relay.Pace("tick", 0.01, float("inf"), 1.0, 0.0)

    Recorder.limit, Recorder.taken = 1, {"other"}  # another relay of the account runs its session
    script[:] = [State.READY]
    waiting = one_relay.drive(ctx, pace, slots)
    assert waiting["state"] == "waiting" and waiting["why"] == slots.full() and pushed == []
    Recorder.taken = set()  # its session was handed over
    script[:] = [State.READY]
    assert one_relay.drive(ctx, pace, slots)["state"] == "pushed" and pushed == [100.0]
    assert Recorder.taken == {"a"} and slots.in_flight == ["a"]
    script[:] = [State.HANDED_OVER, State.DONE]
    assert one_relay.drive(ctx, pace, slots)["state"] == "done"
    assert Recorder.taken == set() and slots.in_flight == [] and ("release", "a") in Recorder.calls
    script[:] = [State.READY]
    monkeypatch.setattr(one_relay.relay_step, "push", lambda *a: Step(State.READY, a[1].action, obs))
    with pytest.raises(ValueError, match="no move from ready to ready"):  # a step the state machine refuses
        one_relay.drive(ctx, pace, slots)


def test_within_one_flow_run_relays_take_turns_in_the_order_they_became_ready(slots):
    """First come, first served here too (a `relays` run, with or without a server): a relay that became ready
    later is refused while an earlier one waits; one that just handed over is ready again at the back."""
    slots.sessions = Recorder.limit = 1
    slots.stepped("a", State.READY)
    slots.stepped("b", State.READY)
    assert slots.in_turn(["b", "a"]) == ["a", "b"]
    assert not slots.take("b") and slots.take("a")
    slots.stepped("a", State.PUSHED)
    assert not slots.take("b")  # the cap: a's session runs
    slots.stepped("a", State.HANDED_OVER)
    slots.stepped("a", State.READY)  # ready again, after b
    assert slots.in_turn(["a", "b"]) == ["b", "a"] and not slots.take("a") and slots.take("b")


def test_without_a_server_the_flow_runs_own_count_is_the_limit(monkeypatch):
    """No Prefect server to count on: LocalLimit takes the limit's place, the same take / keep / release, so the cap
    is still counted one way (and Kaggle's refusal guards it across flow runs)."""
    from contextlib import nullcontext

    from tasks import account_slots

    monkeypatch.setattr(account_slots, "_client", lambda: nullcontext(None))
    sessions = account_slots.AccountSessions("ann", 1)
    for name in ("a", "b"):
        sessions.add(name, 600)
    sessions.stepped("b", State.RUNNING)  # a session pushed before this run started: it counts
    assert not sessions.take("a")
    sessions.stepped("b", State.HANDED_OVER)
    assert sessions.take("a") and not sessions.take("b")
    sessions.failed("a")  # stepped no more: this run counts it no more
    assert sessions.take("b")
