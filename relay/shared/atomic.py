"""Durable writes: readers see the old file or the new one, never half of one, even after a crash."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def fsync(path: Path) -> None:
    """Flush a file's data, or a folder's entries (a rename is durable only once its folder is synced)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems cannot open folders; nothing more can be done there
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: Path, data: bytes) -> None:
    """Replace `path` with `data`: temp file, fsync, rename, fsync the folder."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync(path.parent)


def write_json(path: Path, data: Any) -> None:
    write_bytes(path, json.dumps(data, indent=1, sort_keys=True).encode())
