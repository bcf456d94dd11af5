"""The package's shape, read from its own imports. The folders say on which side of the wire a module
runs: relay/shared (what crosses it: the spec, the checkpoint manifest, progress records, atomic writes), relay/kernel
(inside the Kaggle session), relay/orchestrator (where Prefect runs), relay/emulator (Kaggle's local double).
Each side imports only itself and the shared part; flows/ and tasks/ are shells over the orchestrator side; the
faces (the commands: relay/cli.py, commands.py, launch.py, doctor.py, front_door.py; the public surface user code imports:
relay/__init__.py, hf.py, lightning.py, accelerate.py and the paths documented before the split) may use both
sides, and nothing imports a face but a face (and the flows, the front door relay.front_door). A kernel needs
neither Prefect nor the `kaggle` client, and orchestrator changes cannot break a running session."""
from __future__ import annotations

import ast
import functools
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KERNEL_SIDE = ["relay/kernel", "relay/shared"]
ORCHESTRATOR = ("prefect", "flows", "tasks", "kaggle", "kagglesdk", "relay.orchestrator", "relay.emulator")
SIDES = ("relay.shared", "relay.kernel", "relay.orchestrator", "relay.emulator")
COMMANDS = {"relay.__main__", "relay.cli", "relay.commands", "relay.launch", "relay.submit", "relay.doctor", "relay.front_door"}
# What user code imports (docs/your-code.md), and the paths documented before the package split (deprecated).
# It runs inside the session: it ships in the kernel bundle and imports only the kernel side and the shared part.
PUBLIC = {"relay", "relay.hf", "relay.lightning", "relay.accelerate", "relay.recipes", "relay.integrations",
          "relay.integrations.hf", "relay.integrations.lightning"}
FACES = COMMANDS | PUBLIC
# what each part may import, besides itself
MAY_IMPORT = {"relay.shared": (), "relay.kernel": ("relay.shared",), "relay.orchestrator": ("relay.shared",),
              "relay.emulator": ("relay.shared",),
              "flows": ("relay.orchestrator", "relay.shared", "relay.front_door", "tasks"),
              "tasks": ("relay.orchestrator", "relay.shared")}


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


