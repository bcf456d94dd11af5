"""The one relay driver both flows use: a relay's state (`Relay`), its step, and the one push loop (`push_in_turn`)
that gives ready relays the free slots of their account's session limit, in turn, each with its share of the
quota. The `relays` flow runs rounds of it over many relays (`run_round`); the `relay` flow is the same driver
over one relay, adding only how it waits (watch or tick) and how it follows its one session.

A round steps its relays concurrently (at most ROUND_THREADS at once: a step is mostly waiting on Kaggle and on
Prefect), so a round lasts about as long as its slowest step, not the sum of them (issue 60: 52 s rounds at 30
relays, stepped one after another). A relay with nothing left to do (done, failed) is not stepped. A slot freed by
a session's end goes to the queue's head at once, not after the round's hand-overs (`run_round`).
"""
from __future__ import annotations

import contextvars
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Dict, List, Optional

from relay.orchestrator.kaggle.types import Refusal
from relay.orchestrator.policy import push_budget, utc
from relay.orchestrator.relay_state import FINAL, LOOK_AGAIN, State, Wait, label, move
from relay.shared.errors import InputError
from relay.shared.progress import Progress
from relay.orchestrator import relay_step
from relay.orchestrator.relay_context import RelayContext, RelayFailed, Step
from tasks import relay_tasks
from tasks.account_slots import AccountSessions

MAX_ERROR_ROUNDS = 3  # a relay whose round raised this many times in a row (after task retries) is failed
ROUND_THREADS = 8     # relays stepped at once in a round: Kaggle's and Prefect's calls, not this process's CPU
FIRST_LOOKS = 2 * ROUND_THREADS  # relays looked at for the first time in one round: the others in the next rounds,
                                 # so that a round's length does not grow with the relays (200 first looks: ~40 s)


@dataclass
class Relay:
    """One relay as a flow drives it: its one state (relay/orchestrator/relay_state.py) and its last step."""

    spec_path: str
    name: str
    ctx: Optional[RelayContext] = None
    failed: str = ""              # why it stopped for good (this flow run)
    errors: int = 0               # rounds in a row that raised
    state: State = State.NEW
    waits_for: Optional[Wait] = None
    step: Optional[Step] = None   # what its last step found or did

    @property
    def progress(self) -> Optional[Progress]:
        return self.step.progress if self.step else None

    def enter(self, state: State, step: Optional[Step] = None, waits_for: Optional[Wait] = None) -> None:
        self.state, self.waits_for = move(self.state, state), waits_for
        self.step = step or self.step

    def took(self, step: Step) -> Step:
        """Enter the state `step` left the relay in; returns the step."""
        self.enter(step.state, step, step.waits_for)
        return step

    def fail(self, why: str) -> None:
        self.failed = why
        self.enter(State.FAILED)

    @property
    def shown(self) -> str:
        """Its state in the relays table and the flow's result."""
        return label(self.state, self.waits_for, self.step.why if self.step else "")


@dataclass
class Round:
    rows: Dict[str, dict] = field(default_factory=dict)
    in_flight: List[str] = field(default_factory=list)
    pushed: List[str] = field(default_factory=list)
    handed_over: List[str] = field(default_factory=list)
    refused: int = 0
    quota_wait: Optional[datetime] = None  # the refresh every waiting relay waits for
    unseen: int = 0  # relays left for the next round's first looks (FIRST_LOOKS): the next round follows at once


def step(relay: Relay, slots: AccountSessions) -> Step:
    """One step of the relay (relay/orchestrator/relay_step.py), its state entered and its slot kept or given back."""
    taken = relay.took(relay_step.advance(relay.ctx))
    slots.stepped(relay.name, taken.state)
    return taken


