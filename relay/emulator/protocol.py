"""Wire-level pieces shared by the emulator's services: replies, errors, time formats, file serving."""
from __future__ import annotations

import email.utils
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, Optional


@dataclass
class Call:
    """One RPC as a service method sees it: who asked, the JSON body, and the base URL the client used."""
    user: str
    body: dict
    base: str          # scheme://host the client used, for URLs we hand back


@dataclass
class Reply:
    status: int = 200
    body: bytes = b""
    headers: Dict[str, str] = field(default_factory=dict)
    file: Optional[Path] = None          # streamed from disk instead of `body`
    offset: int = 0
    length: int = 0


class ApiError(Exception):
    """An error reply in the shape the SDK reads: {"code": N, "message": ...}."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def json_reply(data: object, status: int = 200) -> Reply:
    return Reply(status, json.dumps(data).encode(), {"Content-Type": "application/json"})


def error_reply(status: int, message: str, retry_after: Optional[str] = None) -> Reply:
    if status == 429:
        body = {"error": {"code": 429, "message": message, "status": "RESOURCE_EXHAUSTED"}}
    else:
        body = {"code": status, "message": message}
    reply = json_reply(body, status)
    if retry_after is not None:
        reply.headers["Retry-After"] = retry_after
    return reply


def iso(ts: float) -> str:
    """Kaggle's datetime format: ISO 8601 with milliseconds and Z (the SDK parses it as naive UTC)."""
    return datetime.fromtimestamp(ts, timezone.utc).replace(tzinfo=None).isoformat(timespec="milliseconds") + "Z"


def duration(seconds: float) -> str:
    return f"{max(0.0, seconds):.3f}s"


def slug_of(body: dict, *keys: str) -> str:
    for key in keys:
        value = body.get(key)
        if value:
            return str(value)
    raise ApiError(400, f"missing field {keys[0]}")


_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


def file_reply(path: Path, headers: Dict[str, str], content_type: str = "application/octet-stream") -> Reply:
    """A file with Content-Length, ETag, Last-Modified and single-range support (206/416)."""
    if not path.is_file():
        raise ApiError(404, "file not found")
    stat = path.stat()
    etag = '"' + hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:32] + '"'
    common = {"Content-Type": content_type, "ETag": etag, "Accept-Ranges": "bytes",
              "Last-Modified": email.utils.formatdate(stat.st_mtime, usegmt=True),
              "Content-Disposition": f'attachment; filename="{path.name}"'}
    size = stat.st_size
    wanted = headers.get("Range")
    if wanted and headers.get("If-Range", etag) in (etag, common["Last-Modified"]):
        match = _RANGE.match(wanted.strip())
        if match and (match.group(1) or match.group(2)):
            first, last = match.group(1), match.group(2)
            if first:
                start, end = int(first), min(int(last) if last else size - 1, size - 1)
            else:
                start, end = max(0, size - int(last)), size - 1
            if start >= size or start > end:
                return Reply(416, b"", {**common, "Content-Range": f"bytes */{size}"})
            return Reply(206, b"", {**common, "Content-Range": f"bytes {start}-{end}/{size}"},
                         file=path, offset=start, length=end - start + 1)
    if headers.get("If-None-Match") == etag:
        return Reply(304, b"", common)
    return Reply(200, b"", common, file=path, offset=0, length=size)


def tree_files(root: Path) -> list:
    """(relative posix path, size) of every regular file under root, sorted; symlinks are not followed."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            full = Path(dirpath) / name
            if full.is_symlink() or not full.is_file():
                continue
            found.append((full.relative_to(root).as_posix(), full.stat().st_size))
    return found


def tree_size(root: Path) -> int:
    total = 0
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total
