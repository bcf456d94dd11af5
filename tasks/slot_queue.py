"""First come, first served for a Kaggle account's session slots, across every flow run on one Prefect server.

Without it the account's limit (tasks/account_slots.py) was a race: a relay that had just handed over took the
slot again within a second while another, ready for hours, was still between its look at the limit and its take
(issue 60: one relay pushed five sessions back to back while another waited). Now a relay ready to push joins its
account's queue, a Prefect variable `kaggle-queue-<username>-<relay>` holding when it joined (`since`) and when its
flow run last said it still waits (`seen`), and takes a slot only when no live entry joined before it. A relay
leaves the queue when it takes its slot, so after a hand-over it joins again at the back.

A flow run killed while its relay waits leaves the entry: the relay's next flow run finds it and keeps its place
(`since`), and until then the others pass it once it has not been refreshed for `stale_s`, so a dead relay's place
is neither lost nor held for ever. One read of the queue per look; a write only on joining and every REFRESH_S.
"""
from __future__ import annotations

import os
import time
from typing import Dict, Optional

from tasks.prefect_writes import soon
from tasks.step_lock import delete_record, write_record

REFRESH_S = 20.0  # a waiting relay says it still waits this often (a write), and ...
STALE_S = 60.0    # ... the others pass an entry not refreshed for this long (its flow run is gone)
FORGET_S = 24 * 3600.0  # an entry nobody refreshed for a day is removed by whoever sees it


def stale_s() -> float:
    """STALE_S, or RELAY_SLOT_QUEUE_STALE_S (seconds) where a deployment restarts dead flow runs more slowly."""
    return float(os.environ.get("RELAY_SLOT_QUEUE_STALE_S") or STALE_S)


class SlotQueue:
    """One relay's place in its account's queue."""

    def __init__(self, username: str, relay: str):
        self.prefix, self.relay = f"kaggle-queue-{username}-", relay
        self.name = self.prefix + relay
        self.since: Optional[float] = None  # when this relay joined (kept from a dead flow run's entry)
        self._seen = 0.0

    def my_turn(self, client) -> bool:
        """Join or keep this relay's place; True when no live entry of the account joined before it."""
        now, stale = time.time(), stale_s()
        entries = self._entries(client)
        mine = entries.get(self.name)
        if self.since is None:
            self.since = float(mine["since"]) if mine else now
        if mine is None or now - self._seen >= REFRESH_S:
            write_record(client, self.name, {"since": self.since, "seen": now})
            self._seen = now
        for name, entry in entries.items():
            if name == self.name:
                continue
            idle = now - float(entry.get("seen", 0))
            if idle > FORGET_S:
                delete_record(client, name)
            elif idle < stale and (float(entry.get("since", now)), name) < (self.since, self.name):
                return False  # a live relay has waited longer
        return True

    def leave(self, client) -> None:
        """The relay took its slot (or needs nothing more): the next time it is ready it joins at the back."""
        if self.since is not None:
            delete_record(client, self.name)
        self.since, self._seen = None, 0.0

    def _entries(self, client) -> Dict[str, dict]:
        from prefect.client.schemas.objects import Variable

        response = soon(lambda: client.request("POST", "/variables/filter", json={
            "variables": {"name": {"like_": self.prefix}}, "limit": 200}))
        found = Variable.model_validate_list(response.json())
        return {v.name: v.value for v in found if v.name.startswith(self.prefix) and isinstance(v.value, dict)}
