"""`relay status NAME|SPEC` reads where a relay stands from Kaggle alone (here the emulator, through the real
client): the handed-over sessions, the kernel's current session, the next step, the plan, the PNGs."""
from __future__ import annotations

import time

import pytest

from kaggle_fixtures import FAKE_KEY, USER
from relay.orchestrator import status
from relay.shared.errors import InputError
from relay_fixtures import STEPS_PER_SESSION


def _status(relay_env, target, tmp_path):
    lines = []
    assert status.report(target, relay_env.backend, tmp_path / "status", emit=lines.append) == 0
    return "\n".join(lines)


def test_status_by_name_and_by_spec_reads_the_relay_from_kaggle(relay_env, monkeypatch, tmp_path):
    monkeypatch.setenv("KAGGLE_USERNAME", USER)
    monkeypatch.setenv("KAGGLE_KEY", FAKE_KEY)
    # session 2 is told it runs on another CPU (the emulator's machine fault: another CPU cannot run here); its
    # floats are still this CPU's, but the status must say bit-identity is not promised across the two
    other = {"cpu": "Another CPU (told by the test)", "cpu_capability": "AVX-other"}
    relay_env.start(faults={"machine": {"pushes": [2], **other}})
    spec = relay_env.write_spec(**{"optim.max_steps": 2 * STEPS_PER_SESSION})
    with pytest.raises(InputError, match=f"no relay named toy-relay for Kaggle user {USER}"):
        status.report("toy-relay", relay_env.backend, tmp_path / "none")

    states = []
    while "pushed" not in states[-1:] or states.count("pushed") < 2:  # session 1 handed over, session 2 pushed
        states.append(relay_env.run_flow(monkeypatch, mode="tick", state_dir="tick")["state"])
        if states[-1] == "running":
            time.sleep(0.2)  # a schedule's interval, shortened; the loop ends on the second push, an event
        assert len(states) < 200, states
    out = _status(relay_env, "toy-relay", tmp_path)
    assert f"relay toy-relay (Kaggle user {USER}): 1 session(s) handed over, step {STEPS_PER_SESSION}/" in out
    assert f"kernel: {USER}/toy-relay-session v2 runs toy-relay-s002-a1" in out
    assert "next: wait toy-relay-s002-a1" in out or "next: harvest toy-relay-s002-a1" in out
    assert (tmp_path / "status" / "timeline.png").stat().st_size > 0
    # by name, the plan is made with the spec the relay's sessions run with, read from its kernel (issue 47)
    assert f"spec: the one its sessions run with (kernel {USER}/toy-relay-session's current version)" in out, out

    assert relay_env.run_flow(monkeypatch, mode="watch", state_dir="tick")["state"] == "done"
    out = _status(relay_env, str(spec), tmp_path)  # by spec: the same relay
    assert "2 session(s) handed over" in out and "next: done" in out
    here = relay_env.published_progress()["sessions"][0]["runtime"]
    assert (f"warning: session 2 ran on another environment than session 1: CPU {here['cpu']} -> {other['cpu']},"
            f" CPU kernels {here['cpu_capability']} -> {other['cpu_capability']}; bit-identity with an uninterrupted"
            f" run is not promised across them (from step {STEPS_PER_SESSION})") in out, out
    assert "toy-relay-s002-a1" in out  # the session table's second row
    assert (tmp_path / "status" / "curves.png").stat().st_size > 0
    assert "goodput " in out and "goodput chart: " in out  # the ledger's line and its picture
    assert (tmp_path / "status" / "goodput.png").stat().st_size > 0

    # `relay status DIR` on every folder the orchestrator wrote: a table, never a traceback
    from relay import cli

    local = relay_env.root / "tick" / "toy-relay"
    for folder in (local, local / "published"):
        assert cli.main(["status", str(folder)]) == 0
    assert (local / "published" / "goodput.png").stat().st_size > 0  # the published progress carries the charges


def test_status_refuses_what_is_neither_a_folder_a_spec_nor_a_name(tmp_path):
    with pytest.raises(InputError, match="neither a folder, a spec file nor a relay name"):
        status.report("Not A Name!", lambda: None, tmp_path)
