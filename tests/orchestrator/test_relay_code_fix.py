"""After a code error in the user's script (session 2 raises), the relay stops and says so; run again unchanged it
stops again without pushing anything; once the script is fixed it pushes a new attempt of session 2, from the
same checkpoint, and finishes. Through the `relay` flow and the `relays` flow alike: both carry out
chain.after_handover in one per-relay step (relay/orchestrator/relay_step.py)."""
from __future__ import annotations

import pytest
import yaml

from byo_fixtures import CRASHING, FINISHING


def test_a_fixed_script_goes_on_after_a_code_error(relay_env, both_flows, monkeypatch):
    from relay.orchestrator.relay_context import RelayFailed

    relay_env.start()
    folder = relay_env.root / "byo-fix"
    folder.mkdir()
    script = folder / "train.py"
    script.write_text(CRASHING)  # raises at step 45: in session 2 (30 steps a session)
    relay_env.spec = folder / "spec.yaml"
    relay_env.spec.write_text(yaml.safe_dump({
        "name": "byo-fix", "code": {"folder": ".", "entry": "train.py"}, "optim": {"max_steps": 90},
        "session": {"threads": 1, "max_steps": 30, "safety_margin": "0.5s"},
        "kaggle": {"session_timeout": "5m", "startup_overhead": "1s", "max_failed_sessions": 2}}))

    for unchanged in (False, True):  # the second run is the same script again: nothing is pushed
        with pytest.raises(RelayFailed) as failed:
            relay_env.run_flow(monkeypatch)
        message = str(failed.value)
        assert "session 2 failed with a code error: relay: error: code.entry train.py raised ValueError: bad column" \
            in message, message
        assert "the code and spec are unchanged since that push" in message, message
        assert [r.run_id for r in relay_env.kernel_runs()] == ["byo-fix-s001-a1", "byo-fix-s002-a1"], unchanged

    script.write_text(FINISHING)  # the fix
    done = relay_env.run_flow(monkeypatch)
    assert done["state"] == "done" and done["step"] == 90, done
    runs = relay_env.kernel_runs()
    assert [r.run_id for r in runs] == ["byo-fix-s001-a1", "byo-fix-s002-a1", "byo-fix-s002-a2", "byo-fix-s003-a1"]
    assert [r.status for r in runs] == ["COMPLETE", "ERROR", "COMPLETE", "COMPLETE"]
    # the new attempt of session 2 started from session 1's checkpoint
    assert [s["step_start"] for s in relay_env.published_progress()["sessions"]] == [0, 30, 60]
