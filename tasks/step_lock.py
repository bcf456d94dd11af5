"""One relay's steps, one at a time, on one Prefect server, whatever started them (two deployments, a
schedule and a person, a retried run): a global concurrency limit `relay-<name>` of 1, keyed by the relay,
not by the deployment. Prefect holds the slot as a lease that it renews while the holder lives and takes
back once it lapses (at least 60 s after a killed holder's last renewal, plus its repossessor's loop).

The lock is an optimisation, not the guarantee: waiting is bounded (`wait_s`), and after it, or when the
server cannot be reached, the step goes on guarded by the claim on Kaggle (relay/orchestrator/kaggle/lease.py), which
is what also covers orchestrators that share no Prefect server.
"""
from __future__ import annotations

import logging
from typing import Optional

log = logging.getLogger(__name__)
LEASE_S = 60  # the shortest lease Prefect's server accepts: a killed holder blocks the others the least


class StepLock:
    def __init__(self, relay_name: str, wait_s: float):
        self.limit, self.wait_s = f"relay-{relay_name}", wait_s
        self._held = None
        self._ready = False

    def acquire(self) -> bool:
        """Take the slot (waiting at most wait_s); False when going on without it."""
        if self._held is not None:
            return True
        if self.wait_s <= 0:
            return False
        from prefect.concurrency.sync import concurrency

        try:
            self._ensure_limit()
            held = concurrency(self.limit, occupy=1, timeout_seconds=self.wait_s, lease_duration=LEASE_S,
                               strict=True, raise_on_lease_renewal_failure=False)
            held.__enter__()
        except TimeoutError:
            # its holder is busy for long or was killed (its slot lapses only after Prefect's lease): waiting
            # again at every step would only slow this run; the Kaggle claims guard every act anyway
            log.warning("step lock %s: still held by another flow run after %.0f s; this run goes on without"
                        " it, guarded by the Kaggle lease", self.limit, self.wait_s)
            self.wait_s = 0
            return False
        except Exception as err:  # noqa: BLE001 - no server, old server: the Kaggle lease still guards
            log.warning("step lock %s unavailable (%s); going on, guarded by the Kaggle lease", self.limit,
                        str(err).splitlines()[0] if str(err) else type(err).__name__)
            return False
        self._held = held
        return True

    def release(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            try:
                held.__exit__(None, None, None)
            except Exception as err:  # noqa: BLE001 - the lease lapses on its own
                log.warning("step lock %s: release failed (%s)", self.limit, err)

    def _ensure_limit(self) -> None:
        """Create the limit (1 slot) on first use; a limit someone created by hand is left as it is."""
        if self._ready:
            return
        from prefect import get_client
        from prefect.exceptions import ObjectNotFound

        with get_client(sync_client=True) as client:
            try:
                found: Optional[object] = client.read_global_concurrency_limit_by_name(self.limit)
            except ObjectNotFound:
                found = None
            if found is None:
                try:
                    client.upsert_global_concurrency_limit_by_name(self.limit, 1)
                except Exception:  # noqa: BLE001 - created by another run at the same time
                    client.read_global_concurrency_limit_by_name(self.limit)
        self._ready = True
