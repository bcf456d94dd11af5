"""The front door every command and flow loads a spec through: the spec itself (relay.shared.spec: YAML,
types, paths; torch-free and importing no user code), then the user's code it names, imported and checked
once here (relay.kernel.usercode.check_code), so a wrong entry or recipe is one line and exit 2 before
anything is written, trained or pushed. A built-in recipe imports nothing of the kernel side."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from relay.shared import spec as spec_mod


def load_spec(path: str | Path, overrides: Optional[dict[str, Any]] = None) -> spec_mod.RunSpec:
    run_spec = spec_mod.load(path, overrides)
    if run_spec.code is not None:
        from relay.kernel.usercode import check_code

        check_code(run_spec, source=str(path))
    return run_spec
