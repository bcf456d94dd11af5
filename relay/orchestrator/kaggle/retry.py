"""Bounded retries with exponential backoff and jitter for every Kaggle call.

The `kaggle` client retries only uploads and dataset creation, so push, status and output would fail on the
first 429 or 5xx; this wraps every call. Retry-After is honoured (as a floor, capped by `max_delay_s`).
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Callable, Optional, TypeVar

from relay.orchestrator.kaggle.types import RetriesExhausted

T = TypeVar("T")
log = logging.getLogger(__name__)

_RETRY_STATUS = {408, 429, 500, 502, 503, 504}


@dataclass
class RetryPolicy:
    attempts: int = 8
    base_delay_s: float = 1.0
    multiplier: float = 2.0
    max_delay_s: float = 60.0
    jitter: float = 0.5           # +-50 % of the delay, so parallel clients do not retry in lockstep
    sleep: Callable[[float], None] = time.sleep
    rng: random.Random = field(default_factory=random.Random)

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


def is_transient(exc: BaseException) -> bool:
    """429, 5xx and connection-level failures; a 4xx other than 408/429 is an answer, not a glitch."""
    import requests  # the client's transport; imported here so the module loads without it

    status = http_status(exc)
    if status is not None:
        return status in _RETRY_STATUS
    if isinstance(exc, (requests.ConnectionError, requests.Timeout, ConnectionError, TimeoutError)):
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
    """Run `fn`, retrying transient failures; `on_retry` runs before each new attempt (e.g. an
    idempotency check that may raise a result-carrying exception to stop)."""
    for attempt in range(1, policy.attempts + 1):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - classified below; non-transient errors re-raise
            if not is_transient(exc):
                raise
            if attempt == policy.attempts:
                raise RetriesExhausted(f"{what}: gave up after {attempt} attempts: {_short(exc)}") from exc
            wait = policy.delay(attempt, retry_after_s(exc))
            log.info("%s: %s; retry %d/%d in %.2fs", what, _short(exc), attempt, policy.attempts - 1, wait)
            policy.sleep(wait)
            if on_retry is not None:
                on_retry(exc)
    raise AssertionError("unreachable")


def _short(exc: BaseException) -> str:
    status = http_status(exc)
    name = type(exc).__name__
    return f"{name} HTTP {status}" if status else f"{name}: {str(exc)[:120]}"
