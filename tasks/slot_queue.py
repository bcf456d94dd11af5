"""First come, first served for a Kaggle account's session slots, across every flow run on one Prefect server.

Without it the account's limit (tasks/account_slots.py) was a race: a relay that had just handed over took the
slot again within a second while another, ready for hours, was still between its look at the limit and its take
(issue 60: one relay pushed five sessions back to back while another waited). Now a relay ready to push that cannot
push at once takes a place in its account's queue and takes a slot only when no live place joined before its own.

A relay has ONE record on the server, the Prefect variable `kaggle-slot-<username>-<relay>`, for its place and its
slot in turn: a place {since: when it joined, seen: when its flow run last said it still waits}, turned into the
slot {lease_id, for} by the take (one write: the place is never deleted), kept as it is when the slot is given back
(tasks/account_slots.py). On a SQLite server a variable's PATCH and DELETE read before they write, in a transaction
Prefect begins DEFERRED, and SQLite refuses such a write at once when another write committed in between (503
"database is locked"; docs/prefect.md, "SQLite under load"); creating one (an INSERT) waits its turn instead. So a
relay-session costs at most two variable writes that can be refused (its place, its take) and none when the relay
takes its slot at its first look; it used to cost a place, a slot record and two DELETEs. A relay that needs no more
slots (done, stopped, failed) deletes its record once.

A flow run killed while its relay waits leaves the place: the relay's next flow run finds it and keeps it (`since`),
and until then the others pass it once it has not been refreshed for `stale_s`, so a dead relay's place is neither
lost nor held for ever. One read of the account's records per look (per 200 of them); a write on joining and every REFRESH_S.
"""
from __future__ import annotations

import os
import time
from typing import Dict, Optional

from tasks.prefect_writes import soon
from tasks.step_lock import delete_record, read_record, write_record

REFRESH_S = 20.0  # a waiting relay says it still waits this often (a write), and ...
STALE_S = 60.0    # ... the others pass a place not refreshed for this long (its flow run is gone)
FORGET_S = 24 * 3600.0  # a place nobody refreshed for a day is removed by whoever sees it
PAGE = 200  # records a read returns at most (PREFECT_SERVER_API_DEFAULT_LIMIT, the server's cap on `limit`)


def stale_s() -> float:
    """STALE_S, or RELAY_SLOT_QUEUE_STALE_S (seconds) where a deployment restarts dead flow runs more slowly."""
    return float(os.environ.get("RELAY_SLOT_QUEUE_STALE_S") or STALE_S)


def record_name(username: str, relay: str) -> str:
    """The one record of a relay's place and slot."""
    return f"kaggle-slot-{username}-{relay}"


def is_place(value: Optional[dict]) -> bool:
    """A record that is a place in the queue (not a slot)."""
    return isinstance(value, dict) and "since" in value


class SlotQueue:
    """One relay's place in its account's queue."""

    def __init__(self, username: str, relay: str):
        self.prefix, self.relay = record_name(username, ""), relay
        self.name = record_name(username, relay)
        self.since: Optional[float] = None  # when this relay joined (kept from a dead flow run's place)
        self._seen = 0.0                    # when this run last wrote its place (0: not written)
        self.slot_elsewhere = False         # the last look found the relay's record holding a slot it left as is
        self.place_gone = False             # ... or found the place this run wrote gone: another run of the relay
                                            # took it and is done with it (finished, stopped)

    def my_turn(self, client, join: bool = True, over_slot: bool = False) -> bool:
        """True when no live place of the account joined before this relay's. Its place is written (joined, or
        refreshed every REFRESH_S) when `join` or when it is not its turn: `join=False` is the take's look, which
        takes the slot at once when it can and joins only when it cannot (`join`). The relay's record holding a
        slot is left as it is (another flow run of the relay took it) unless `over_slot`: the caller gave that
        slot back, or knows it ended."""
        now, stale = time.time(), stale_s()
        records = self._records(client)
        mine = records.get(self.name)
        self.slot_elsewhere = mine is not None and not is_place(mine) and not over_slot
        self.place_gone = mine is None and self._seen > 0
        if self.slot_elsewhere:
            return True  # its slot is taken (by another run of the relay): its next step sees the session
        if self.since is None:
            self.since = float(mine["since"]) if is_place(mine) else now
        turn = True
        for name, entry in records.items():
            if name == self.name or not is_place(entry):
                continue
            idle = now - float(entry.get("seen", 0))
            if idle > FORGET_S:
                delete_record(client, name)
            elif idle < stale and (float(entry.get("since", now)), name) < (self.since, self.name):
                turn = False  # a live relay has waited longer
        if join or not turn:
            self._keep_place(client, mine if is_place(mine) else None, now)
        return turn

    def join(self, client) -> None:
        """Write this relay's place now (its take found every slot taken): the relays ready after it queue behind."""
        self._keep_place(client, None, time.time())

    def taken(self) -> None:
        """The relay's take turned its place into its slot: the next time it is ready it joins at the back."""
        self.since, self._seen = None, 0.0

    def leave(self, client) -> None:
        """The relay needs no slot now (done, stopped, failed while it waited): its place goes, its slot stays."""
        if self.since is not None and is_place(read_record(client, self.name)):
            delete_record(client, self.name)
        self.taken()

    def _keep_place(self, client, place: Optional[dict], now: float) -> None:
        if place is None or float(place.get("since", -1)) != self.since or now - self._seen >= REFRESH_S:
            write_record(client, self.name, {"since": self.since, "seen": now})
            self._seen = now

    def _records(self, client) -> Dict[str, dict]:
        """The account's records, places and slots: one read per PAGE of them (the server's largest page)."""
        from prefect.client.schemas.objects import Variable

        records: Dict[str, dict] = {}
        for offset in range(0, 100 * PAGE, PAGE):
            response = soon(lambda: client.request("POST", "/variables/filter", json={
                "variables": {"name": {"like_": self.prefix}}, "sort": "NAME_ASC", "limit": PAGE,
                "offset": offset}))
            found = Variable.model_validate_list(response.json())
            records.update((v.name, v.value) for v in found
                           if v.name.startswith(self.prefix) and isinstance(v.value, dict))
            if len(found) < PAGE:
                break
        return records
