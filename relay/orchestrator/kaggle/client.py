"""The real `kaggle` client, imported lazily in a controlled environment and bound to one endpoint.

`import kaggle` authenticates at import time (reading ~/.kaggle, env tokens, maybe a network call) and freezes
KAGGLE_CONFIG_DIR / KAGGLE_API_ENVIRONMENT into class attributes. We import it once with no credentials in
the environment and HOME/KAGGLE_CONFIG_DIR pointing at an empty temporary folder, then build our own
`KaggleApi` instances whose credentials, environment and retry helper are set per instance.

No request of the client may wait forever: `kagglesdk` sends its RPCs without a timeout, and the client's
uploads open `requests` sessions of their own, so no session of ours could carry one. Instead the transport
itself (`requests`' HTTPAdapter.send) is wrapped, once: while a thread is inside a call of this module
(`KaggleClient.bound`), a request sent without a timeout gets retry.request_timeout(), and one sent with a longer
timeout (the client's downloads use 300 s) gets the shorter one. Requests of anything else (Prefect, the user's
code) are left as they are.
"""
from __future__ import annotations

import contextlib
import io
import os
import tempfile
import threading
import unittest.mock
from typing import Any, Callable, Iterator, Optional

from relay.orchestrator.kaggle.credentials import KaggleCredentials
from relay.orchestrator.kaggle.retry import RetryPolicy, call, request_timeout

_IMPORT_LOCK = threading.Lock()
_PRINT = print
# depth of KaggleClient.bound() on this thread (its requests get a timeout) and the endpoint of its client
_in_call = threading.local()
_TRANSPORT_LOCK = threading.Lock()


class _EndpointPerThread(dict):
    """kagglesdk's table of endpoints (kaggle_env._env_to_endpoint, read each time it builds a client), whose
    LOCAL entry is, on a thread inside KaggleClient.bound, that client's endpoint: clients of different endpoints
    in one process run side by side, and a call that waits (a silent session's log stream) holds up no other."""

    def __init__(self, table: dict, local: Any):
        super().__init__(table)
        self.local = local

    def __getitem__(self, env: Any) -> Any:
        endpoint = getattr(_in_call, "endpoint", None)
        return endpoint if endpoint is not None and env == self.local else super().__getitem__(env)


def _endpoints_per_thread() -> None:
    from kagglesdk import kaggle_env

    # kagglesdk has no public way to name an endpoint: its private table, read by get_endpoint() each time a client
    # is built, is the same in 0.1.30-0.1.38 (pyproject.toml's range); another layout is one line, not a call to
    # kaggle.com
    table, env = getattr(kaggle_env, "_env_to_endpoint", None), getattr(kaggle_env, "KaggleEnv", None)
    if not isinstance(table, dict) or getattr(env, "LOCAL", None) not in table:
        from relay.orchestrator.kaggle.types import KaggleError

        raise KaggleError("kagglesdk: this version keeps no kaggle_env._env_to_endpoint table, so the relay cannot"
                          " point it at the emulator; install kagglesdk>=0.1.30,<0.2")
    with _TRANSPORT_LOCK:
        if not isinstance(kaggle_env._env_to_endpoint, _EndpointPerThread):
            kaggle_env._env_to_endpoint = _EndpointPerThread(kaggle_env._env_to_endpoint, kaggle_env.KaggleEnv.LOCAL)


def _tighter(given: Any, bound: tuple) -> tuple:
    """The shorter of a requests timeout (None, a number or (connect, read)) and `bound`, per part."""
    if given is None:
        return bound
    connect, read = given if isinstance(given, tuple) else (given, given)
    return (min(connect, bound[0]) if connect is not None else bound[0],
            min(read, bound[1]) if read is not None else bound[1])


def bound_transport() -> None:
    """Wrap requests' HTTPAdapter.send once, so requests sent inside a call of this module are bounded."""
    from requests.adapters import HTTPAdapter

    with _TRANSPORT_LOCK:
        if getattr(HTTPAdapter.send, "relay_bounded", False):
            return
        send = HTTPAdapter.send

        def bounded_send(self: Any, request: Any, stream: bool = False, timeout: Any = None,
                         *args: Any, **kwargs: Any) -> Any:
            if getattr(_in_call, "depth", 0):
                timeout = _tighter(timeout, request_timeout())
            return send(self, request, stream, timeout, *args, **kwargs)

        bounded_send.relay_bounded = True  # type: ignore[attr-defined]
        HTTPAdapter.send = bounded_send  # type: ignore[method-assign]


