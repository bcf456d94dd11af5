"""The front door every command and flow loads a spec through: the spec itself (relay.shared.spec: YAML,
types, paths; torch-free and importing no user code), then the user's code it names, imported and checked
once here (relay.kernel.usercode.check_code), so a wrong entry or recipe is one line and exit 2 before
anything is written, trained or pushed. A built-in recipe imports nothing of the kernel side."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Optional

from relay.shared import spec as spec_mod
from relay.shared.code_folder import code_files

# What this process has import-checked already: `relay run` loads the spec before it starts Prefect (a bad one is
# one line, exit 2) and the flow loads it again; the user's code is checked once for the same spec and files.
_checked: set[tuple[str, str]] = set()


def load_spec(path: str | Path, overrides: Optional[dict[str, Any]] = None) -> spec_mod.RunSpec:
    return read_spec(path, overrides).spec


def read_spec(path: str | Path, overrides: Optional[dict[str, Any]] = None) -> spec_mod.LoadedSpec:
    """The spec file read once (relay.shared.spec.read: the text a push ships and the spec parsed from it), its
    user code checked. What the orchestrator passes down instead of the path."""
    loaded = spec_mod.read(path, overrides)
    run_spec = loaded.spec
    if run_spec.code is not None:
        key = (run_spec.model_dump_json(), _code_digest(run_spec.code, loaded))
        if key not in _checked:
            from relay.kernel.usercode import check_code

            check_code(run_spec, source=str(path))
            _checked.add(key)
    return loaded


def _code_digest(code, loaded: Optional[spec_mod.LoadedSpec] = None) -> str:
    """The code folder as it ships (its files' names and bytes, at most 2 MB): a changed file is checked again.
    The spec itself, when it lies in the folder, is the bytes already read."""
    spec_file = os.path.realpath(loaded.path) if loaded is not None and loaded.raw else None
    digest = hashlib.sha256()
    for rel, file in code_files(Path(code.folder), code.exclude):
        data = loaded.raw if spec_file is not None and os.path.realpath(file) == spec_file else file.read_bytes()
        digest.update(rel.encode() + b"\0" + data + b"\0")
    return digest.hexdigest()
