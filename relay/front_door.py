"""The front door every command and flow loads a spec through: the spec itself (relay.shared.spec: YAML,
types, paths; torch-free and importing no user code), then the user's code it names, imported and checked
once here (relay.kernel.usercode.check_code), so a wrong entry or recipe is one line and exit 2 before
anything is written, trained or pushed. A built-in recipe imports nothing of the kernel side."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from relay.shared import spec as spec_mod
from relay.shared.code_folder import code_digest

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
        # a changed file of the code folder is checked again; the spec in it is the bytes already read
        key = (run_spec.model_dump_json(),
               code_digest(run_spec.code.folder, run_spec.code.exclude, loaded.path, loaded.raw))
        if key not in _checked:
            from relay.kernel.usercode import check_code

            check_code(run_spec, source=str(path))
            _checked.add(key)
    return loaded
