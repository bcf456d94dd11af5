"""The exact project version a kernel runs: the relay package as a deterministic, content-hashed zip.

The zip holds the same .py files `relay.version.code_version()` hashes, so the code version a session records
inside Kaggle equals the one the orchestrator computed here.
"""
from __future__ import annotations

import functools
import io
import zipfile
from dataclasses import dataclass
from pathlib import Path

from relay.version import PACKAGE_DIR, code_version

_FIXED_TIME = (2020, 1, 1, 0, 0, 0)  # constant timestamps: equal sources give an equal zip


@dataclass(frozen=True)
class Bundle:
    data: bytes
    code_version: str
    files: int


@functools.lru_cache(maxsize=4)
def _build(package_dir: Path, version: str) -> Bundle:
    buffer = io.BytesIO()
    count = 0
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        for path in sorted(package_dir.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            info = zipfile.ZipInfo(f"relay/{path.relative_to(package_dir).as_posix()}", _FIXED_TIME)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, path.read_bytes())
            count += 1
    return Bundle(buffer.getvalue(), version, count)


def build_bundle() -> Bundle:
    return _build(PACKAGE_DIR, code_version())