def push_in_turn(backend, relays: List[Relay], slots: AccountSessions, rnd: Round, logger,
                 skip: frozenset | set = frozenset()) -> None:
    """The one push loop: the ready relays pushed into the free slots in the order they became ready (first come,
    first served, as across flow runs: tasks/slot_queue.py), each session's budget the spec's, within an equal
    share of the quota left among the unfinished relays. A ready relay not pushed is left waiting, for the quota
    (its refresh in rnd.quota_wait) or for a slot. `skip`: relays whose step runs meanwhile (another thread)."""
    ready = [r for r in relays if not r.failed and r.state is State.READY and r.name not in skip]
    if not ready:
        return
    quota = relay_tasks.read_quota(backend)
    unfinished = [r for r in relays if r.state not in FINAL]
    turns = slots.in_turn([r.name for r in ready])
    ready.sort(key=lambda r: turns.index(r.name))
    short = False  # the quota cannot pay for the next session
    for relay in ready:
        budget = push_budget(relay.ctx.spec, quota, relay.step.progress)  # no longer than it needs
        if quota is not None and quota.allowed_s > 0:
            budget = min(budget, quota.remaining_s / max(1, len(unfinished)))  # equal shares of what is left
        if budget <= relay.ctx.spec.session.safety_margin or rnd.quota_wait:
            rnd.quota_wait = utc(quota.refresh_time) if quota is not None and quota.refresh_time else None
            short = True
            break
        run_id = relay.step.action.run_id
        if not slots.take(relay.name, run_id):  # the account's sessions all run, or not its turn
            break
        relay_step.plan(relay.ctx, relay.step.progress, quota)
        pushed = relay.took(relay_step.push(relay.ctx, relay.step, budget, quota))
        # won Kaggle's claim (pushed, or refused and retried) or lost it to another orchestrator: one slot kept
        slots.settle(relay.name, run_id, pushed.state is State.PUSHED or pushed.refusal is not None)
        slots.stepped(relay.name, pushed.state)  # a refused push keeps its slot for the retry
        if pushed.refusal is not None:
            logger.warning("relay %s: %s", relay.name, pushed.why)
            rnd.refused += 1
            if pushed.refusal is Refusal.QUOTA and quota is not None:
                rnd.quota_wait = utc(quota.refresh_time)
            break  # the cap (or the quota) is reached on Kaggle's side: the rest wait their turn
        if pushed.state is State.WAITING:  # claimed by another orchestrator, or the claim failed: it tries again
            logger.info("relay %s: %s", relay.name, pushed.why)
        elif pushed.state is State.PUSHED:  # (or stopped by the user, `relay stop`, since its step observed)
            rnd.pushed.append(relay.name)
    for relay in ready:
        if relay.state is not State.READY:
            continue
        if short or rnd.quota_wait:
            relay.took(relay_step.quota_spent(relay.ctx, relay.step, quota))
        else:
            relay.took(replace(relay.step, state=State.WAITING, waits_for=Wait.SLOT, why=slots.full()))


