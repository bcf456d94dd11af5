"""A relay's states and the moves between them: the one state machine the `relay` and the `relays` flows drive.

A step (relay_step.py) leaves a relay in one State; a flow acts on it the same way for one relay or for
several: looks again after a hand-over, gives a ready relay a slot of its account's session cap (and takes it
back once no session of the relay runs), waits, or ends. The values are the words the flows have always
reported (flow results, the relays table, log lines), so a State compares equal to its old string.
Torch-free and Prefect-free: the orchestrator side, imported by both flows and the step.
"""
from __future__ import annotations

import enum
from typing import Optional


class State(str, enum.Enum):
    NEW = "new"                  # not stepped yet in this flow run
    READY = "ready"              # to push, given a slot and a budget
    PUSHED = "pushed"            # its next session was pushed by this step
    RUNNING = "running"          # a session of the relay is queued or running on Kaggle (or wedged, waited on)
    HANDED_OVER = "handed-over"  # a finished session's checkpoint was published: look again at once
    RESTORED = "restored"        # a bad checkpoint version was replaced by the newest valid one: look again
    WAITING = "waiting"          # for Kaggle's status, another orchestrator's claim, a slot, the quota (Wait)
    DONE = "done"
    STOPPED = "stopped"          # by the user (`relay stop`) until `relay resume`
    FAILED = "failed"            # needs a person (the `relay` flow raises RelayFailed; `relays` goes on)
    ERROR = "error"              # the step raised after its tasks' retries: stepped again next round

    def __str__(self) -> str:  # f-strings and %s show the word, never "State.DONE"
        return self.value


class Wait(str, enum.Enum):
    """What a WAITING relay waits for, where a flow acts on it."""

    SLOT = "a slot"    # every session of its account's cap runs: no step per poll, the slot's release is awaited
    QUOTA = "quota"    # the weekly GPU quota cannot pay for a session: until its refresh

    def __str__(self) -> str:
        return self.value


# a session of the relay runs: it holds one of its account's slots
IN_FLIGHT = frozenset({State.PUSHED, State.RUNNING})
# no session of the relay runs and none is about to be pushed by this step: its slot is another relay's to take
SLOT_FREED = frozenset({State.HANDED_OVER, State.DONE, State.STOPPED})
# the step changed what Kaggle shows (a checkpoint published or restored): the relay is stepped again at once
LOOK_AGAIN = frozenset({State.HANDED_OVER, State.RESTORED})
# a flow ends once every relay is in one (a stopped or done relay is still looked at while others run: `relay
# resume` makes a stopped one go on)
FINAL = frozenset({State.DONE, State.STOPPED, State.FAILED})

# where a state may lead: a step (advance) starts from any state but FAILED (a person must act first); a push
# only from READY; a ready relay given no slot or no quota waits
_STEP = frozenset({State.READY, State.RUNNING, State.HANDED_OVER, State.RESTORED, State.WAITING, State.DONE,
                   State.STOPPED, State.FAILED, State.ERROR})
MOVES: dict = {
    **{s: _STEP for s in State if s not in (State.READY, State.FAILED)},
    State.READY: frozenset({State.PUSHED, State.WAITING, State.STOPPED, State.FAILED, State.ERROR}),
    State.FAILED: frozenset(),
}


def move(before: State, after: State) -> State:
    """`after`, checked against MOVES: a flow that takes a step a state does not allow is a bug, said at once."""
    if after not in MOVES[State(before)]:
        raise ValueError(f"relay state: no move from {before} to {after}")
    return State(after)


def holds_slot(state: State) -> Optional[bool]:
    """Whether the relay holds a slot of its account's session cap after a step left it in `state`: True (a
    session runs: the slot lasts), False (give it back), None (as it was: a ready relay takes one at its push;
    a waiting one keeps what it has, e.g. a slot taken for a push Kaggle refused, kept for the retry)."""
    if state in IN_FLIGHT:
        return True
    if state in SLOT_FREED:
        return False
    return None


def label(state: State, waits_for: Optional[Wait] = None, why: str = "") -> str:
    """The relays table's and summary's word for a relay: the state, a wait said with what it waits for."""
    if state is not State.WAITING:
        return state.value
    if waits_for is not None:
        return f"waiting for {waits_for.value}"
    return f"waiting: {why}"[:120] if why else "waiting"


def overall(states: list) -> State:
    """Several relays' states as one (the relays flow's result): done when all are, failed when the rest are done,
    stopped when the rest are done or failed; otherwise the caller says running or waiting."""
    if all(s is State.DONE for s in states):
        return State.DONE
    if all(s in (State.DONE, State.FAILED) for s in states):
        return State.FAILED
    if all(s in FINAL for s in states):
        return State.STOPPED
    return State.RUNNING
