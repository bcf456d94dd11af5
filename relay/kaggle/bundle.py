"""The exact project version a kernel runs: the relay package as a deterministic, content-hashed zip.

The zip holds the .py files `relay.version.code_version()` hashes, and its version is computed by the same
rule from the very bytes it holds, so the code version a session records inside Kaggle equals the bundle's
even if files change while the orchestrator runs.
"""
from __future__ import annotations

import hashlib
import io
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from relay.version import PACKAGE_DIR

_FIXED_TIME = (2020, 1, 1, 0, 0, 0)  # constant timestamps: equal sources give an equal zip


@dataclass(frozen=True)
class Bundle:
    data: bytes
    code_version: str
    files: int


def build_bundle(package_dir: Optional[Path] = None) -> Bundle:
    package_dir = package_dir or PACKAGE_DIR
    version = hashlib.sha256()
    buffer = io.BytesIO()
    count = 0
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        for path in sorted(package_dir.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            rel = path.relative_to(package_dir).as_posix()
            content = path.read_bytes()
            version.update(rel.encode())  # the rule of relay.version.code_version
            version.update(content)
            info = zipfile.ZipInfo(f"relay/{rel}", _FIXED_TIME)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, content)
            count += 1
    return Bundle(buffer.getvalue(), version.hexdigest()[:12], count)
