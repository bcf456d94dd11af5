"""The code version a checkpoint or kernel was made with: a content hash of the code a session runs."""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # relay/
# What a session kernel runs, and so all that ships in it: the kernel side, the shared part, the faces
# `python -m relay train` enters by, and the public surface the user's code imports (docs/your-code.md), the
# paths documented before the package split included. The orchestrator and the emulator stay home: changing
# them changes no code version.
KERNEL_PARTS = ("__init__.py", "__main__.py", "cli.py", "commands.py", "front_door.py", "shared", "kernel",
                "hf.py", "lightning.py", "accelerate.py", "recipes.py", "integrations")


def kernel_files(package_dir: Path = PACKAGE_DIR) -> list[tuple[str, Path]]:
    """(path relative to the package, file) of every .py a session kernel carries, sorted by that path."""
    files = []
    for part in KERNEL_PARTS:
        path = package_dir / part
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += [p for p in path.rglob("*.py") if "__pycache__" not in p.parts]
    return sorted((p.relative_to(package_dir).as_posix(), p) for p in files)


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """sha256 (first 12 hex) over the kernel's files, paths sorted: equal code, equal hash."""
    h = hashlib.sha256()
    for rel, path in kernel_files():
        h.update(rel.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]
