"""The exact project version a kernel runs: the kernel side of the relay package (relay.shared.version's
kernel_files: shared/, kernel/, the `relay train` face and the public surface user code imports; not the
orchestrator) as a deterministic, content-hashed zip.

The zip holds the .py files `relay.shared.version.code_version()` hashes, and its version is computed by the same
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

from relay.shared.version import PACKAGE_DIR, kernel_files

_FIXED_TIME = (2020, 1, 1, 0, 0, 0)  # constant timestamps: equal sources give an equal zip


@dataclass(frozen=True)
class Bundle:
    data: bytes
    code_version: str
    files: int
    user_code_bytes: int = 0


def build_bundle(package_dir: Optional[Path] = None, user_code: Optional[str] = None, exclude=()) -> Bundle:
    """The package's kernel side, and the user's code folder under user-code/ (its files do not change the
    code version, which names the relay's own code; the bundle's sha256 in the kernel covers both)."""
    package_dir = package_dir or PACKAGE_DIR
    version = hashlib.sha256()
    buffer = io.BytesIO()
    count = 0
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        for rel, path in kernel_files(package_dir):
            content = path.read_bytes()
            version.update(rel.encode())  # the rule of relay.shared.version.code_version
            version.update(content)
            info = zipfile.ZipInfo(f"relay/{rel}", _FIXED_TIME)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, content)
            count += 1
        user_bytes = _add_user_code(zf, Path(user_code), exclude) if user_code else 0
    return Bundle(buffer.getvalue(), version.hexdigest()[:12], count, user_bytes)


def _add_user_code(zf: zipfile.ZipFile, folder: Path, exclude) -> int:
    from relay.shared.code_folder import MAX_CODE_BYTES, code_files
    from relay.shared.errors import InputError

    files = code_files(folder, list(exclude))
    total = sum(f.stat().st_size for _, f in files)
    if total > MAX_CODE_BYTES:  # checked when the spec loads too; the folder may have grown since
        raise InputError(f"code.folder: {folder} holds {total / 1e6:.1f} MB to ship; at most"
                         f" {MAX_CODE_BYTES / 1e6:g} MB travel inside the session kernel")
    for rel, path in files:
        info = zipfile.ZipInfo(f"user-code/{rel}", _FIXED_TIME)
        info.compress_type = zipfile.ZIP_DEFLATED
        info.external_attr = 0o644 << 16
        zf.writestr(info, path.read_bytes())
    return total
