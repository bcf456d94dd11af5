"""The canary `relay doctor` runs inside a CPU kernel: the same start as a session (the shipped bundle, the
user's code, the spec's mounts), then checks instead of training, written to one JSON file the doctor reads
back from the kernel's output. It never exits non-zero for a failed check: the file is the answer.

    python -m relay.kernel.canary SPEC --out DIR/doctor.json --plan FILE

The plan (relay/shared/session_plan.py) names the mounts to check (`canary`); they are looked for as a session looks
for its own (relay/kernel/session/mounts.py).
"""
from __future__ import annotations

import argparse
import os
import platform
from pathlib import Path
from typing import Callable

from relay.shared.atomic import write_json
from relay.shared.version import code_version


def _check(name: str, run: Callable[[], str]) -> dict:
    try:
        return {"name": name, "ok": True, "detail": run()}
    except Exception as err:  # every failure is reported in the file, never as a crash
        return {"name": name, "ok": False, "detail": f"{type(err).__name__}: {err}"}


def _spec(path: str) -> str:
    from relay.kernel.usercode import check_code
    from relay.shared import spec

    loaded = spec.load(path)
    check_code(loaded, source=path)  # importable entry/recipe, pip, checked in this kernel
    what = loaded.code.entry if loaded.code and loaded.code.entry else loaded.recipe
    return f"{loaded.name}: {what} imports and validates"


def _imports(path: str) -> str:
    """Every module the entry imports is importable here: a helper left outside code.folder, or a package this
    machine has and the Kaggle image lacks, fails now rather than hours into a GPU session. A module entry is
    imported; a script is not run, its imports (any depth of the file, not executed) are looked up."""
    import ast
    import importlib
    import importlib.util
    import shlex
    import sys

    from relay.shared import spec

    code = spec.load(path).code
    if code is None or not code.entry:
        return "no code.entry"
    folder = Path(code.folder)
    sys.path.insert(0, str(folder))
    if ":" in code.entry and not code.entry.strip().endswith(".py"):
        module, _, function = code.entry.strip().partition(":")
        if not callable(getattr(importlib.import_module(module), function, None)):
            raise AttributeError(f"{module} has no function {function}")
        return f"{module} imported, {function} found"
    script = folder / shlex.split(code.entry)[0]
    sys.path.insert(0, str(script.parent))
    names = set()
    for node in ast.walk(ast.parse(script.read_text(), str(script))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    missing = sorted(n for n in names if importlib.util.find_spec(n) is None)
    if missing:
        raise ModuleNotFoundError(f"{script.name} imports {', '.join(missing)}, not found in the kernel: put it in"
                                  " code.folder, or install it with kaggle.pip")
    return f"{script.name}: {len(names)} imported modules found"


def _mount(ref: str, path: str) -> str:
    if not path or not Path(path).is_dir():
        raise FileNotFoundError(f"{ref} is not mounted (add it to the kernel's sources, and check that this "
                                "account can read it)")
    files = sum(len(names) for _, _, names in os.walk(path))
    if not files:
        raise FileNotFoundError(f"{ref} is mounted at {path} but holds no files")
    return f"{ref} at {path}: {files} files"


def _torch() -> str:
    import torch

    return f"torch {torch.__version__}, cuda {'available' if torch.cuda.is_available() else 'not available'}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relay.kernel.canary")
    parser.add_argument("spec")
    parser.add_argument("--out", required=True)
    parser.add_argument("--plan", required=True, metavar="FILE", help="the session plan the kernel script wrote")
    args = parser.parse_args(argv)
    from relay.kernel.session.mounts import mounted
    from relay.shared.session_plan import SessionPlan

    plan = SessionPlan.read(args.plan)
    checks = [_check("python", lambda: f"{platform.python_version()} on {platform.machine()}"),
              _check("torch", _torch),
              _check("spec and code", lambda: _spec(args.spec)),
              _check("imports", lambda: _imports(args.spec))]
    for ref in plan.canary or ():
        path = mounted(ref) or ""
        checks.append(_check("mount", lambda ref=ref, path=path: _mount(ref, path)))
    write_json(Path(args.out), {"code_version": code_version(), "checks": checks})
    for c in checks:
        print(f"relay doctor: {'ok' if c['ok'] else 'FAIL'} {c['name']}: {c['detail']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
