"""The front door every command and flow loads a spec through: the spec itself (relay.shared.spec: YAML,
types, paths; torch-free and importing no user code), then the user's code it names, imported and checked
here (relay.kernel.usercode.check_code), so a wrong entry or recipe is one line and exit 2 before
anything is written, trained or pushed. A built-in recipe imports nothing of the kernel side.

A process that runs a relay parses its spec once, where it takes it in: `relay run` (then it hands the flow the
LoadedSpec), or a flow's `spec` parameter (`spec_at_flow`: a deployment run gives a path, or the spec's text)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional, Union

from pydantic import WithJsonSchema

from relay.shared import spec as spec_mod

# A flow's `spec`: a path, the spec's YAML text, or a spec read in this process; a deployment's form shows a string
SpecParameter = Annotated[Union[str, spec_mod.LoadedSpec], WithJsonSchema({"type": "string"})]


def load_spec(path: str | Path, overrides: Optional[dict[str, Any]] = None) -> spec_mod.RunSpec:
    return read_spec(path, overrides).spec


def read_spec(path: str | Path, overrides: Optional[dict[str, Any]] = None) -> spec_mod.LoadedSpec:
    """The spec file read and parsed (relay.shared.spec.read: the text a push ships and the spec parsed from it),
    its user code checked. What the orchestrator passes down instead of the path."""
    return _checked(spec_mod.read(path, overrides), str(path))


def spec_at_flow(spec: SpecParameter) -> spec_mod.LoadedSpec:
    """A flow's `spec` parameter, parsed once here: a LoadedSpec (what `relay run` read and checked in this
    process) as it is; a value with a line break is the spec's YAML text itself (its relative paths relative to
    the worker's working folder); anything else is the path of a spec file."""
    if isinstance(spec, spec_mod.LoadedSpec):
        return spec
    text = "\n" in spec
    return _checked(spec_mod.parse(spec, source="spec (the flow's spec parameter)", folder=Path.cwd()) if text
                    else spec_mod.read(spec), "spec" if text else spec)


def _checked(loaded: spec_mod.LoadedSpec, source: str) -> spec_mod.LoadedSpec:
    if loaded.spec.code is not None:
        from relay.kernel.usercode import check_code

        check_code(loaded.spec, source=source)
    return loaded
