"""`tasks.prefect_writes.soon`: a write the Prefect server refused with 503 (SQLite's "database is locked") is
tried again within milliseconds, with the client's own retries (2 s, 4 s, ...) off meanwhile; an answer (409,
423: the caller reads it) is raised at once; after the quick tries the client's own retries take over. Measured
with a real server in the relay tests: tests/orchestrator/test_relay_code_fix.py and neighbours ran 101 s before, 81 s after."""
from __future__ import annotations

import httpx
import pytest

from tasks import prefect_writes
from tasks.prefect_writes import soon


def _refusal(code: int) -> httpx.HTTPStatusError:
    request = httpx.Request("POST", "http://prefect/api/v2/concurrency_limits/increment-with-lease")
    return httpx.HTTPStatusError(f"{code}", request=request, response=httpx.Response(code, request=request))


class Server:
    def __init__(self, *answers):
        self.answers, self.retries_seen = list(answers), []

    def __call__(self):
        from prefect.settings import PREFECT_CLIENT_MAX_RETRIES

        self.retries_seen.append(PREFECT_CLIENT_MAX_RETRIES.value())
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_a_busy_server_is_asked_again_at_once_without_the_clients_backoff(monkeypatch):
    pauses = []
    monkeypatch.setattr(prefect_writes.time, "sleep", pauses.append)
    server = Server(_refusal(503), _refusal(503), "lease-1")
    assert soon(server) == "lease-1"
    assert server.retries_seen == [0, 0, 0]
    assert pauses == list(prefect_writes.QUICK_RETRIES_S[:2]) and sum(pauses) < 0.1


def test_an_answer_is_the_callers_and_other_failures_get_the_clients_retries(monkeypatch):
    from prefect.settings import PREFECT_CLIENT_MAX_RETRIES

    monkeypatch.setattr(prefect_writes.time, "sleep", lambda s: None)
    with pytest.raises(httpx.HTTPStatusError, match="423"):  # all slots held: take_slot reads it
        soon(Server(_refusal(423)))
    default = PREFECT_CLIENT_MAX_RETRIES.value()
    for first in (_refusal(502), httpx.ConnectError("refused")):
        server = Server(first, "done")
        assert soon(server) == "done"
        assert server.retries_seen == [0, default]
    busy = Server(*[_refusal(503)] * len(prefect_writes.QUICK_RETRIES_S), "done")
    assert soon(busy) == "done"
    assert busy.retries_seen == [0] * len(prefect_writes.QUICK_RETRIES_S) + [default]


def test_each_refusal_is_counted_by_its_kind_of_write(monkeypatch):
    """The relays bench reports which writes SQLite refused (issue 60): by method and route, names and ids out."""
    monkeypatch.setattr(prefect_writes.time, "sleep", lambda s: None)
    before = dict(prefect_writes.REFUSED_BY)
    lease = httpx.Request("POST", "http://h/api/v2/concurrency_limits/increment-with-lease")
    delete = httpx.Request("DELETE", "http://h/api/variables/name/kaggle-queue-ann-team-0")
    renew = httpx.Request("POST", "http://h/api/v2/concurrency_limits/leases/0b5e8a7c-1d2e-4f60-9a1b-2c3d4e5f6a7b/renew")
    refusals = [httpx.HTTPStatusError("503", request=r, response=httpx.Response(503, request=r))
                for r in (lease, delete, delete, renew)]
    assert soon(Server(*refusals[:1], "a")) == "a" and soon(Server(*refusals[1:], "b")) == "b"
    counted = {k: v - before.get(k, 0) for k, v in prefect_writes.REFUSED_BY.items() if v != before.get(k, 0)}
    assert counted == {"POST /v2/concurrency_limits/increment-with-lease": 1, "DELETE /variables/name/*": 2,
                       "POST /v2/concurrency_limits/leases/*/renew": 1}
