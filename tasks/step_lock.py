"""One relay's steps, one at a time, on one Prefect server, whatever started them (two deployments, a
schedule and a person, a retried run): a global concurrency limit `relay-<name>` of 1, keyed by the relay,
not by the deployment.

The slot is held as a Prefect lease (`lease_s`), renewed by a thread while its holder lives. A holder killed
while holding it (a laptop closed, a CI job cancelled, a SIGKILL) must not cost the next run more than about
the lease. Prefect's server gives a lapsed lease back only through its repossessor service, which an
ephemeral server (the one `relay run` starts for itself, and the test harness) does not run; and an ephemeral
server keeps leases in its own memory, so one that died with its holder cannot be given back by anyone's
server. So the holder also writes a record beside the limit (the Prefect variable `relay-step-lock-<name>`:
who holds it, its lease, until when, and whether the lease lives in a server of its own), renewed with the
lease. A waiter that finds the record lapsed takes the slot back itself: by the lease where the server is
shared (a no-op when the server already repossessed it), by a plain release where the lease died with its
holder's own server. The waiter says what it waits for, and logs no error.

The lock is an optimisation, not the guarantee: waiting is bounded (`wait_s`), and after it, when the server
cannot be reached, or in the rare race where two waiters take back one lapsed slot, the step goes on guarded
by the claim on Kaggle (relay/orchestrator/kaggle/lease.py), which also covers orchestrators that share no
Prefect server.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from typing import Optional

from tasks.prefect_writes import soon

log = logging.getLogger(__name__)
SERVER_LEASE_S = 60.0  # the shortest lease Prefect's server accepts
POLL_S = 2.0           # how often a waiter asks for the slot again


class StepLock:
    """`lease_s`: how long after its holder's last renewal (every lease_s / 3) a waiter takes a slot back."""

    def __init__(self, relay_name: str, wait_s: float, lease_s: float = SERVER_LEASE_S, poll_s: float = POLL_S):
        self.limit, self.wait_s, self.lease_s, self.poll_s = f"relay-{relay_name}", wait_s, lease_s, poll_s
        self.record_name = f"relay-step-lock-{relay_name}"
        self._held: Optional[_Holding] = None
        self._ready = False

    def acquire(self) -> bool:
        """Take the slot (waiting at most wait_s); False when going on without it."""
        if self._held is not None:
            return True
        if self.wait_s <= 0:
            return False
        from prefect import get_client

        deadline, told = time.monotonic() + self.wait_s, False
        try:
            with get_client(sync_client=True) as client:
                self._ensure_limit(client)
                while True:
                    lease_id = self._take(client)
                    if lease_id is not None:
                        self._held = _Holding(self, lease_id)
                        if not run_holds(client, self.limit[len("relay-"):]):
                            return True
                        self.release()  # a `relays` flow run holds the relay (RunStepLocks): its turn
                        record = {"holder": "a relays flow run", "until": time.time() + self.lease_s}
                    else:
                        record = read_record(client, self.record_name)
                    if record is not None and record.get("until", 0) < time.time():
                        self._take_back(client, record)
                        continue
                    if time.monotonic() > deadline:
                        # its holder is busy for long: waiting again at every step would only slow this run;
                        # the Kaggle claims guard every act anyway
                        log.warning("step lock %s: still held by %s after %.0f s; this run goes on without it,"
                                    " guarded by the Kaggle lease", self.limit, _who(record), self.wait_s)
                        self.wait_s = 0
                        return False
                    if not told:
                        log.info("step lock %s: held by %s; waiting for it (at most %.0f s; a killed holder's"
                                 " slot is taken back %.0f s after its last renewal)", self.limit, _who(record),
                                 self.wait_s, self.lease_s)
                        told = True
                    time.sleep(self.poll_s)
        except Exception as err:  # noqa: BLE001 - no server, old server: the Kaggle lease still guards
            log.warning("step lock %s unavailable (%s); going on, guarded by the Kaggle lease", self.limit,
                        str(err).splitlines()[0] if str(err) else type(err).__name__)
            return False

    def release(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            held.end()

    # -- the steps ---------------------------------------------------------------------------------------
    def _take(self, client) -> Optional[str]:
        return take_slot(client, self.limit, self.lease_s)

    def _take_back(self, client, record: dict) -> None:
        """Give back the slot of a holder that stopped renewing it (killed): by its lease on a shared server
        (a no-op when the server repossessed it already), by a plain release when its lease was in a server of
        its own, gone with it."""
        from uuid import UUID

        log.warning("step lock %s: %s stopped renewing it %.0f s ago (killed?); taking its slot back", self.limit,
                    _who(record), time.time() - record["until"] + self.lease_s)
        delete_record(client, self.record_name)
        if record.get("own_server"):
            soon(lambda: client.release_concurrency_slots(
                names=[self.limit], slots=1, occupancy_seconds=max(0.0, time.time() - record.get("since", 0))))
        else:
            soon(lambda: client.release_concurrency_slots_with_lease(UUID(record["lease_id"])))

    def _ensure_limit(self, client) -> None:
        if not self._ready:
            ensure_limit(client, self.limit, 1)
            self._ready = True


def take_slot(client, limit: str, lease_s: float) -> Optional[str]:
    """One request for a slot of `limit`: its lease id, or None while all its slots are held (HTTP 423) or it has
    none (422 "Slots requested is greater than the limit": a limit someone set to 0 pauses it; it used to read as
    an unreachable server, and the relay pushed)."""
    import httpx

    try:
        response = soon(lambda: client.increment_concurrency_slots_with_lease(
            names=[limit], slots=1, mode="concurrency", lease_duration=max(SERVER_LEASE_S, lease_s)))
    except httpx.HTTPStatusError as err:
        if err.response.status_code == 423 or (err.response.status_code == 422
                                               and "greater than the limit" in err.response.text):
            return None
        raise
    return str(response.json()["lease_id"])


def ensure_limit(client, limit: str, slots: int) -> Optional[object]:
    """Create the global concurrency limit with `slots` on first use; one someone created by hand is left as it is.
    Returns the limit as read (its active slots), None when created now."""
    from prefect.exceptions import ObjectNotFound

    try:
        found: Optional[object] = client.read_global_concurrency_limit_by_name(limit)
    except ObjectNotFound:
        found = None
    if found is None:
        try:
            client.upsert_global_concurrency_limit_by_name(limit, slots)
        except Exception:  # noqa: BLE001 - created by another run at the same time
            client.read_global_concurrency_limit_by_name(limit)
    return found


class _Holding:
    """A held slot: its record written, and a thread renewing the lease and the record until `end`."""

    def __init__(self, lock: StepLock, lease_id: str):
        from prefect.settings import PREFECT_API_URL

        self.lock, self.lease_id, self.stop = lock, lease_id, threading.Event()
        self.record = {"holder": f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}",
                       "lease_id": lease_id, "since": time.time(),
                       "own_server": not PREFECT_API_URL.value()}  # an ephemeral server of this process
        self._renew()
        self.thread = threading.Thread(target=self._keep, name=f"step-lock-{lock.limit}", daemon=True)
        self.thread.start()

    def _renew(self) -> None:
        from uuid import UUID

        from prefect import get_client

        with get_client(sync_client=True) as client:
            soon(lambda: client.renew_concurrency_lease(UUID(self.lease_id), max(SERVER_LEASE_S, self.lock.lease_s)))
            self.record["until"] = time.time() + self.lock.lease_s
            write_record(client, self.lock.record_name, self.record)

    def _keep(self) -> None:
        while not self.stop.wait(self.lock.lease_s / 3):
            try:
                self._renew()
            except Exception as err:  # noqa: BLE001 - the next renewal may get through; the lease outlasts two misses
                log.warning("step lock %s: renewal failed (%s)", self.lock.limit, type(err).__name__)

    def end(self) -> None:
        from uuid import UUID

        from prefect import get_client

        self.stop.set()
        self.thread.join()
        try:
            with get_client(sync_client=True) as client:
                delete_record(client, self.lock.record_name)
                soon(lambda: client.release_concurrency_slots_with_lease(UUID(self.lease_id)))
        except Exception as err:  # noqa: BLE001 - the lease lapses on its own
            log.warning("step lock %s: release failed (%s)", self.lock.limit, err)


