"""A Kaggle account's concurrent GPU sessions as a Prefect global concurrency limit, `kaggle-account-<username>`,
created with the spec's `kaggle.account_sessions` slots (Kaggle's cap: 2).

A slot stands for one relay's session, not for the process that pushed it: a relay takes one before it pushes
and gives it back once that session has been handed over, whichever flow run (watch or tick, on any worker) does
each. The slot is a Prefect lease as long as the session can last on Kaggle (its timeout plus start-up,
`hold_s`), recorded in the Prefect variable `kaggle-slot-<username>-<relay>` (the relay's one record: its place in
the queue, then its slot; tasks/slot_queue.py), so that:
- a flow run killed while its session runs leaves the slot taken for as long as the session may run, and the
  next run of the relay finds it by the record, renews it while it follows the session and gives it back after
  the hand-over: the account's count stays true through a worker's death;
- two flow runs of one relay (two deployments, a watch beside a schedule) share its one slot;
- a relay never run again gives its slot back when the lease ends (the server's repossessor service).
Relays of one account on one Prefect server therefore wait for a slot instead of pushing into Kaggle's refusal,
and take turns: first come, first served, whatever flow run or worker each runs in (tasks/slot_queue.py);
Kaggle's refusal (the relay waits and tries again) and the claims on Kaggle (relay/orchestrator/kaggle/lease.py)
stay the guarantee. Slots are taken only with a Prefect server to count on (PREFECT_API_URL set).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Dict, List, Optional

from relay.orchestrator.relay_state import State, holds_slot
from tasks.prefect_writes import soon
from tasks.slot_queue import SlotQueue, is_place, record_name
from tasks.step_lock import SERVER_LEASE_S, delete_record, ensure_limit, read_record, take_slot, write_record

log = logging.getLogger(__name__)
MAX_LEASE_S = 24 * 3600.0  # the longest lease Prefect's server grants


def limit_name(username: str) -> str:
    return f"kaggle-account-{username}"


class AccountSessions:
    """The one owner of an account's session slots, for both flows: the `relay` flow is the `relays` flow with one
    relay. The cap is the specs' kaggle.account_sessions and it is counted one way: the account's Prefect limit
    (every flow run on the server), or, with no server to count on, this process's count of the same slots
    (LocalLimit). Each step's state says whether its relay holds a slot (relay_state.holds_slot); a ready relay
    takes one before its push. Safe to call from the threads a round steps its relays in."""

    def __init__(self, username: str, sessions: int):
        self.username, self.sessions, self.limit = username, sessions, limit_name(username)
        self.slots: Dict[str, AccountSlot] = {}
        self._in_flight: List[str] = []
        self.ready_since: Dict[str, float] = {}  # when each relay without a session became ready: its turn here
        self._guard = threading.Lock()           # the round's threads step relays at once
        self.local = LocalLimit()                # the count where no Prefect server counts (this flow run's)

    def add(self, relay: str, hold_s: float) -> None:
        """A relay of this account, whose session lasts at most `hold_s` on Kaggle (its timeout and start-up)."""
        self.slots[relay] = AccountSlot(self.username, relay, self.sessions, hold_s, self.local)

    @property
    def in_flight(self) -> List[str]:
        """The relays whose session runs, in the order this run saw them (what the flow reports and waits on)."""
        with self._guard:
            return list(self._in_flight)

    def stepped(self, relay: str, state: State) -> None:
        """After a step: a running session's slot lasts; a relay with no session running gives its slot back."""
        holds = holds_slot(state)
        with self._guard:
            if state is State.READY:
                self.ready_since.setdefault(relay, time.time())
            elif holds is not None or state in (State.FAILED, State.STOPPED):
                self.ready_since.pop(relay, None)  # pushed, handed over, ended: the next time it is ready, at the back
            if holds and relay not in self._in_flight:
                self._in_flight.append(relay)
            elif not holds and relay in self._in_flight:  # Kaggle counts running sessions only: one waiting for its
                self._in_flight.remove(relay)             # hand-over, or ready, leaves room for another's push
        if state is State.RUNNING:
            self.slots[relay].keep()  # queued or running (pushed by this run or another): its lease lasts
        elif holds is False:
            self.slots[relay].release(forget=state in (State.DONE, State.STOPPED))

    def session_ended(self, relay: str) -> None:
        """The flow saw the relay's session end on Kaggle: its slot is free now, before its hand-over (Kaggle
        counts running sessions only), for the relay that waited longest."""
        with self._guard:
            if relay in self._in_flight:
                self._in_flight.remove(relay)
        self.slots[relay].release()

    def in_turn(self, relays: List[str]) -> List[str]:
        """`relays` in the order they became ready (first come, first served; the name breaks a tie)."""
        return sorted(relays, key=lambda r: (self.ready_since.get(r, time.time()), r))

    def take(self, relay: str, run_id: Optional[str] = None) -> bool:
        """Before the push of `run_id`: a slot for the relay's next session; False when every session of the cap
        runs, or a relay that became ready before it waits for one (here, or in any flow run on the server)."""
        with self._guard:
            since = self.ready_since.get(relay)
            if since is not None and any(t < since for r, t in self.ready_since.items()
                                         if r != relay and r not in self._in_flight):
                return False
        return self.slots[relay].take(run_id)

    def settle(self, relay: str, run_id: Optional[str], pushed: bool) -> None:
        """After the push of `run_id` won or lost its claim on Kaggle: the relay keeps one slot for that session
        (AccountSlot.settle)."""
        self.slots[relay].settle(run_id, pushed)

    def close(self) -> None:
        """The flow run ends: a slot it took that the relay's record does not name goes back (AccountSlot.close)."""
        for slot in self.slots.values():
            slot.close()

    def failed(self, relay: str) -> None:
        """The relay needs a person and pushes nothing until one acts: its slot goes back, unless its session runs
        (kept until its lease ends: max_hours passed, a kernel that runs another session). It is stepped no more,
        so it leaves this run's count at once: the account's limit and Kaggle's refusal count its session."""
        with self._guard:
            self.ready_since.pop(relay, None)
            running = relay in self._in_flight
            if running:
                self._in_flight.remove(relay)
        self.local.release(self.limit, relay)  # stepped no more: this run counts it no more
        if not running:
            self.slots[relay].release(forget=True)

    def full(self) -> str:
        """Why a ready relay waits for a slot."""
        return (f"account {self.username}: its {self.sessions} GPU sessions run (Prefect limit {self.limit});"
                " waiting for a slot")

    def wait_free(self, relay: str, until: float, poll_seconds: float) -> bool:
        return self.slots[relay].wait_free(until, poll_seconds)


