"""Bounded retries with exponential backoff and jitter for every Kaggle call, and the bound on each request.

The `kaggle` client retries only uploads and dataset creation, so push, status and output would fail on the
first 429 or 5xx; this wraps every call. Retry-After is honoured (as a floor, capped by `max_delay_s`).

Every request has a connect and a read timeout (`kagglesdk` sends without one, so a request Kaggle never
answers would block forever; client.py applies them), and a call that keeps failing gives up `give_up_s` after
its first failure: the caller then gets one line naming the call (`KaggleUnresponsive`). Answers that are not
JSON (the HTML error pages of Kaggle's front end) are judged by their status code: 429 and 5xx are retried, any
other error is one line (`KaggleHTTPError`). Both bounds come from the environment, so a test or a CI job can shorten them:
RELAY_KAGGLE_TIMEOUT_S (a request's read timeout, default 60; connect: at most 10) and RELAY_KAGGLE_GIVE_UP_S
(default 120). A call Kaggle never answers thus ends within 60 + 120 + 60 s = 4 min.
"""
from __future__ import annotations

import logging
import math
import os
import random
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Callable, Optional, Tuple, TypeVar

from relay.orchestrator.kaggle.types import KaggleHTTPError, KaggleUnresponsive, RetriesExhausted
from relay.shared.errors import InputError

T = TypeVar("T")
log = logging.getLogger(__name__)

_RETRY_STATUS = {408, 429, 500, 502, 503, 504}
TIMEOUT_ENV, GIVE_UP_ENV = "RELAY_KAGGLE_TIMEOUT_S", "RELAY_KAGGLE_GIVE_UP_S"
CONNECT_TIMEOUT_S = 10.0