def _who(record: Optional[dict]) -> str:
    return f"holder {record['holder']}" if record else "another flow run"


def read_record(client, name: str) -> Optional[dict]:
    variable = client.read_variable_by_name(name)
    return variable.value if variable is not None and isinstance(variable.value, dict) else None


def write_record(client, name: str, value: dict) -> None:
    from prefect.client.schemas.actions import VariableCreate, VariableUpdate
    from prefect.exceptions import ObjectAlreadyExists

    found = client.read_variable_by_name(name)
    if found is not None:
        if found.value != value:  # the same value again: no write (each is a transaction that can be refused)
            soon(lambda: client.update_variable(VariableUpdate(name=name, value=value)))
        return
    try:
        soon(lambda: client.create_variable(VariableCreate(name=name, value=value)))
    except ObjectAlreadyExists:  # a lapsed holder's record appeared meanwhile: ours wins, we hold the slot
        soon(lambda: client.update_variable(VariableUpdate(name=name, value=value)))


def delete_record(client, name: str) -> None:
    from prefect.exceptions import ObjectNotFound

    try:
        soon(lambda: client.delete_variable_by_name(name))
    except ObjectNotFound:
        pass


RUN_RECORD = "relay-steps-"  # a RunStepLocks record: "relay-steps-<run>-<chunk>"
RUN_CHUNK = 300              # relays a record names (a Prefect variable holds at most 5,000 characters)


def relay_key(name: str) -> str:
    """A relay as a RunStepLocks record names it: short and fixed in length, whatever the relay's name."""
    import hashlib

    return hashlib.sha256(name.encode()).hexdigest()[:10]


def run_holds(client, relay_name: str) -> bool:
    """Whether a live RunStepLocks record (a `relays` flow run) holds the relay. One read."""
    from prefect.client.schemas.objects import Variable

    response = soon(lambda: client.request("POST", "/variables/filter", json={
        "variables": {"name": {"like_": RUN_RECORD}}, "limit": 200}))
    key, now = relay_key(relay_name), time.time()
    return any(isinstance(v.value, dict) and float(v.value.get("until", 0)) >= now and key in (v.value.get("relays") or [])
               for v in Variable.model_validate_list(response.json()) if v.name.startswith(RUN_RECORD))
