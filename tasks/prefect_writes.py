"""Writes to Prefect's server that do not wait seconds on a busy SQLite.

A Prefect server on SQLite (`prefect server start`'s default, the one `relay run` starts for itself, the tests')
answers 503 when two writes meet ("database is locked": an account slot's increment beside the events the server
is storing). Prefect's client then waits 2 s, 4 s, ... before trying again; on the emulator that was seconds on
each push and each hand-over. `soon` tries such a write again within milliseconds first.
"""
from __future__ import annotations

import time

REFUSED = [0]  # the 503 answers these writes got in this process: counted, not only retried (issue 60; the relays bench)
QUICK_RETRIES_S = (0.01, 0.03, 0.1, 0.3)  # the pauses before each quick retry of a write the server refused (503)


def soon(call):
    """`call()`, one write to Prefect's server, tried again within milliseconds while the server answers 503;
    after the quick tries, or on any other failure, with the client's own retries."""
    import httpx

    for pause in QUICK_RETRIES_S:
        try:
            with _without_client_retries():
                return call()
        except httpx.HTTPStatusError as err:
            code = err.response.status_code
            REFUSED[0] += code == 503
            if code != 503:
                if code < 500 and code != 429:  # an answer, not a refusal to answer: the caller's to read
                    raise
                break
        except httpx.TransportError:
            break
        time.sleep(pause)
    return call()


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