def test_the_orchestrator_knows_nothing_of_prefect():
    """relay/orchestrator is the relay's algorithm; Prefect is the flows' and tasks' (and the CLI's, relay/submit.py)."""
    import re

    found = [f"{p.relative_to(REPO)}:{n}" for p in sorted((REPO / "relay" / "orchestrator").rglob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if re.match(r"\s*(from|import)\s+prefect\b", line)]
    assert not found, found


def test_the_orchestrator_never_imports_torch(spawns_processes):
    """The flows, the CLI and the spec loader (every built-in example spec) run without torch or anything else
    of the `[train]` extra (tests/orchestrator/test_tick.py runs whole ticks with them blocked): a GitHub-hosted tick stays
    small, and the handoff's peak RSS stays under its 300 MB goal (bench/bench_handoff.py)."""
    import subprocess
    import sys

    code = """
import sys
from pathlib import Path
import flows.one_relay, flows.relays_sharing_quota, relay.cli, relay.launch, relay.doctor, relay.front_door, tasks.relays_artifacts
import relay.orchestrator.handoff, relay.orchestrator.plan, relay.submit, relay.orchestrator.status
import relay.orchestrator.restore, relay.orchestrator.live_progress, relay.orchestrator.report
from relay.cli import TRAINING_STACK
from relay.shared import spec
for path in sorted(Path("examples").glob("*.yaml")):
    spec.load(path).recipe_params()
# the base install (pyproject's dependencies) has none of the training stack
print([m for m in TRAINING_STACK if m in sys.modules and m != "PIL"] or False)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False", "an orchestrator module imports torch at module level"


@functools.lru_cache(maxsize=None)
def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its body (lazy imports too: a cycle through a
    function's import is still a cycle in the design). Read once per process: the tests only read it."""
    modules = {}
    for base in ("relay", "flows", "tasks"):
        for path in (REPO / base).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def owner(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for module, path in modules.items():
        targets = set()
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):  # `if TYPE_CHECKING:` imports name a type in annotations, run nothing
            if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
                node.body = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets |= {owner(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                subs = {f"{node.module}.{a.name}" for a in node.names}
                # `from relay.orchestrator.kaggle import backend` imports the submodule, not the package's own code
                targets |= {owner(n) for n in subs} if subs <= modules.keys() else {owner(node.module)} | {
                    owner(n) for n in subs}
        graph[module] = {t for t in targets if t and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while not component or w != v:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def part_of(module: str) -> str:
    for part in (*SIDES, "flows", "tasks"):
        if module == part or module.startswith(part + "."):
            return part
    return module  # a face


def test_each_side_imports_only_itself_and_the_shared_part():
    """Every arrow of the import graph (lazy imports too) points within a part or down to what it may use."""
    wrong = []
    for module, targets in import_graph().items():
        part = part_of(module)
        for target in targets:
            into = part_of(target)
            if part in FACES:
                continue  # a face may use anything
            if into != part and into not in MAY_IMPORT[part]:
                wrong.append(f"{module} -> {target}")
    assert not wrong, "\n".join(sorted(wrong))


def test_every_module_lives_on_a_side():
    """A new module goes into a side's folder (or is a face, by name in FACES): the folder names alone tell a
    newcomer where a module runs."""
    loose = [m for m in import_graph() if part_of(m) not in (*SIDES, "flows", "tasks") and m not in FACES]
    assert not loose, loose


def module_file(module: str) -> str:
    path = REPO / Path(*module.split("."))
    return f"{module.replace('.', '/')}/__init__.py" if path.is_dir() else f"{module.replace('.', '/')}.py"


def test_the_kernel_bundle_carries_the_kernel_side_the_shared_part_and_the_public_surface():
    """Inside the session the user's code imports the public surface (relay.hf, relay.Recipe, and the paths
    documented before the split): a module of it missing from the bundle fails the user's script there."""
    import io
    import zipfile

    from relay.orchestrator.kaggle.bundle import build_bundle

    names = zipfile.ZipFile(io.BytesIO(build_bundle().data)).namelist()
    entered_by = {"relay/__main__.py", "relay/cli.py", "relay/commands.py", "relay/front_door.py"}  # `python -m relay train`
    public = {module_file(m) for m in PUBLIC}
    assert entered_by | public <= set(names), sorted(entered_by | public - set(names))
    other = [n for n in names if n not in entered_by | public and not n.startswith(("relay/shared/", "relay/kernel/"))]
    assert not other, other
    assert any(n.startswith("relay/kernel/session/") for n in names) and "relay/shared/spec.py" in names


def test_the_public_surface_imports_only_what_ships_in_the_session():
    graph = import_graph()
    assert PUBLIC <= graph.keys(), sorted(PUBLIC - graph.keys())
    import relay

    # relay/__init__.py imports its names lazily by module name: those names, as the arrows they are
    lazy = {("relay", module) for module in relay._SURFACE.values()}
    wrong = [f"{m} -> {t}" for m, t in {(m, t) for m in PUBLIC for t in graph[m]} | lazy
             if t not in PUBLIC and part_of(t) not in ("relay.kernel", "relay.shared")]
    assert not wrong, wrong


def test_inside_the_kernel_the_session_runtime_is_the_bottom():
    """relay/kernel/session/ is the runtime both session paths use; recipes and integrations build on it; the
    built-in runner (kernel/run.py), the user's code (usercode.py, entry.py), verify and canary sit on top."""
    graph = import_graph()
    layers = {"relay.kernel.session": ("relay.kernel.session",),
              "relay.kernel.recipes": ("relay.kernel.recipes", "relay.kernel.session"),
              "relay.kernel.integrations": ("relay.kernel.integrations", "relay.kernel.session")}
    wrong = [f"{m} -> {t}" for m, targets in graph.items() for layer, allowed in layers.items()
             if m == layer or m.startswith(layer + ".")
             for t in targets if t.startswith("relay.kernel") and not t.startswith(allowed)]
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_cycles():
    assert not cycles(import_graph()), [sorted(c) for c in cycles(import_graph())]


def test_both_session_paths_keep_their_books_through_one_core():
    """The Session API (session/api.py) is the one client of session/core.py, and the built-in runner
    (kernel/run.py) drives a Session as a user's loop does: nothing else in the kernel loads, saves or writes
    progress.json and the session record itself."""
    core_calls = {("checkpoint", "CheckpointWriter"), ("checkpoint", "load_resume"),
                  ("books", "write_progress"), ("books", "open_record"), ("books", "update_record")}
    owners = {"relay/kernel/session/core.py", "relay/kernel/session/checkpoint.py", "relay/kernel/session/books.py"}
    found = []
    for path in sorted((REPO / "relay" / "kernel").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel in owners:
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and (node.func.value.id, node.func.attr) in core_calls):
                found.append(f"{rel}:{node.lineno} {node.func.value.id}.{node.func.attr}")
    assert not found, found
    assert "relay.kernel.session.core" in imported_modules(REPO / "relay/kernel/session/api.py")
    assert "relay.kernel.session.api" in imported_modules(REPO / "relay/kernel/run.py")


IMPORT_ALL = r"""
import ast, importlib, importlib.util, pkgutil, sys
from pathlib import Path
import relay
names = [m.name for m in pkgutil.walk_packages(relay.__path__, "relay.")
         if not m.name.endswith("__main__") and m.name != "relay.shared.warm_python"]  # the zygote runs at import
names += [f"{d}.{p.stem}" for d in ("tasks", "flows") for p in sorted(Path(d).glob("*.py"))]
failed = []
for name in names:
    try:
        importlib.import_module(name)
    except Exception as err:
        failed.append(f"{name}: {err!r}")
# imports inside functions too: every `from relay... import x` (or tasks, flows) names what that module has
for path in sorted([*Path("relay").rglob("*.py"), *Path("tasks").glob("*.py"), *Path("flows").glob("*.py")]):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.ImportFrom) and node.module and not node.level
                and node.module.split(".")[0] in ("relay", "tasks", "flows")):
            continue
        if node.module == "relay.shared.warm_python":
            continue
        try:
            module = importlib.import_module(node.module)
        except Exception as err:
            failed.append(f"{path}:{node.lineno} from {node.module}: {err!r}")
            continue
        for alias in node.names:
            if alias.name != "*" and not hasattr(module, alias.name) \
                    and importlib.util.find_spec(f"{node.module}.{alias.name}") is None:
                failed.append(f"{path}:{node.lineno} from {node.module} import {alias.name}: no such name")
print("\n".join(failed) or f"{len(names)} imported")
sys.exit(1 if failed else 0)
"""


def test_every_module_imports(spawns_processes):
    """A name imported from a module that no longer has it (a rename half done) fails here, not in the one test
    or command that happens to import it, even when the import sits inside a function. In a fresh interpreter:
    what an earlier test imported cannot hide it."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", IMPORT_ALL], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
