"""Imports go one way: what runs inside the Kaggle kernel (the session runtime and the recipes) never imports
the orchestrator (Prefect, flows/, tasks/, the Kaggle backend and emulator, the relay's decisions), so a kernel
needs neither Prefect nor the `kaggle` client, and orchestrator changes cannot break a running session."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KERNEL_SIDE = ["relay/session", "relay/recipes", "relay/integrations", "relay/usercode.py", "relay/spec.py",
               "relay/canary.py", "relay/tracking_spec.py"]
ORCHESTRATOR = ("prefect", "flows", "tasks", "kaggle", "kagglesdk", "relay.kaggle", "relay.chain", "relay.handoff",
                "relay.plan", "relay.tracking_handoff", "relay.wandb_file")


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


def test_the_orchestrator_never_imports_torch():
    """The flows, the CLI and the spec loader (every built-in example spec) run without torch: a GitHub-hosted
    tick stays small, and the handoff's peak RSS stays under its 300 MB goal (bench/bench_handoff.py)."""
    import subprocess
    import sys

    code = """
import sys
from pathlib import Path
import flows.relay_flow, flows.relays_flow, relay.cli, relay.handoff, relay.plan, tasks.relays_artifacts
from relay import spec
for path in sorted(Path("examples").glob("*.yaml")):
    spec.load(path).recipe_params()
print("torch" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False", "an orchestrator module imports torch at module level"