def kaggle_api_class() -> type:
    with _IMPORT_LOCK:
        import sys

        if "kaggle.api.kaggle_api_extended" not in sys.modules:
            saved = dict(os.environ)
            scratch = tempfile.mkdtemp(prefix="relay-kaggle-import-")
            try:
                for name in list(os.environ):
                    if name.startswith("KAGGLE_"):
                        del os.environ[name]
                os.environ["HOME"] = scratch
                os.environ["KAGGLE_CONFIG_DIR"] = scratch
                # the import-time authenticate finds nothing and prints help; keep that off our stdout, and
                # out of a Prefect flow's log too (log_prints replaces builtins.print): a false alarm there
                # and it ends with exit(), which closes sys.stdin: give it a stand-in (`relay stop --now` asks)
                sink = io.StringIO()
                with contextlib.redirect_stdout(sink), unittest.mock.patch("sys.stdin", io.StringIO()), \
                        unittest.mock.patch("builtins.print", lambda *a, **k: _PRINT(*a, **{**k, "file": sink})):
                    import kaggle  # noqa: F401
            finally:
                os.environ.clear()
                os.environ.update(saved)
        from kaggle.api.kaggle_api_extended import KaggleApi

        return KaggleApi


class UploadIncomplete(ConnectionError):
    """A file upload that did not complete; transient, so the dataset call is retried."""


class KaggleClient:
    """A `KaggleApi` for one account and one endpoint (None = production api.kaggle.com)."""

    def __init__(self, credentials: KaggleCredentials, endpoint: Optional[str] = None,
                 policy: Optional[RetryPolicy] = None):
        self.credentials = credentials
        self.endpoint = endpoint.rstrip("/") if endpoint else None
        self.policy = policy or RetryPolicy()
        bound_transport()
        api = kaggle_api_class()()
        values = {"username": credentials.username}
        if credentials.token:
            values["token"] = credentials.token
        else:
            values["key"] = credentials.key
        api.config_values = values
        api.args = ["--local"] if self.endpoint else []
        api._authenticated = True
        # the client's own retry helper (uploads, dataset creation) can sleep ~143 s; use our policy
        api.with_retry = self._with_retry
        api._upload_file = self._strict_upload(api._upload_file)
        # every download printed "Dataset URL: ..." on stdout (a tick's output, a flow's log): say nothing
        api._print_dataset_url_and_license = lambda *args, **kwargs: None
        self.api = api

    @property
    def username(self) -> str:
        return self.credentials.username

    def _with_retry(self, func: Callable, **_: Any) -> Callable:
        if getattr(func, "__name__", "").startswith("create_dataset"):
            # not idempotent: a blind retry after a lost response makes a second version; DatasetPublisher
            # retries these itself, after checking whether the failed attempt landed
            return func

        def retried(*args: Any, **kwargs: Any) -> Any:
            return call(lambda: func(*args, **kwargs), self.policy, getattr(func, "__name__", "kaggle call"))

        return retried

    def _strict_upload(self, upload_file: Callable) -> Callable:
        """The client silently leaves a file out of a dataset version when its upload fails (a PUT answered
        500). Upload that one file again first (the client resumes it); if it keeps failing, fail the whole
        call, so it is retried and no incomplete version is created. Retrying per file matters: restarting
        the whole version for one flaky PUT re-sends every file, and under heavy faults never finishes."""
        def strict(file_name: str, *args: Any, **kwargs: Any) -> Any:
            for attempt in range(1, self.policy.attempts + 1):
                result = upload_file(file_name, *args, **kwargs)
                if result is not None:
                    return result
                if attempt < self.policy.attempts:
                    self.policy.sleep(self.policy.delay(attempt))
            raise UploadIncomplete(f"upload of {file_name} failed {self.policy.attempts} times")

        return strict

    @contextlib.contextmanager
    def bound(self) -> Iterator[Any]:
        """The KaggleApi, with the SDK pointed at this client's endpoint and every request bounded (see the
        module's docstring) for the duration."""
        if self.endpoint:
            _endpoints_per_thread()
        outer = getattr(_in_call, "endpoint", None)
        _in_call.depth = getattr(_in_call, "depth", 0) + 1
        _in_call.endpoint = self.endpoint
        try:
            yield self.api
        finally:
            _in_call.depth -= 1
            _in_call.endpoint = outer

    def run(self, what: str, fn: Callable[[Any], Any], on_retry: Optional[Callable] = None) -> Any:
        """fn(api) with retries on transient failures."""
        def attempt() -> Any:
            with self.bound() as api:
                return fn(api)

        return call(attempt, self.policy, what, on_retry)

    def sdk(self, what: str, fn: Callable[[Any], Any], on_retry: Optional[Callable] = None) -> Any:
        """fn(kagglesdk client) with retries: for RPCs the KaggleApi has no plain method for."""
        def attempt() -> Any:
            with self.bound() as api, api.build_kaggle_client() as kaggle:
                return fn(kaggle)

        return call(attempt, self.policy, what, on_retry)
