"""The emulator's HTTP front: routing, auth, fault injection, and the `Emulator` object that ties it together.

Requests arrive as `/api/v1/<service>/<Method>` (SDK pointed at this address) or with an absolute request
line `POST http://localhost/api/v1/...` (an unmodified CLI with KAGGLE_API_ENVIRONMENT=LOCALHOST and
HTTP_PROXY pointing here). URLs handed back (uploads, outputs, downloads) use the address the client used,
so they come back the same way.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import socket
import struct
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional

from relay.emulator.config import EmulatorConfig
from relay.emulator.datasets_api import DatasetsService
from relay.emulator.faults import Fault, FaultPlan
from relay.emulator.kernels_api import KernelsService
from relay.emulator.protocol import ApiError, Call, Reply, error_reply, json_reply
from relay.emulator.runner import KernelRunner
from relay.emulator.store import Store

log = logging.getLogger("relay.emulator")

SERVICES = {
    "kernels.KernelsApiService": ("kernels", {"SaveKernel", "GetKernelSessionStatus", "ListKernelSessionOutput",
                                              "GetKernel", "ListKernels", "GetAcceleratorQuotaStatistics",
                                              "DeleteKernel"}),
    "datasets.DatasetApiService": ("datasets", {"GetDatasetStatus", "GetDataset", "CreateDataset",
                                                "CreateDatasetVersion", "CreateDatasetVersionById",
                                                "ListDatasetFiles", "GetDatasetMetadata", "DownloadDataset",
                                                "DeleteDataset"}),
    "blobs.BlobApiService": ("datasets", {"StartBlobUpload"}),
}


def _digest(secret: str) -> bytes:
    return hashlib.sha256(b"relay-emulator:" + secret.encode()).digest()


class Emulator:
    """A local Kaggle: `with Emulator(state_dir, config) as emu: ... emu.url ...`"""

    def __init__(self, state_dir: Path, config: Optional[EmulatorConfig] = None, port: int = 0,
                 host: str = "127.0.0.1"):
        self.config = (config or EmulatorConfig()).validate()
        self.store = Store(Path(state_dir))
        self.faults = FaultPlan(self.config.faults)
        self.runner = KernelRunner(self.store, self.config, self.faults)
        self.kernels = KernelsService(self.store, self.config, self.faults, self.runner)
        self.datasets = DatasetsService(self.store, self.config, self.faults)
        # only digests are kept, so no credential sits in memory dumps of state or in the state folder
        self._keys = {user: _digest(key) for user, key in self.config.users.items()}
        self._tokens = {_digest(token): user for token, user in self.config.tokens.items()}
        self.httpd = ThreadingHTTPServer((host, port), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.emulator = self
        self._thread: Optional[threading.Thread] = None
        self.stopping = threading.Event()  # releases the requests held by the `hang` fault

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Emulator":
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), name="kaggle-emulator", daemon=True)
        self._thread.start()
        log.info("Kaggle emulator on %s, state in %s", self.url, self.store.root)
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.runner.stop()

    def __enter__(self) -> "Emulator":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def authenticate(self, header: Optional[str]) -> Optional[str]:
        if not header:
            return None
        scheme, _, value = header.partition(" ")
        if scheme.lower() == "basic":
            try:
                user, _, key = base64.b64decode(value).decode().partition(":")
            except ValueError:
                return None
            expected = self._keys.get(user)
            return user if expected and hmac.compare_digest(expected, _digest(key)) else None
        if scheme.lower() == "bearer":
            return self._tokens.get(_digest(value.strip()))
        return None

    def introspect(self, token: str) -> dict:
        user = self._tokens.get(_digest(token or ""))
        return {"active": True, "username": user, "clientId": "relay-emulator", "scope": "resources.admin:*"} \
            if user else {"active": False}


class _Handler(BaseHTTPRequestHandler):
    server_version = "KaggleEmulator/1"
    protocol_version = "HTTP/1.0"   # one request per connection: simple, and what a dropped connection needs

    @property
    def emu(self) -> Emulator:
        return self.server.emulator  # type: ignore[attr-defined]

    def log_message(self, fmt: str, *args: object) -> None:  # request lines only; headers are never logged
        log.debug("%s " + fmt, self.address_string(), *args)

    # -- plumbing --------------------------------------------------------------------------------
    def _split(self) -> tuple:
        parts = urllib.parse.urlsplit(self.path)
        if parts.scheme:  # proxy-style absolute request line
            base = f"{parts.scheme}://{parts.netloc}"
        else:
            base = f"http://{self.headers.get('Host') or '127.0.0.1:%d' % self.emu.port}"
        return base, parts.path, dict(urllib.parse.parse_qsl(parts.query))

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, reply: Reply) -> None:
        self.send_response(reply.status)
        for name, value in reply.headers.items():
            self.send_header(name, value)
        length = reply.length if reply.file is not None else len(reply.body)
        self.send_header("Content-Length", str(length))
        self.end_headers()
        if self.command == "HEAD":
            return
        if reply.file is None:
            self.wfile.write(reply.body)
            return
        with open(reply.file, "rb") as f:
            f.seek(reply.offset)
            left = reply.length
            while left > 0:
                chunk = f.read(min(left, 1 << 20))
                if not chunk:
                    break
                self.wfile.write(chunk)
                left -= len(chunk)

    def _drop(self) -> None:
        """Close with a TCP reset and no response: what a client sees when a connection dies."""
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()

    def _with_faults(self, key: str, handle) -> None:
        before, after = self.emu.faults.delay(key)
        time.sleep(before)  # latency: the request's way in
        fault = self.emu.faults.decide(key)
        if fault.kind == "slow":
            time.sleep(fault.slow_s)
        if fault.kind in ("reset", "hang", "html"):
            return self._fail(fault)
        if fault.kind in ("429", "500", "503"):
            message = {"429": "Too many requests", "500": "Internal error", "503": "Service unavailable"}[fault.kind]
            return self._send(error_reply(int(fault.kind), message,
                                          self.emu.config.retry_after if fault.kind == "429" else None))
        if fault.kind == "refused":  # how Kaggle refuses a push: HTTP 200, version 0, an error
            return self._send(json_reply({"versionNumber": 0, "error": "Notebook push failed, try again later."}))
        try:
            reply = handle()
        except ApiError as err:
            reply = error_reply(err.status, err.message)
        except Exception as exc:  # noqa: BLE001 - a bug answers 500, like the real service would
            log.exception("emulator: %s failed", key)
            reply = error_reply(500, f"Internal error: {type(exc).__name__}")
        if fault.kind == "lost":
            return self._drop()
        time.sleep(after)  # the response's way out
        self._send(reply)

    def _fail(self, fault: Fault) -> None:
        """The faults that answer nothing usable: a dropped connection, no answer at all, an HTML page."""
        if fault.kind == "hang":
            self.emu.stopping.wait()  # never answered while the emulator runs; the client's timeout ends it
            return self._drop()
        if fault.kind == "html":
            headers = {"Content-Type": "text/html; charset=UTF-8"}
            if fault.status == 429:
                headers["Retry-After"] = self.emu.config.retry_after
            page = f"<!DOCTYPE html><html><head><title>Error {fault.status}</title></head><body><h1>{fault.status}" \
                   "</h1><p>That's an error. Please try again later.</p></body></html>"
            return self._send(Reply(fault.status, page.encode(), headers))
        return self._drop()

    # -- verbs -----------------------------------------------------------------------------------
    def do_POST(self) -> None:
        base, path, _ = self._split()
        raw = self._body()
        segments = [s for s in path.split("/") if s]
        if segments[:2] == ["api", "v1"]:
            segments = segments[2:]
        elif segments[:1] == ["v1"]:
            segments = segments[1:]
        if len(segments) != 2:
            return self._send(error_reply(404, f"No such endpoint {path}"))
        service, method = segments
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            return self._send(error_reply(400, "request body is not JSON"))
        if service == "security.OAuthService" and method == "IntrospectToken":
            return self._send(json_reply(self.emu.introspect(body.get("token", ""))))
        target = SERVICES.get(service)
        if target is None or method not in target[1]:
            return self._send(error_reply(404, f"{service}/{method} is not emulated"))
        user = self.emu.authenticate(self.headers.get("Authorization"))
        if user is None:
            return self._send(error_reply(401, "Unauthenticated: valid Basic or Bearer credentials required"))
        service_obj = getattr(self.emu, target[0])

        def handle() -> Reply:
            try:
                result = getattr(service_obj, method)(Call(user, body, base))
            finally:  # the delete lag is counted in its owner's requests (faults.py delete_lag)
                self.emu.store.owner_answered(user, time.time(), self.emu.config.time_scale)
            return result if isinstance(result, Reply) else json_reply(result)

        self._with_faults(method, handle)

    def do_PUT(self) -> None:
        _, path, _ = self._split()
        segments = [s for s in path.split("/") if s]
        body = self._body()
        if len(segments) != 2 or segments[0] != "upload":
            return self._send(error_reply(404, "not found"))
        time.sleep(sum(self.emu.faults.delay("upload")))
        fault = self.emu.faults.decide("upload")
        if fault.kind in ("reset", "hang", "html"):
            return self._fail(fault)
        if fault.kind in ("429", "500", "503"):
            return self._send(Reply(int(fault.kind), b"injected", {"Content-Type": "text/plain"}))
        headers = {k: v for k, v in self.headers.items()}
        self._send(self.emu.datasets.put_blob(segments[1], headers, body))

    def do_GET(self) -> None:
        _, path, query = self._split()
        segments = [urllib.parse.unquote(s) for s in path.split("/") if s]
        headers = {k: v for k, v in self.headers.items()}
        if segments[:2] == ["files", "kout"]:
            return self._with_faults("download", lambda: self.emu.kernels.output_file(segments[2:], query, headers))
        if segments[:2] == ["files", "ds"]:
            user = self.emu.authenticate(self.headers.get("Authorization"))
            if user is None or (len(segments) > 2 and segments[2] != user):
                return self._send(error_reply(401, "Unauthenticated"))
            return self._with_faults("download", lambda: self.emu.datasets.dataset_file(segments[2:], headers))
        if segments[:5] == ["api", "v1", "kernels", "logs", "stream"] and len(segments) == 7:
            user = self.emu.authenticate(self.headers.get("Authorization"))
            if user is None:
                return self._send(error_reply(401, "Unauthenticated"))
            return self._stream(user, segments[5], segments[6])
        self._send(error_reply(404, f"No such path {path}"))

    do_HEAD = do_GET

    def _stream(self, user: str, owner: str, slug: str) -> None:
        try:
            content_type, chunks = self.emu.kernels.log_stream(user, owner, slug)
        except ApiError as err:
            return self._send(error_reply(err.status, err.message))
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Connection", "close")
        self.end_headers()
        try:
            for chunk in chunks:
                self.wfile.write(chunk)
                self.wfile.flush()
        except ConnectionAbortedError:  # the stream_drop fault: cut the live stream mid-session
            self._drop()
        except (BrokenPipeError, ConnectionResetError):  # the follower hung up (a tick reads it for a few seconds)
            self.close_connection = True