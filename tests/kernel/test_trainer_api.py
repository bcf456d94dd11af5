"""The built-in Trainer is a driver of the Session API like any loop (issue 59): it reaches its Session only
through public calls (no private field, not the per-step books, not the core, no write into the session record),
the Session keeps no call that exists only for it, and the session runtime imports neither the Trainer nor the
recipes, even for type hints: imports flow one way, session/ <- recipes/ <- trainer.py."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRAINER = REPO / "relay" / "kernel" / "trainer.py"
INTERNALS = {"step_books", "core", "objects", "trackers"}  # the Session's own parts, not its API


def _session_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, attribute) of each `self.session.X` and `session.X` in the Trainer."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        if (isinstance(base, ast.Name) and base.id == "session") or (
                isinstance(base, ast.Attribute) and base.attr == "session"
                and isinstance(base.value, ast.Name) and base.value.id == "self"):
            found.append((node.lineno, node.attr))
    return found


def test_the_trainer_drives_its_session_through_public_calls_only():
    tree = ast.parse(TRAINER.read_text(), str(TRAINER))
    uses = _session_uses(tree)
    assert {"step_done", "should_stop", "save", "restore"} <= {attr for _, attr in uses}  # the probe sees them
    wrong = [f"trainer.py:{line} session.{attr}" for line, attr in uses
             if attr.startswith("_") or attr in INTERNALS]
    assert not wrong, wrong
    def a_record(node: ast.AST) -> bool:  # book.sessions[-1], or a name bound to it
        return isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) \
            and node.value.attr == "sessions" or isinstance(node, ast.Name) and node.id == "session"

    record_writes = [f"trainer.py:{n.lineno}" for n in ast.walk(tree)
                     if isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Store) and a_record(n.value)
                     or isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                     and n.func.attr in ("update", "setdefault") and a_record(n.func.value)]
    assert not record_writes, f"the session record is written through session.note(): {record_writes}"


def test_the_session_keeps_no_call_for_one_driver():
    from relay.kernel.session.api import Session

    assert not hasattr(Session, "decide")


def test_the_session_runtime_imports_neither_the_trainer_nor_the_recipes():
    wrong = []
    for path in sorted((REPO / "relay" / "kernel" / "session").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):  # TYPE_CHECKING imports too
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            wrong += [f"{path.relative_to(REPO)}:{node.lineno} {name}" for name in names
                      if name.startswith(("relay.kernel.trainer", "relay.kernel.recipes"))]
    assert not wrong, wrong