class AccountSlot:
    """The slot of one relay's session in its account's limit."""

    def __init__(self, username: str, relay_name: str, sessions: int, hold_s: float,
                 local: Optional["LocalLimit"] = None):
        self.limit, self.sessions, self.relay = limit_name(username), sessions, relay_name
        self._kept = 0.0  # when this flow run last renewed the lease (time.monotonic())
        self.local = local or LocalLimit()
        self.record = record_name(username, relay_name)
        self.hold_s = min(MAX_LEASE_S, max(SERVER_LEASE_S, hold_s))
        self.queue = SlotQueue(username, relay_name)
        self._given_back: Optional[str] = None  # the lease this run gave back last: its record is left as it is
        self._mine: Optional[str] = None        # the lease this run took last, until it is settled or released

    def take(self, run_id: Optional[str] = None) -> bool:
        """Before the push of `run_id`: the relay's slot when it is the relay's turn (tasks/slot_queue.py), or the
        one it took for this same push before (a push Kaggle refused, retried), renewed. A recorded slot taken for
        an earlier session (its flow run died between that session's hand-over and the slot's release) is given
        back first: the relay joins the queue like any other. False when the account's sessions all run or
        another relay waited longer (the relay then holds its place); True also when there is no Prefect server
        to count on. Its turn and a free slot at its first look: no place written, the slot recorded at once."""
        try:
            with _client() as client:
                if client is None:
                    return self.local.take(self.limit, self.sessions, self.relay)
                held = read_record(client, self.record)
                if held is not None and not is_place(held):
                    if held.get("for") == run_id and self._renew(client, held):
                        return True
                    if held.get("for") != run_id:
                        self._give_back(client, held)
                # the record's slot, if any, is given back or ended: the place may be written over it
                if not self.queue.my_turn(client, join=False, over_slot=True):
                    return False
                found = ensure_limit(client, self.limit, self.sessions)
                # every slot runs: the read says so, not an increment SQLite may refuse (it reads, then writes)
                full = found is not None and found.active and found.active_slots >= found.limit
                lease = None if full else take_slot(client, self.limit, self.hold_s)
                if lease is None:
                    if self._slot_elsewhere(client):
                        return False  # another run of the relay took its slot meanwhile: its place is not written
                    self.queue.join(client)  # every slot runs: wait at its place, the later ready behind it
                    return False
                try:  # the place (or the last slot given back) becomes this slot: one write
                    write_record(client, self.record, {"lease_id": lease, "for": run_id})
                    self._mine = lease
                except Exception:  # a lease no record names could not be given back: give it back now
                    _release_lease(client, lease)
                    raise
                self.queue.taken()
                return True
        except Exception as err:  # noqa: BLE001 - no server, old server: Kaggle's refusal still guards the cap
            log.warning("account limit %s unavailable (%s); pushing, guarded by Kaggle's cap", self.limit,
                        str(err).splitlines()[0] if str(err) else type(err).__name__)
            return True

    def _slot_elsewhere(self, client) -> bool:
        """The relay's record holds a slot this run did not give back: another flow run of the relay took it after
        this take's first read (a place written now would hide that slot from every run: named by no record, it
        would hold a slot of the account for the session's whole length)."""
        held = read_record(client, self.record)
        return held is not None and not is_place(held) and held.get("lease_id") != self._given_back

    def settle(self, run_id: Optional[str], pushed: bool) -> None:
        """After the push's claim on Kaggle (relay/orchestrator/kaggle/lease.py: one orchestrator pushes each
        session) was won (`pushed`: pushed, or refused by Kaggle and kept for the retry) or lost: of the slots
        taken for one push, the recorded one stands for the session and any other goes back. Two flow runs of one
        relay (a watch beside a schedule) may each take one before their claims, and the record keeps the last
        written: a run that did not push gives its own back unless the record names it (it then counts the
        session the other run pushed); the run that pushed records its own unless the record names a slot of this
        push already (then its own goes back). After the claim only its winner writes the record; a take's write
        that lands later still (a take begun before the other run's push) is the one `close` mends."""
        lease, self._mine = self._mine, None
        if lease is None:
            return
        try:
            with _client() as client:
                if client is None:
                    return
                held = read_record(client, self.record)
                slot = held is not None and not is_place(held)
                if slot and held.get("lease_id") == lease:
                    self._mine = lease  # the recorded slot: renewed and given back with the session
                elif pushed and not (slot and held.get("for") == run_id):
                    write_record(client, self.record, {"lease_id": lease, "for": run_id})
                    self._mine = lease
                else:
                    _release_lease(client, lease)
        except Exception as err:  # noqa: BLE001 - a lease no record names ends on its own (hold_s)
            log.warning("account limit %s: settling a slot failed (%s)", self.limit, type(err).__name__)

    def close(self) -> None:
        """At the flow run's end (a tick ends after its push): the lease it took, unless the relay's record names
        it. The record is what the relay's next runs renew and give back; a lease it does not name (another run of
        the relay recorded its own after this run's settle) would hold a slot of the account for the session's
        whole length, and for ever on a server without the repossessor (an ephemeral one)."""
        if self._mine is None:
            return
        try:
            with _client() as client:
                if client is not None:
                    self._drop_unrecorded(client, read_record(client, self.record))
        except Exception as err:  # noqa: BLE001 - it ends on its own where the server repossesses leases
            log.warning("account limit %s: giving back a slot failed (%s)", self.limit, type(err).__name__)
        self._mine = None

    def _drop_unrecorded(self, client, record: Optional[dict]) -> None:
        """The lease this run took, given back unless `record` (the relay's, just read) names it."""
        if self._mine is not None and (record is None or record.get("lease_id") != self._mine):
            _release_lease(client, self._mine)
        self._mine = None

    def wait_free(self, until: float, poll_seconds: float) -> bool:
        """Wait, looking at the account's limit every `poll_seconds`, until one of its slots is free and it is
        this relay's turn (True) or `until` (time.monotonic()) has passed (False). Two reads a look, and a write
        every slot_queue.REFRESH_S to keep its place: a relay waiting hours for a slot adds no task run or log
        line per look. True also when there is no server or it cannot answer: the next step tries to take the
        slot and says why."""
        try:
            with _client() as client:  # one client for the whole wait (each new one builds its TLS context)
                while client is not None:
                    found = client.read_global_concurrency_limit_by_name(self.limit)
                    free = found.active_slots < found.limit
                    turn = self.queue.my_turn(client, join=not free)  # and keeps its place while it waits
                    if self.queue.place_gone or (turn and (free or self.queue.slot_elsewhere)):
                        break  # (another run of the relay pushed, or is done with its place: step)
                    if time.monotonic() + poll_seconds > until:
                        return False
                    time.sleep(poll_seconds)
        except Exception:  # noqa: BLE001 - the step that follows takes the slot or says what failed
            pass
        return True

    def keep(self) -> None:
        """While the relay's session is queued or running: its slot lasts another `hold_s`. Renewed at most every
        hold_s / 4 (the lease lasts the session's whole length): a running relay's round costs no write."""
        if time.monotonic() - self._kept < self.hold_s / 4:
            return
        try:
            with _client() as client:
                if client is None:
                    self.local.hold(self.limit, self.relay)
                elif self._renew(client):
                    self._kept = time.monotonic()
        except Exception as err:  # noqa: BLE001 - the lease still runs for the session's whole length
            log.warning("account limit %s: renewal failed (%s)", self.limit, type(err).__name__)

    def release(self, forget: bool = False) -> None:
        """Once no session of the relay runs (handed over, done): the slot is another relay's to take. Its record
        is left as it is (the relay's next place is written over it: a DELETE is the write SQLite refuses most),
        unless `forget`: the relay needs no more slots (done, stopped, failed), its record goes."""
        self._kept = 0.0
        try:
            with _client() as client:
                if client is None:
                    self.local.release(self.limit, self.relay)
                    return
                if self.queue.since is not None:
                    self.queue.leave(client)  # done or stopped while it waited: the others' turn
                record = read_record(client, self.record)
                self._drop_unrecorded(client, record)  # taken beside another run's, which the record kept
                if record is not None and not is_place(record):
                    self._give_back(client, record)
                if forget and record is not None:  # a place another run of the relay waits at goes too: its
                    delete_record(client, self.record)  # wait ends at its next look (SlotQueue.place_gone)
        except Exception as err:  # noqa: BLE001 - the lease ends on its own
            log.warning("account limit %s: release failed (%s)", self.limit, err)

    def _give_back(self, client, record: dict) -> None:
        """The recorded slot's lease back to the limit (a write SQLite never refuses: it writes first); once per
        lease in this run. The record stays: it names a lease that ended, which a renewal finds gone."""
        if record.get("lease_id") == self._given_back:
            return
        try:
            _release_lease(client, record["lease_id"])
        except Exception:  # noqa: BLE001 - a server error: its lease ends on its own (the repossessor)
            pass
        self._given_back = record.get("lease_id")

    def _renew(self, client, record: Optional[dict] = None) -> bool:
        """Renew the relay's recorded lease; False when there is none (or it ended: its record is left, the
        relay's next take writes over it)."""
        from uuid import UUID

        record = record if record is not None else read_record(client, self.record)
        if record is None or is_place(record) or record.get("lease_id") == self._given_back:
            return False
        try:
            soon(lambda: client.renew_concurrency_lease(UUID(record["lease_id"]), self.hold_s))
            return True
        except Exception as err:  # noqa: BLE001
            if not _not_found(err):  # a server error: the lease may still run; the record stays with it
                raise
            return False  # ended (the session outlived hold_s): a new one


