"""A Kaggle account's concurrent GPU sessions as a Prefect global concurrency limit, `kaggle-account-<username>`,
created with the spec's `kaggle.account_sessions` slots (Kaggle's cap: 2).

A `relay` flow run watching its relay takes one slot before it pushes a session and holds it (a Prefect lease,
renewed by a thread) until the session has ended, so relays of one account on one Prefect server, on any of its
workers, never push a session Kaggle would refuse: they wait for a slot. A run that finds its relay's session
already running (it took over from a killed worker) takes a slot too when one is free.

A holder that is killed stops renewing; the server's repossessor service gives its slot back within about a
minute (the shortest lease the server accepts, plus the service's loop). Until then the account counts one
session too many, which only delays a push. The limit is an optimisation: Kaggle's own refusal (the relay waits
and tries again) and the claims on Kaggle (relay/orchestrator/kaggle/lease.py) stay the guarantee. Slots are
taken only on a Prefect server (PREFECT_API_URL set): an ephemeral server keeps leases in its memory, so a slot
taken there would outlive a killed holder.
"""
from __future__ import annotations

import logging
import threading
from typing import Optional

from tasks.step_lock import SERVER_LEASE_S, ensure_limit, take_slot

log = logging.getLogger(__name__)


def limit_name(username: str) -> str:
    return f"kaggle-account-{username}"


class AccountSlot:
    """This flow run's slot (at most one) of its account's limit."""

    def __init__(self, username: str, sessions: int, lease_s: float = SERVER_LEASE_S):
        self.limit, self.sessions, self.lease_s = limit_name(username), sessions, lease_s
        self._lease: Optional[str] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._ready = False

    @property
    def held(self) -> bool:
        return self._lease is not None

    def take(self) -> bool:
        """A slot, without waiting: True when held (or when there is no Prefect server to count on), False when
        the account's sessions all run."""
        from prefect.settings import PREFECT_API_URL

        if self._lease is not None or not PREFECT_API_URL.value():
            return True
        from prefect import get_client

        try:
            with get_client(sync_client=True) as client:
                if not self._ready:
                    ensure_limit(client, self.limit, self.sessions)
                    self._ready = True
                lease = take_slot(client, self.limit, self.lease_s)
        except Exception as err:  # noqa: BLE001 - no server, old server: Kaggle's refusal still guards the cap
            log.warning("account limit %s unavailable (%s); pushing, guarded by Kaggle's cap", self.limit,
                        str(err).splitlines()[0] if str(err) else type(err).__name__)
            return True
        if lease is None:
            return False
        self._lease, self._stop = lease, threading.Event()
        self._thread = threading.Thread(target=self._keep, name=f"account-slot-{self.limit}", daemon=True)
        self._thread.start()
        return True

    def release(self) -> None:
        lease, self._lease = self._lease, None
        if lease is None:
            return
        from uuid import UUID

        from prefect import get_client

        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            with get_client(sync_client=True) as client:
                client.release_concurrency_slots_with_lease(UUID(lease))
        except Exception as err:  # noqa: BLE001 - the lease lapses on its own
            log.warning("account limit %s: release failed (%s)", self.limit, err)

    def _keep(self) -> None:
        from uuid import UUID

        from prefect import get_client

        lease = self._lease
        while lease is not None and not self._stop.wait(self.lease_s / 3):
            try:
                with get_client(sync_client=True) as client:
                    client.renew_concurrency_lease(UUID(lease), max(SERVER_LEASE_S, self.lease_s))
            except Exception as err:  # noqa: BLE001 - the next renewal may get through; the lease outlasts two misses
                log.warning("account limit %s: renewal failed (%s)", self.limit, type(err).__name__)