def run_round(backend, relays: List[Relay], slots: AccountSessions, logger,
              still_running: frozenset = frozenset(), ended: Optional[Dict[str, str]] = None,
              poll_seconds: float = 30.0, first_looks: int = FIRST_LOOKS) -> Round:
    """The relays' steps (concurrently, bounded), the ready ones pushed into the free slots in turn. Stepped:
    every unfinished relay but those whose session the flow saw still running (`still_running`, its deadline
    ahead) and those waiting for a slot beyond the free ones: a relay with nothing to do costs no task run, no
    log line and no write, so a round's cost follows what changed, not the number of relays.

    A free slot does not wait for the round's hand-overs (seconds to minutes each): the sessions the flow saw end
    (`ended`: {relay: its kernel's end state}; their views show the end beside their hand-overs) give their
    slots back at once (Kaggle counts running sessions only) and the relays that waited longest are pushed into
    the free slots first, on the look that found them ready when it is recent (looked_lately), the next in turn
    looked at again in the round while the slots are busy when it is not (_heads); while the steps run, the
    sessions seen running are asked their state every `poll_seconds`, and one that ended gives its slot to the
    queue's head at once (its own hand-over is stepped beside the others: its relay then goes to the back of the
    queue). At most `first_looks` relays are looked at for the first time (Round.unseen: those left for the next
    round)."""
    rnd = Round()
    active = [r for r in relays if not r.failed and r.state is not State.DONE]  # done: no step, no lock, no write
    running = [r for r in active if r.state is State.RUNNING]
    # the sessions seen ended, and those that ended since (one status call each: the round's own step of such a
    # relay would hand its session over first, seconds to minutes, before its slot went back)
    ends = dict(ended or {})  # {relay: its kernel's end state}: its view shows the end beside its hand-over
    seen_ended = [r for r in running if r.name in ends]
    freed = seen_ended + _ended_meanwhile([r for r in running if r.name not in ends], ends)
    for relay in freed:
        slots.session_ended(relay.name)
    watched = [r for r in active if _still_running(r, still_running) and r not in freed]  # freed: stepped now
    heads = _heads(active, slots)  # the next in turn: their look is taken again once old, before a slot frees
    now = [r for r in active if (not _waits_for_slot(r) or r in heads) and r not in watched]
    first = [r for r in now if r.state is State.NEW]
    rnd.unseen = max(0, len(first) - first_looks)
    now = [r for r in now if r.state is not State.NEW] + first[:first_looks]
    try:
        stepping: set = {r.name for r in now}  # stepped in the pool: not also pushed or stepped by _fill meanwhile
        _fill(backend, relays, slots, rnd, logger, stepping)
        with ThreadPoolExecutor(max_workers=ROUND_THREADS, thread_name_prefix="relay-step") as pool:
            def submit(relay: Relay):
                stepping.add(relay.name)
                # in a copy of the flow run's context: the step's task runs and log lines are the flow run's
                return pool.submit(contextvars.copy_context().run, _advance, relay, rnd, slots, logger,
                                   ends.get(relay.name))

            pending, next_look = {submit(r): r for r in now}, time.monotonic() + poll_seconds
            while pending:
                done, _ = wait(list(pending), timeout=max(0.0, next_look - time.monotonic()),
                               return_when=FIRST_COMPLETED)
                for future in done:
                    future.result()
                    relay = pending.pop(future)
                    stepping.discard(relay.name)
                    if relay.state is State.RUNNING and relay not in watched:  # found running: its end is looked
                        watched.append(relay)                                  # for while the round goes on
                look = pending and time.monotonic() >= next_look
                if look:
                    next_look = time.monotonic() + poll_seconds
                for relay in _ended_meanwhile(watched, ends) if look else ():
                    watched.remove(relay)
                    slots.session_ended(relay.name)
                    pending[submit(relay)] = relay  # its hand-over, beside the others
                if pending:
                    _fill(backend, relays, slots, rnd, logger, stepping)
        push_in_turn(backend, relays, slots, rnd, logger)
    finally:
        for relay in relays:
            if relay.ctx is not None:
                relay.ctx.close()  # claims that took no effect: free for another orchestrator at once
    rnd.in_flight = list(slots.in_flight)
    return rnd


def _waits_for_slot(relay: Relay) -> bool:
    return relay.state is State.WAITING and relay.waits_for is Wait.SLOT


def _fill(backend, relays: List[Relay], slots: AccountSessions, rnd: Round, logger, stepping: set) -> None:
    """The free slots (as this run counts them: a hint, the push takes its slot from the account's limit) given
    to the relays that waited longest, each stepped (its turn may have come) and pushed now; and the relays whose
    step made them ready meanwhile (not those still stepping)."""
    free = slots.sessions - len(slots.in_flight)
    queued = [r for r in relays if _waits_for_slot(r) and not r.failed and r.name not in stepping]
    if free <= 0:
        return
    if queued:
        turns = slots.in_turn([r.name for r in queued])
        for relay in sorted(queued, key=lambda r: turns.index(r.name))[:free]:
            if looked_lately(relay):  # its look still holds: the freed slot costs the take and the push only
                relay.took(replace(relay.step, state=State.READY, waits_for=None, why=""))
            else:
                _advance(relay, rnd, slots, logger)
    if any(r.state is State.READY for r in relays if r.name not in stepping):
        push_in_turn(backend, relays, slots, rnd, logger, skip=stepping)


