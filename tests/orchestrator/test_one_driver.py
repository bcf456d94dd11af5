"""One relay driver (issue 59): both flows push through one loop, keep a relay's state in one place, and count an
account's cap one way, from the spec. Read from the source: a second push loop or a second cap fails here."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DRIVERS = sorted((REPO / "flows").glob("*.py")) + sorted((REPO / "tasks").glob("*.py"))


def _calls(pattern: str) -> list:
    return [f"{p.relative_to(REPO)}:{n}" for p in DRIVERS for n, line in enumerate(p.read_text().splitlines(), 1)
            if re.search(pattern, line) and not line.lstrip().startswith("#")]


def test_one_push_loop():
    """The session's push (relay_step.push, then the Kaggle push task) is called from one function of one module."""
    assert [c.split(":")[0] for c in _calls(r"relay_step\.push\(")] == ["flows/relay_rounds.py"], _calls(r"relay_step\.push\(")
    users = {c.split(":")[0] for c in _calls(r"push_in_turn\(")}
    assert users <= {"flows/relay_rounds.py", "flows/one_relay.py"}, users


def test_one_state_per_relay():
    """The relay's state is the Relay of flows/relay_rounds.py: no flow keeps a State of its own beside it."""
    assert not _calls(r"^\s*state\s*=\s*(State\.NEW\b|move\()"), _calls(r"^\s*state\s*=\s*(State\.NEW\b|move\()")
    assert _calls(r"^class Relay\b") == [f"flows/relay_rounds.py:{_line('flows/relay_rounds.py', 'class Relay')}"]


def test_the_cap_is_counted_one_way_from_the_spec():
    """No flow parameter sets the cap (the `relays` flow's `cap` is read by nobody) and no local count of sessions in
    flight decides a push: AccountSessions.take asks the account's limit (Prefect's, or LocalLimit's without one)."""
    source = (REPO / "tasks" / "account_slots.py").read_text()
    take = source[source.index("    def take(self, relay"):source.index("    def failed(")]
    assert ">= self.sessions" not in take and "in_flight" not in take.replace("r not in self._in_flight", "")
    flow = (REPO / "flows" / "relays_sharing_quota.py").read_text()
    assert "AccountSessions(backend.username, sessions_cap)" in flow and "account_sessions" in flow
    assert "AccountSessions(backend.username, cap)" not in flow


def _line(path: str, text: str) -> int:
    return next(n for n, line in enumerate((REPO / path).read_text().splitlines(), 1) if line.startswith(text))
