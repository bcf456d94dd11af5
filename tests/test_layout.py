"""Imports go one way: what runs inside the Kaggle kernel (the session runtime and the recipes) never imports
the orchestrator (Prefect, flows/, tasks/, the Kaggle backend and emulator, the relay's decisions), so a kernel
needs neither Prefect nor the `kaggle` client, and orchestrator changes cannot break a running session."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KERNEL_SIDE = ["relay/session", "relay/recipes", "relay/integrations", "relay/usercode.py", "relay/spec.py"]
ORCHESTRATOR = ("prefect", "flows", "tasks", "kaggle", "kagglesdk", "relay.kaggle", "relay.chain", "relay.handoff",
                "relay.plan")


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_kernel_side_modules_never_import_the_orchestrator():
    offenders = []
    for folder in KERNEL_SIDE:
        root = REPO / folder
        files = sorted(root.rglob("*.py")) if root.is_dir() else [root]
        assert files, folder
        for path in files:
            for name in imported_modules(path):
                if any(name == o or name.startswith(o + ".") for o in ORCHESTRATOR):
                    offenders.append(f"{path.relative_to(REPO)} imports {name}")
    assert not offenders, "\n".join(offenders)
