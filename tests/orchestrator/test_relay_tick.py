"""`tick` (observe, do what needs no waiting: a hand-over, then the next push; return) repeated until done
reaches the same end as `watch`: the same sessions, the same final weights, which are those of an uninterrupted
run."""
from __future__ import annotations

import time


from relay_fixtures import STEPS_PER_SESSION, spec_dict  # noqa: E402

MAX_STEPS = 2 * STEPS_PER_SESSION  # two sessions each way (each kernel costs ~10-20 s of start-up here)


def test_tick_reaches_the_same_end_as_watch(relay_env, reference, monkeypatch, tmp_path):
    relay_env.start()
    spec = relay_env.write_spec(**{"optim.max_steps": MAX_STEPS})
    reference.start(spec)

    # watch: one flow run loops until the work is done
    watched = relay_env.run_flow(monkeypatch, mode="watch", state_dir="watch")
    assert watched["state"] == "done", watched
    watch_runs = relay_env.kernel_runs()
    watch_progress = relay_env.published_progress()

    # tick: a fresh relay (new emulator, so nothing carries over), advanced by one short flow run at a time
    relay_env.root = tmp_path / "relay-tick"
    relay_env.root.mkdir()
    relay_env.start()
    relay_env.write_spec(**{"optim.max_steps": MAX_STEPS})
    states, deadline = [], time.monotonic() + 600  # a hang guard, not a speed bound
    while time.monotonic() < deadline:
        ticked = relay_env.run_flow(monkeypatch, mode="tick", state_dir="tick")
        states.append(ticked["state"])
        if ticked["state"] == "done":
            break
        assert ticked["state"] in ("pushed", "running"), ticked
        if ticked["state"] == "running":
            time.sleep(0.5)  # a cron schedule's interval, shortened
    assert states[-1] == "done", states
    tick_runs = relay_env.kernel_runs()
    tick_progress = relay_env.published_progress()

    # every session was pushed by one tick; the tick that handed a session over pushed the next one (no tick
    # between a session's end and the next push), the last one's hand-over ended the relay
    sessions = MAX_STEPS // STEPS_PER_SESSION
    assert states.count("pushed") == sessions and states[0] == "pushed", states
    # the same end
    expected = [f"toy-relay-s{i:03d}-a1" for i in range(1, sessions + 1)]
    assert [r.run_id for r in watch_runs] == [r.run_id for r in tick_runs] == expected
    assert all(r.status == "COMPLETE" for r in watch_runs + tick_runs)
    for progress in (watch_progress, tick_progress):
        assert progress["status"] == "done" and progress["global_step"] == MAX_STEPS
        assert [s["run_id"] for s in progress["sessions"]] == expected
        assert [s["step_end"] for s in progress["sessions"]] == [STEPS_PER_SESSION * i for i in range(1, sessions + 1)]
    assert ticked["weights_sha256"] == watched["weights_sha256"] == tick_progress["weights_sha256"]
    assert ticked["sessions"] == watched["sessions"] == sessions
    assert watched["weights_sha256"] == reference.weights(spec)
    assert spec_dict()["session"]["threads"] == 1  # exact resume needs one thread count throughout
