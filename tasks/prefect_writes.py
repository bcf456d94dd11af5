"""Writes to Prefect's server that do not wait seconds on a busy SQLite, one at a time per process.

A Prefect server on SQLite (`prefect server start`'s default, the one `relay run` starts for itself, the tests')
answers 503 "database is locked" when a write's transaction read before it wrote (increment-with-lease, PATCH
and DELETE of a variable: Prefect begins them DEFERRED) and another write held the database or committed in
between: SQLite refuses the stale reader at once (SQLITE_BUSY, SQLITE_BUSY_SNAPSHOT), without its busy timeout.
The relay's quick tries go one at a time per process (`_ONE_WRITER`: a round's 8 threads never refuse each other;
the relays bench counted 28 refusals with it against 27 without at 20 relays, so it is a guard, not a cut), a
record is not written again with the value it has, and every refusal is counted by kind (REFUSED_BY). What
they still meet is the server's own writing (its event persister and task-run recorder storing the flow's task
runs and events; the relays bench, docs/benchmarks.md), so `soon` tries a refused write again within
milliseconds (Prefect's client waits 2 s, 4 s, ...).
"""
from __future__ import annotations

import re
import threading
import time
from collections import Counter

REFUSED = [0]  # the 503 answers these writes got in this process: counted, not only retried (issue 60; the relays bench)
REFUSED_BY: Counter = Counter()  # the same by kind of write ("PATCH /variables/name/*"): what to cut next
QUICK_RETRIES_S = (0.01, 0.03, 0.1, 0.3)  # the pauses before each quick retry of a write the server refused (503)
_ONE_WRITER = threading.RLock()  # this process's writes to Prefect, one at a time: they cannot refuse each other


def soon(call):
    """`call()`, one write to Prefect's server (no other quick try of this process in flight meanwhile), tried again
    within milliseconds while the server answers 503; after the quick tries, or on any other failure, with the
    client's own retries, outside the one-writer lock (their 2 s, 4 s waits must not hold the other threads)."""
    import httpx

    with _ONE_WRITER:
        for pause in QUICK_RETRIES_S:
            try:
                with _without_client_retries():
                    return call()
            except httpx.HTTPStatusError as err:
                code = err.response.status_code
                if code == 503:
                    REFUSED[0] += 1
                    REFUSED_BY[kind(err.request)] += 1
                if code != 503:
                    if code < 500 and code != 429:  # an answer, not a refusal to answer: the caller's to read
                        raise
                    break
            except httpx.TransportError:
                break
            time.sleep(pause)
    return call()


def kind(request) -> str:
    """A write's kind: its method and route, names and ids left out ("DELETE /variables/name/*")."""
    path = re.sub(r"^.*?/api(?=/)", "", request.url.path)
    path = re.sub(r"/(name|leases)/[^/]+", r"/\1/*", path)
    return f"{request.method} {re.sub(r'/[0-9a-f]{8}-[0-9a-f-]{27}', '/*', path)}"


_NO_RETRIES: list = [None, None]  # the settings last in force, and their copy with the client's retries off


def _without_client_retries():
    """What `temporary_settings({PREFECT_CLIENT_MAX_RETRIES: 0})` enters, with the copy of the settings made once
    per settings in force: making it validates every setting again (~27 ms a write)."""
    import prefect.context
    from prefect.settings import PREFECT_CLIENT_MAX_RETRIES

    context = prefect.context.get_settings_context()
    if _NO_RETRIES[0] is not context.settings:
        _NO_RETRIES[:] = [context.settings,
                          context.settings.copy_with_update(updates={PREFECT_CLIENT_MAX_RETRIES: 0})]
    return prefect.context.SettingsContext(profile=context.profile, settings=_NO_RETRIES[1])