def _heads(active: List[Relay], slots: AccountSessions) -> List[Relay]:
    """The relays waiting for a slot that the next freed slots go to (as many as the account has sessions) whose
    look is too old to push on (looked_lately): stepped in this round, while every slot is busy, so that a freed
    slot costs the take and the push only, not a look at Kaggle first."""
    queued = [r for r in active if _waits_for_slot(r)]
    if not queued:
        return []
    turns = slots.in_turn([r.name for r in queued])
    return [r for r in sorted(queued, key=lambda r: turns.index(r.name))[:slots.sessions] if not looked_lately(r)]


def looked_lately(relay: Relay) -> bool:
    """The relay's look at Kaggle that found it ready is recent enough to push on: younger than a quarter of its
    claims' lease (kaggle.lease). Another orchestrator that pushed the same run since that look did so under a
    claim it confirmed with half the lease left and keeps until it expires (relay/orchestrator/kaggle/lease.py),
    so our push's claim meets it and backs off: one push per run id, as when the look comes right before the
    push. An older look (a relay that waited hours for a slot) is taken again first."""
    obs = relay.step.obs if relay.step is not None else None
    return (relay.ctx is not None and obs is not None and obs.observed_at > 0
            and time.time() - obs.observed_at < relay.ctx.spec.kaggle.lease / 4)


def _ended_meanwhile(watched: List[Relay], ends: Dict[str, str]) -> List[Relay]:
    """The relays among `watched` whose session Kaggle now shows ended (one status call each; an error: not seen),
    their end states added to `ends`."""
    ended = []
    for relay in watched:
        version = relay.step.obs.kernel_version if relay.step else None
        if not version:
            continue
        try:
            state = relay.ctx.backend.kernel_status(relay.ctx.names.kernel, version).state
        except Exception:  # noqa: BLE001 - not seen now: the next look, or the next round, sees it
            continue
        if state is not None and state.finished:
            ends[relay.name] = state.value
            ended.append(relay)
    return ended


def _still_running(relay: Relay, still_running: frozenset) -> bool:
    """The flow saw its session still running since its last step, and its deadline (wedged?) is ahead."""
    deadline = relay.step.deadline if relay.step else None
    return (relay.state is State.RUNNING and relay.name in still_running and deadline is not None
            and deadline > time.time())


def _advance(relay: Relay, rnd: Round, slots: AccountSessions, logger, ended_as: Optional[str] = None) -> None:
    """One relay's step, as the `relay` flow takes it; after a hand-over it looks again, so that its next session
    may go into a slot this round. A failure is the relay's, never the round's. `ended_as`: its session was seen
    end in that state (its slot given away already): its live view shows the end first."""
    if ended_as is not None and relay.state is State.RUNNING and relay.step is not None:
        try:
            relay_step.show_end(relay.ctx, relay.step, ended_as)
        except Exception as err:  # noqa: BLE001 - the live view never fails a relay
            logger.warning("relay %s: the end of its session not shown: %s", relay.name, err)
    try:
        taken = step(relay, slots)
        if taken.state in LOOK_AGAIN:
            if taken.state is State.HANDED_OVER:
                rnd.handed_over.append(relay.name)
            taken = step(relay, slots)
        if taken.state is State.RUNNING:
            relay_step.show_running(relay.ctx, taken)
        relay.errors = 0
    except RelayFailed as err:
        failed(relay, str(err), slots, logger)
        relay_step.stopped(relay.ctx, err)
    except InputError as err:
        failed(relay, str(err), slots, logger)
    except Exception as err:  # noqa: BLE001 - transient after the tasks' retries: try again next round
        relay.errors += 1
        relay.enter(State.ERROR)  # its slot as it was: the step says nothing of its session
        logger.warning("relay %s: %s (%d/%d)", relay.name, err, relay.errors, MAX_ERROR_ROUNDS)
        if relay.errors >= MAX_ERROR_ROUNDS:
            failed(relay, f"{type(err).__name__}: {err}", slots)


def failed(relay: Relay, why: str, slots: AccountSessions, logger=None) -> None:
    """The relay needs a person: reported and left (its slot given back unless its session runs)."""
    relay.fail(why)
    slots.failed(relay.name)
    if logger is not None:
        logger.error("relay %s failed: %s (the others go on)", relay.name, why)
