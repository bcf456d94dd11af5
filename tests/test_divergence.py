"""A session stops itself when its loss blows up (session.stop_on_divergence), saving; the relay hands that
checkpoint over and stops with the reason instead of spending another session on it."""
from __future__ import annotations

import json
import math

import pytest

from relay.kernel.session.divergence import DivergenceGuard


def test_the_guard_needs_patience_and_ignores_a_single_spike():
    guard = DivergenceGuard(factor=10, window=10, patience=3, warmup=5)
    assert all(guard.update(s, 1.0) is None for s in range(10))
    assert guard.update(10, 50.0) is None and guard.update(11, 1.0) is None  # one spike: no stop
    assert guard.update(12, 50.0) is None and guard.update(13, 60.0) is None
    why = guard.update(14, 70.0)
    assert why.startswith("the loss diverged at step 14: 70 for 3 steps in a row, over 10x the median")
    nan = DivergenceGuard(patience=2)
    assert nan.update(1, math.nan) is None and "nan" in nan.update(2, math.inf).replace("inf", "nan")


BLOWING_UP = '''
import torch, relay
session = relay.open_session()
model = torch.nn.Linear(4, 1)
session.register(model=model)
session.restore()
for idx in session.batches(64, 8):
    loss = torch.tensor(1.0 if session.step < 40 else 1000.0)  # the loss blows up at step 40
    session.step_done(loss=loss)
session.close()
'''


def test_a_session_stops_itself_on_divergence_and_the_relay_says_why(relay_env, monkeypatch):
    import yaml

    import flows.relay_flow as relay_flow

    relay_env.start()
    folder = relay_env.root / "diverge"
    folder.mkdir()
    (folder / "train.py").write_text(BLOWING_UP)
    spec = folder / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "diverge", "code": {"folder": ".", "entry": "train.py"}, "optim": {"max_steps": 200},
        "session": {"threads": 1, "max_steps": 100, "safety_margin": "0.5s"},
        "kaggle": {"session_timeout": "5m", "startup_overhead": "1s"}}))
    relay_env.spec = spec
    with pytest.raises(relay_flow.RelayFailed) as failed:
        relay_env.run_flow(monkeypatch)
    assert "session 1 stopped itself: the loss diverged at step 43: 1000 for 3 steps in a row" in str(failed.value)
    assert "Its checkpoint at step 43 is handed over" in str(failed.value)
    assert len(relay_env.kernel_runs()) == 1  # no second session spent on it
    progress = relay_env.published_progress()
    assert progress["stop_reason"] == "diverged" and progress["global_step"] == 43
    assert json.dumps(progress["sessions"][-1]["diverged"])
