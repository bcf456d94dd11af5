"""The user's code folder as it ships: which files travel inside a session kernel, how much may, and where
the folder is on each side of the wire (beside the spec on the orchestrator, unpacked in the kernel).
Both sides read this; importing the code itself is the kernel side's job (relay.kernel.usercode)."""
from __future__ import annotations

import fnmatch
import os
from pathlib import Path
from relay.shared import environment
from relay.shared.environment import SessionEnvironment

CODE_DIR_ENV = environment.CODE_DIR  # set by the session kernel: where it unpacked the user's folder
# The folder travels base64 inside the kernel source (one SaveKernel call ships code, spec and run id
# atomically; see relay/orchestrator/kaggle/kernel_source.py). Kaggle documents no limit on that text, so we keep it
# to what a script reasonably is: past 2 MB the folder holds data or weights, which belong in a dataset
# (kaggle.dataset_sources), versioned and mounted, not re-uploaded with every session.
MAX_CODE_BYTES = 2_000_000
_ALWAYS_EXCLUDED = ("__pycache__", "*.pyc", ".*", "relay-run", "*.egg-info")


def resolve_folder(spec_path: Path, folder: str) -> Path:
    """code.folder, relative to the spec file; inside a kernel, where the kernel unpacked it."""
    unpacked = SessionEnvironment.read().code_dir
    if unpacked is not None:
        return unpacked
    return (Path(spec_path).resolve().parent / folder).resolve()


def code_files(folder: Path, exclude: list[str] = ()) -> list[tuple[str, Path]]:
    """(relative posix path, file) of everything that ships, sorted; hidden files, caches and the local
    default workdir (relay-run/) never do."""
    patterns = [*_ALWAYS_EXCLUDED, *exclude]
    out = []
    for root, dirs, files in os.walk(folder):
        rel_root = Path(root).relative_to(folder)
        dirs[:] = sorted(d for d in dirs if not _excluded((rel_root / d).as_posix(), d, patterns))
        for name in sorted(files):
            rel = (rel_root / name).as_posix()
            if not _excluded(rel, name, patterns):
                out.append((rel, Path(root) / name))
    return out


def _excluded(rel: str, name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(name, p) or fnmatch.fnmatch(rel, p) for p in patterns)
