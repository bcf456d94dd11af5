"""The front door every command and flow loads a spec through: the spec itself (relay.shared.spec: YAML,
types, paths; torch-free and importing no user code), then the user's code it names, imported and checked
once here (relay.kernel.usercode.check_code), so a wrong entry or recipe is one line and exit 2 before
anything is written, trained or pushed. A built-in recipe imports nothing of the kernel side."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Optional

from relay.shared import spec as spec_mod
from relay.shared.code_folder import code_files

# What this process has import-checked already: `relay run` loads the spec before it starts Prefect (a bad one is
# one line, exit 2) and the flow loads it again; the user's code is checked once for the same spec and files.
_checked: set[tuple[str, str]] = set()


def load_spec(path: str | Path, overrides: Optional[dict[str, Any]] = None) -> spec_mod.RunSpec:
    run_spec = spec_mod.load(path, overrides)
    if run_spec.code is not None:
        key = (run_spec.model_dump_json(), _code_digest(run_spec.code))
        if key not in _checked:
            from relay.kernel.usercode import check_code

            check_code(run_spec, source=str(path))
            _checked.add(key)
    return run_spec


def _code_digest(code) -> str:
    """The code folder as it ships (its files' names and bytes, at most 2 MB): a changed file is checked again."""
    digest = hashlib.sha256()
    for rel, file in code_files(Path(code.folder), code.exclude):
        digest.update(rel.encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()