def _seconds_from_env(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise InputError(f"{name}={raw!r}: expected a number of seconds > 0")
    return value


def read_timeout_s() -> float:
    """How long one request may wait for Kaggle's next bytes (RELAY_KAGGLE_TIMEOUT_S, default 60 s)."""
    return _seconds_from_env(TIMEOUT_ENV, 60.0)


def request_timeout() -> Tuple[float, float]:
    """(connect, read) timeouts of one request. The read timeout bounds each wait for the next bytes, so a
    transfer goes on as long as bytes keep arriving."""
    read = read_timeout_s()
    return min(CONNECT_TIMEOUT_S, read), read


@dataclass
class RetryPolicy:
    attempts: int = 8
    base_delay_s: float = 1.0
    multiplier: float = 2.0
    max_delay_s: float = 60.0
    jitter: float = 0.5           # +-50 % of the delay, so parallel clients do not retry in lockstep
    sleep: Callable[[float], None] = time.sleep
    rng: random.Random = field(default_factory=random.Random)
    # how long a call goes on failing (from its first failure) before it gives up (RELAY_KAGGLE_GIVE_UP_S)
    give_up_s: float = field(default_factory=lambda: _seconds_from_env(GIVE_UP_ENV, 120.0))

    def delay(self, attempt: int, retry_after: Optional[float] = None) -> float:
        backoff = min(self.max_delay_s, self.base_delay_s * self.multiplier ** (attempt - 1))
        backoff *= 1 + self.jitter * (2 * self.rng.random() - 1)
        if retry_after is not None:
            backoff = max(backoff, min(retry_after, self.max_delay_s))
        return max(0.0, backoff)


def http_status(exc: BaseException) -> Optional[int]:
    """The HTTP status, or the JSON body's "code" when the SDK raised on an HTTP 200 carrying an error."""
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    if status is not None and status < 400:
        try:
            body = response.json()
            code = body.get("code") or (body.get("error") or {}).get("code")
            return int(code) if code else status
        except (ValueError, AttributeError, TypeError):
            return status
    return status


def unless_absent(call: Callable[[], T], absent, statuses: Tuple[int, ...] = (404,)):
    """call()'s answer; on Kaggle's 404 (no such kernel, dataset or file; `statuses` when a call answers absence
    otherwise) `absent` instead: raised if it is an exception (a NotFound naming what was asked), else returned
    (None, False, "absent")."""
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - a 404 is an answer; anything else goes up as it came
        if http_status(exc) not in statuses:
            raise
        if isinstance(absent, BaseException):
            raise absent from exc
        return absent


def is_transient(exc: BaseException) -> bool:
    """429, 5xx, connection-level failures and timeouts, and answers that are not JSON where JSON was due
    (a front end's error page); a 4xx other than 408/429 is an answer, not a glitch."""
    import json

    import requests  # the client's transport; imported here so the module loads without it

    status = http_status(exc)
    if status is not None:
        return status in _RETRY_STATUS
    if isinstance(exc, (requests.ConnectionError, requests.Timeout, ConnectionError, TimeoutError,
                        json.JSONDecodeError, requests.exceptions.JSONDecodeError)):
        return True
    try:
        import urllib3.exceptions as u3

        return isinstance(exc, (u3.ProtocolError, u3.NewConnectionError, u3.ReadTimeoutError))
    except ImportError:  # pragma: no cover
        return False


def retry_after_s(exc: BaseException) -> Optional[float]:
    response = getattr(exc, "response", None)
    value = getattr(response, "headers", {}).get("Retry-After") if response is not None else None
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
        return max(0.0, (when - datetime.now(timezone.utc)).total_seconds())
    except (TypeError, ValueError):
        return None


def call(fn: Callable[[], T], policy: RetryPolicy, what: str,
         on_retry: Optional[Callable[[BaseException], None]] = None) -> T:
    """Run `fn`, retrying transient failures until `policy.give_up_s` after the first one; `on_retry` runs
    before each new attempt (e.g. an idempotency check that may raise a result-carrying exception to stop).
    The give-up counts from the first failure, not the start, so a long transfer that fails late is still
    retried; a call Kaggle never answers ends within one timeout + give_up_s + one more timeout. A
    non-transient HTTP error comes back as `KaggleHTTPError` (one line naming the call; the response kept)."""
    failing_since: Optional[float] = None
    for attempt in range(1, policy.attempts + 1):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - classified below; non-transient errors re-raise
            if not is_transient(exc):
                if http_status(exc) is not None and not isinstance(exc, KaggleHTTPError):
                    raise KaggleHTTPError(f"{what}: {_short(exc)}", exc.response) from exc
                raise
            failing_since = time.monotonic() if failing_since is None else failing_since
            wait = policy.delay(attempt, retry_after_s(exc))
            if attempt == policy.attempts:
                raise RetriesExhausted(f"{what}: gave up after {attempt} attempts: {_short(exc)}") from exc
            if time.monotonic() + wait - failing_since > policy.give_up_s:
                raise KaggleUnresponsive(f"{what}: no usable answer from Kaggle for {policy.give_up_s:g} s"
                                       f" ({attempt} attempts; the last: {_short(exc)})") from exc
            log.info("%s: %s; retry %d/%d in %.2fs", what, _short(exc), attempt, policy.attempts - 1, wait)
            policy.sleep(wait)
            if on_retry is not None:
                on_retry(exc)
    raise AssertionError("unreachable")


def _short(exc: BaseException) -> str:
    """One line: the status and what the answer said, never a page of HTML or a traceback."""
    status = http_status(exc)
    name = type(exc).__name__
    if not status:
        if "Timeout" in name:  # the client's message repeats the whole URL and pool; the bound says it all
            return f"{name}: no answer within {read_timeout_s():g} s"
        return f"{name}: {str(exc).splitlines()[0][:120] if str(exc) else ''}".rstrip(": ")
    response = getattr(exc, "response", None)
    kind = (getattr(response, "headers", None) or {}).get("Content-Type", "")
    if "json" in kind:
        try:
            body = response.json()
            said = body.get("message") or (body.get("error") or {}).get("message") or ""
        except (ValueError, AttributeError):
            said = ""
    else:
        said = "an HTML page" if "html" in kind else ""
    return f"HTTP {status}" + (f" ({str(said)[:120]})" if said else "")
