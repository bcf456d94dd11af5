"""The bring-your-own-code examples relayed end to end: Prefect flow -> Kaggle emulator -> session kernels that
carry the user's folder and run it. Sessions are bounded by steps (session.max_steps), one kernel of session
2 is SIGKILLed in the middle of a checkpoint save (tests/process_fixtures.MidSaveKiller: the kernel stops
itself inside the save through the RELAY_TEST_STOP_MID_SAVE seam, so the kill is torn on any machine; a save at
every step puts it in the save of a set step, the step before it committed), and the final weights equal an
uninterrupted `relay train` of the same spec.
"""
from __future__ import annotations

import pytest
import yaml

from byo_fixtures import CRASHING, relay_example_with_a_kill_mid_save, tiny_session_script

EXAMPLES = {  # optim.max_steps, session.max_steps: 2 sessions each, the one before the fault and the fault's own
    "byo-plain": {"optim.max_steps": 300, "session.max_steps": 150},
    "byo-recipe": {"optim.max_steps": 160, "session.max_steps": 80},
    "byo-accelerate": {"optim.max_steps": 32, "session.max_steps": 16},
    "byo-notebook": {"optim.max_steps": 60, "session.max_steps": 30},
}


@pytest.mark.parametrize("example", list(EXAMPLES))
def test_example_relays_to_the_weights_of_one_run_with_a_kill_mid_save(example, relay_env, reference, monkeypatch):
    relay_example_with_a_kill_mid_save(example, EXAMPLES[example], relay_env, reference, monkeypatch)


def _relay_script(relay_env, monkeypatch, name: str, script: str, session_steps: int, max_failed: int) -> str:
    """Relay a one-file user script of 90 steps on the emulator; the RelayFailed message it must end with."""
    import flows.one_relay as one_relay

    relay_env.start()
    folder = relay_env.root / name
    folder.mkdir()
    (folder / "train.py").write_text(script)
    spec = folder / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "name": name, "code": {"folder": ".", "entry": "train.py"}, "optim": {"max_steps": 90},
        "session": {"threads": 1, "max_steps": session_steps, "safety_margin": "0.5s"},
        "kaggle": {"session_timeout": "5m", "startup_overhead": "1s", "max_failed_sessions": max_failed}}))
    relay_env.spec = spec
    with pytest.raises(one_relay.RelayFailed) as failed:
        relay_env.run_flow(monkeypatch)
    return str(failed.value)


def test_relay_stops_on_a_traceback_in_user_code(relay_env, monkeypatch):
    message = _relay_script(relay_env, monkeypatch, "byo-crash", CRASHING, session_steps=30, max_failed=2)
    assert "code error: relay: error: code.entry train.py raised ValueError: bad column in my data" in message
    runs = relay_env.kernel_runs()
    assert [r.status for r in runs] == ["COMPLETE", "ERROR"]  # session 2 failed once: no retry
    assert relay_env.published_progress()["global_step"] == 30


# a script that stops stepping (a data loader that runs dry, a wrong condition) and exits 0
STALLING = tiny_session_script(train=False, before_step="if session.step == 30: break")


def test_relay_stops_when_user_code_makes_no_progress(relay_env, monkeypatch):
    message = _relay_script(relay_env, monkeypatch, "byo-stall", STALLING, session_steps=45, max_failed=1)
    assert "no progress: newest checkpoint is step 30, published 30" in message
    runs = relay_env.kernel_runs()
    assert len(runs) == 3  # session 1 (steps 0-30), then session 2 once and its one retry: not forever
    assert relay_env.published_progress()["global_step"] == 30
