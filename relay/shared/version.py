"""The code version a checkpoint or kernel was made with: a content hash of the relay package."""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """sha256 (first 12 hex) over every .py file of the package, paths sorted: equal code, equal hash."""
    h = hashlib.sha256()
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        h.update(path.relative_to(PACKAGE_DIR).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]
