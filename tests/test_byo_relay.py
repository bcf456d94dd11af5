"""The bring-your-own-code examples relayed end to end: Prefect flow -> Kaggle emulator -> session kernels that
carry the user's folder and run it. Sessions are bounded by steps (session.max_steps), one kernel of session
2 is SIGKILLed in the middle of a checkpoint save (tests/test_relay_faults.MidSaveKiller: the kernel stops
itself inside the save through the RELAY_TEST_STOP_MID_SAVE seam, so the kill is torn on any machine), and the final weights equal an uninterrupted `relay train` of the same spec.
"""
from __future__ import annotations

import pytest
import yaml

from test_byo import copy_example
from kaggle_fixtures import KERNEL_ENV
from test_relay_faults import MidSaveKiller

RELAY_SETTINGS = {"kaggle.session_timeout": "5m", "kaggle.startup_overhead": "1s", "kaggle.max_failed_sessions": 2,
                  "session.save_every": "0.02s", "session.safety_margin": "0.5s", "session.threads": 1}
EXAMPLES = {  # optim.max_steps, session.max_steps: 3 sessions each
    "byo-plain": {"optim.max_steps": 450, "session.max_steps": 150},
    "byo-recipe": {"optim.max_steps": 240, "session.max_steps": 80},
}


def _spec(relay_env, example: str, **overrides):
    spec = copy_example(example, relay_env.root / example, **RELAY_SETTINGS, **EXAMPLES[example], **overrides)
    data = yaml.safe_load(spec.read_text())
    data["code"]["folder"] = str(spec.parent)  # the reference run reads a copy of the spec elsewhere
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    relay_env.spec = spec
    return spec


@pytest.mark.parametrize("example", list(EXAMPLES))
def test_example_relays_to_the_weights_of_one_run_with_a_kill_mid_save(example, relay_env, reference, monkeypatch):
    per_session = EXAMPLES[example]["session.max_steps"]
    # the kernel of session 2 stops itself inside a save half-way through it (a seam of relay.kernel.session.checkpoint)
    relay_env.start(kernel_env={**KERNEL_ENV, "RELAY_TEST_STOP_MID_SAVE": str(per_session + per_session // 2)})
    spec = _spec(relay_env, example)
    reference.start(spec)
    killer = MidSaveKiller(relay_env)
    killer.start()
    try:
        summary = relay_env.run_flow(monkeypatch)
    finally:
        killer.done.set()
        killer.join(5)
    assert killer.error is None and killer.killed, killer.error
    assert summary["state"] == "done" and summary["step"] == EXAMPLES[example]["optim.max_steps"], summary
    runs = relay_env.kernel_runs()
    killed = [r for r in runs if r.status == "ERROR"]
    assert [r.version for r in killed] == [killer.killed["version"]] and "-9" in killed[0].failure
    progress = relay_env.published_progress()
    steps_per_session = EXAMPLES[example]["session.max_steps"]
    assert len(progress["sessions"]) >= 3 and all(
        s["step_end"] - s["step_start"] <= steps_per_session for s in progress["sessions"])
    assert summary["weights_sha256"] == progress["weights_sha256"] == reference.weights(spec)


CRASHING = '''
import torch, relay
session = relay.open_session()
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
session.register(model=model, optimizer=opt)
session.restore()
for idx in session.batches(64, 8):
    if session.step == 45:
        raise ValueError("bad column in my data")
    opt.zero_grad(); model(torch.randn(8, 4)).sum().backward(); opt.step()
    session.step_done()
session.close()
'''


def _relay_script(relay_env, monkeypatch, name: str, script: str, session_steps: int, max_failed: int) -> str:
    """Relay a one-file user script of 90 steps on the emulator; the RelayFailed message it must end with."""
    import flows.relay_flow as relay_flow

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
    with pytest.raises(relay_flow.RelayFailed) as failed:
        relay_env.run_flow(monkeypatch)
    return str(failed.value)


def test_relay_stops_on_a_traceback_in_user_code(relay_env, monkeypatch):
    message = _relay_script(relay_env, monkeypatch, "byo-crash", CRASHING, session_steps=30, max_failed=2)
    assert "code error: relay: error: code.entry train.py raised ValueError: bad column in my data" in message
    runs = relay_env.kernel_runs()
    assert [r.status for r in runs] == ["COMPLETE", "ERROR"]  # session 2 failed once: no retry
    assert relay_env.published_progress()["global_step"] == 30


STALLING = '''
import torch, relay
session = relay.open_session()
model = torch.nn.Linear(4, 1)
session.register(model=model)
session.restore()
for idx in session.batches(64, 8):
    if session.step == 30:
        break  # a script that stops stepping (a data loader that runs dry, a wrong condition) and exits 0
    session.step_done()
session.close()
'''


def test_relay_stops_when_user_code_makes_no_progress(relay_env, monkeypatch):
    message = _relay_script(relay_env, monkeypatch, "byo-stall", STALLING, session_steps=45, max_failed=1)
    assert "no progress: newest checkpoint is step 30, published 30" in message
    runs = relay_env.kernel_runs()
    assert len(runs) == 3  # session 1 (steps 0-30), then session 2 once and its one retry: not forever
    assert relay_env.published_progress()["global_step"] == 30