def _release_lease(client, lease: str) -> None:
    """Give a lease back (a write SQLite never refuses); one that ended already is fine."""
    from uuid import UUID

    try:
        soon(lambda: client.release_concurrency_slots_with_lease(UUID(lease)))
    except Exception as err:  # noqa: BLE001
        if not _not_found(err):
            raise


def _not_found(err: Exception) -> bool:
    """The lease is gone: 410 from the server's renew (404 from older servers, or a server without leases)."""
    from prefect.exceptions import ObjectNotFound

    response = getattr(err, "response", None)
    return isinstance(err, ObjectNotFound) or getattr(response, "status_code", None) in (404, 405, 410)


class LocalLimit:
    """The account's slots counted by one flow run when no Prefect server counts them (no PREFECT_API_URL: the
    flow called from Python, a test): the same take / hold / release as the Prefect limit, so the cap is still
    counted one way. Kaggle's refusal guards the cap across flow runs."""

    def __init__(self):
        self._held: Dict[str, set] = {}
        self._guard = threading.Lock()

    def take(self, limit: str, sessions: int, relay: str) -> bool:
        with self._guard:
            held = self._held.setdefault(limit, set())
            if relay in held or len(held) < sessions:
                held.add(relay)
                return True
            return False

    def hold(self, limit: str, relay: str) -> None:
        """A session of the relay runs (pushed by another run, or before this one started): it counts."""
        with self._guard:
            self._held.setdefault(limit, set()).add(relay)

    def release(self, limit: str, relay: str) -> None:
        with self._guard:
            self._held.get(limit, set()).discard(relay)



class _client:
    """A sync Prefect client, or None when no Prefect server is set (an ephemeral one keeps leases in memory)."""

    def __enter__(self):
        from prefect.settings import PREFECT_API_URL

        self._client = None
        if PREFECT_API_URL.value():
            from prefect import get_client

            self._client = get_client(sync_client=True).__enter__()
        return self._client

    def __exit__(self, *exc) -> None:
        if self._client is not None:
            self._client.__exit__(*exc)
