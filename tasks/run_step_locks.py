"""The step locks of every relay of one `relays` flow run, held together by one lease (RunStepLocks), beside the
one-relay StepLock (tasks/step_lock.py) that the `relay` flow takes: each sees the other's records."""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from typing import Optional

from tasks.prefect_writes import soon
from tasks.step_lock import POLL_S, RUN_CHUNK, RUN_RECORD, SERVER_LEASE_S, delete_record, relay_key, write_record

log = logging.getLogger(__name__)


class RunStepLocks:
    """The step locks of every relay of one flow run (the `relays` flow), held together by one lease: records
    `relay-steps-<run>-<k>` naming the relays it holds and until when, renewed by one thread every lease_s / 3
    (one write per record, whatever the number of relays), deleted at `close`. A relay's step then costs no
    Prefect write per round (issue 60: a lease and a record per relay per round were 92 % of a round's time at 30
    relays, and 376 writes answered 503 "database is locked").

    Another flow run stepping one of these relays (a StepLock, or another RunStepLocks) sees the record and waits
    as for a StepLock; a killed holder's record is passed over once its `until` has passed. Taking a relay is a read
    (is it held by a live holder?), then the record written and read again: a holder that then sees another live
    holder of the relay gives it up and waits, so two never both go on holding it. Held for the whole run: a
    `relay run --tick` of one of its relays waits at most its step_lock_wait_s, then goes on guarded by the
    Kaggle claims (relay/orchestrator/kaggle/lease.py), as with a StepLock held by a long step."""

    def __init__(self, wait_s: float, lease_s: float = SERVER_LEASE_S, poll_s: float = POLL_S):
        self.wait_s, self.lease_s, self.poll_s = wait_s, lease_s, poll_s
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.prefix = f"{RUN_RECORD}{uuid.uuid4().hex[:12]}-"  # a variable's name: lowercase, digits, dashes
        self.held: dict = {}       # relay key -> name, what the records say this run holds
        self._chunks = 0           # records written
        self._guard = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def member(self, relay_name: str) -> "_RunMember":
        return _RunMember(self, relay_name)

    def hold(self, names: list) -> list:
        """Take every relay of `names` no live holder has, with one write (a record per RUN_CHUNK relays);
        returns those taken. The others are taken by their first step (`acquire`), which waits for them."""
        if self.wait_s <= 0 or not names:
            return []
        from prefect import get_client

        try:
            with get_client(sync_client=True) as client:
                busy = self._held_elsewhere(client)
                free = {relay_key(n): n for n in names if relay_key(n) not in busy}
                if not free:
                    return []
                with self._guard:
                    self.held.update(free)
                self._write(client)
                lost = set(free) & self._held_elsewhere(client)  # another took one at the same time: it is theirs
                if lost:
                    with self._guard:
                        for key in lost:
                            self.held.pop(key, None)
                    self._write(client)
            self._start()
            return [n for k, n in free.items() if k not in lost]
        except Exception as err:  # noqa: BLE001 - no server, old server: the Kaggle lease still guards
            log.warning("step locks of this run unavailable (%s); going on, guarded by the Kaggle lease",
                        str(err).splitlines()[0] if str(err) else type(err).__name__)
            self.wait_s = 0
            return []

    def acquire(self, name: str) -> bool:
        """The relay's lock, held until `close` (waiting at most wait_s for another holder); False: going on
        without it."""
        key = relay_key(name)
        if key in self.held:
            return True
        if self.wait_s <= 0:
            return False
        from prefect import get_client

        deadline, told = time.monotonic() + self.wait_s, False
        try:
            with get_client(sync_client=True) as client:
                while True:
                    if key not in self._held_elsewhere(client):
                        with self._guard:
                            self.held[key] = name
                        self._write(client)
                        if key not in self._held_elsewhere(client):
                            self._start()
                            return True
                        with self._guard:
                            self.held.pop(key, None)
                        self._write(client)
                    if time.monotonic() > deadline:
                        log.warning("step lock of %s: still held by another flow run after %.0f s; this run goes on"
                                    " without it, guarded by the Kaggle lease", name, self.wait_s)
                        return False
                    if not told:
                        log.info("step lock of %s: held by another flow run; waiting for it (at most %.0f s)", name,
                                 self.wait_s)
                        told = True
                    time.sleep(self.poll_s)
        except Exception as err:  # noqa: BLE001
            log.warning("step lock of %s unavailable (%s); going on, guarded by the Kaggle lease", name,
                        str(err).splitlines()[0] if str(err) else type(err).__name__)
            return False

    def close(self) -> None:
        """The run ends: its records go, its relays are free for any other flow run at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if not self._chunks:
            return
        try:
            from prefect import get_client

            with get_client(sync_client=True) as client:
                for k in range(self._chunks):
                    delete_record(client, f"{self.prefix}{k}")
        except Exception as err:  # noqa: BLE001 - the records lapse on their own
            log.warning("step locks of this run: release failed (%s)", err)
        self.held, self._chunks = {}, 0

    # -- the records -------------------------------------------------------------------------------------
    def _held_elsewhere(self, client) -> set:
        """The relay keys live holders other than this run hold: RunStepLocks records, and StepLock records
        (relay-step-lock-<name>) not lapsed. One read."""
        from prefect.client.schemas.objects import Variable

        response = soon(lambda: client.request("POST", "/variables/filter", json={
            "variables": {"name": {"like_": "relay-step"}}, "limit": 200}))
        now, keys = time.time(), set()
        for v in Variable.model_validate_list(response.json()):
            value = v.value if isinstance(v.value, dict) else {}
            if float(value.get("until", 0)) < now:
                continue
            if v.name.startswith(RUN_RECORD) and value.get("holder") != self.holder:
                keys.update(value.get("relays") or [])
            elif v.name.startswith("relay-step-lock-"):
                keys.add(relay_key(v.name[len("relay-step-lock-"):]))
        return keys

    def _write(self, client) -> None:
        with self._guard:
            keys = sorted(self.held)
        chunks = [keys[i:i + RUN_CHUNK] for i in range(0, len(keys), RUN_CHUNK)]
        until = time.time() + self.lease_s
        for k, chunk in enumerate(chunks):
            write_record(client, f"{self.prefix}{k}", {"holder": self.holder, "until": until,
                                                                    "relays": chunk})
        for k in range(len(chunks), self._chunks):
            delete_record(client, f"{self.prefix}{k}")
        self._chunks = len(chunks)

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._keep, name="run-step-locks", daemon=True)
            self._thread.start()

    def _keep(self) -> None:
        from prefect import get_client

        while not self._stop.wait(self.lease_s / 3):
            try:
                with get_client(sync_client=True) as client:
                    self._write(client)
            except Exception as err:  # noqa: BLE001 - the next renewal may get through; the lease outlasts two misses
                log.warning("step locks of this run: renewal failed (%s)", type(err).__name__)


class _RunMember:
    """One relay's step lock within its run's RunStepLocks: what RelayContext.lock needs. Released with the run,
    not between rounds (that was a write per relay per round)."""

    def __init__(self, locks: RunStepLocks, name: str):
        self.locks, self.name = locks, name

    def acquire(self) -> bool:
        return self.locks.acquire(self.name)

    def release(self) -> None:
        pass
