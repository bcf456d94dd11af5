"""Running out of the weekly GPU quota mid-relay is a wait, not an error: a tick reports "waiting", the watch
flow waits for the quota (looking again at its refresh time) and then carries on to the same weights as an
uninterrupted run. The refresh is brought forward by the test when the watch says it waits (an event), so no
outcome depends on how fast the machine starts the flow. And a code error in a kernel stops the relay at once,
with the kernel's log tail in the exception."""
from __future__ import annotations

import logging
import time

import pytest

from relay_fixtures import STEPS_PER_SESSION, USER  # noqa: E402

TIME_SCALE = 10.0            # Kaggle seconds per wall second in this emulator
GPU_QUOTA_S = 3600.0         # Kaggle seconds (6 wall minutes): no session spends it on any machine by itself
QUOTA_PERIOD_S = 36000.0     # Kaggle seconds: 1 h of wall time; the test moves the refresh to now itself
HANG_GUARD_S = 300.0         # wall seconds for session 1 to be handed over (a hang guard, not a speed bound)


def spend_the_rest_of_the_quota(emu, owner: str) -> None:
    """Another GPU notebook of the same account used up this week's quota: one finished run in the emulator's
    quota ledger, as its runner records every run. An event, not a race against the session's speed."""
    now = time.time()
    emu.store.charge(owner, f"{owner}/another-notebook", 1, now - GPU_QUOTA_S / TIME_SCALE, now, TIME_SCALE)


def test_quota_exhaustion_waits_for_the_refresh_and_continues(relay_env, reference, monkeypatch):
    emu = relay_env.start(time_scale=TIME_SCALE, gpu_quota_s=GPU_QUOTA_S, quota_period_s=QUOTA_PERIOD_S)
    spec = relay_env.write_spec(**{"optim.max_steps": 2 * STEPS_PER_SESSION, "kaggle.session_timeout": "1h"})
    reference.start(spec)

    # tick until the first session is pushed; then the account's quota is spent (by another notebook) while it
    # runs, and the tick that hands it over finds the quota spent for the next push and reports "waiting"
    states, deadline = [], time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        ticked = relay_env.run_flow(monkeypatch, mode="tick")
        states.append(ticked["state"])
        if ticked["state"] == "pushed":
            assert relay_env.backend().quota().remaining_s > 0  # the push found quota left
            spend_the_rest_of_the_quota(emu, USER)
        elif ticked["state"] != "running":
            break
        time.sleep(0.3 if ticked["state"] == "running" else 0)  # a poll interval
    assert states[-1] == "waiting" and states.count("pushed") == 1, states
    assert ticked["step"] == STEPS_PER_SESSION and len(relay_env.published_progress()["sessions"]) == 1
    (session_1,) = [e for e in emu.store.data["quota"] if e["kernel"] == relay_env.kernel]
    assert session_1["kaggle_seconds"] < GPU_QUOTA_S  # session 1 alone would not have spent it: the other notebook did
    assert relay_env.backend().quota().remaining_s == 0
    assert [r.run_id for r in relay_env.kernel_runs()] == ["toy-relay-s001-a1"]
    # waiting is idempotent: another tick neither pushes nor fails
    assert relay_env.run_flow(monkeypatch, mode="tick")["state"] == "waiting"

    # watch: it says it waits for the refresh (an hour away); then the week ends (the test moves the emulator's
    # quota window), and the watch, looking at the quota again, pushes session 2 and finishes
    import flows.one_relay as one_relay

    monkeypatch.setattr(one_relay, "QUOTA_RECHECK_S", 0.3)
    refreshed = []

    def end_the_week(message: str) -> None:
        if "quota spent; waiting until" in message and not refreshed:
            with emu.store.lock:
                emu.store.data["created"] = time.time() - QUOTA_PERIOD_S / TIME_SCALE
            refreshed.append(time.time())

    warnings = _Records(end_the_week)
    logging.getLogger("prefect.flow_runs").addHandler(warnings)  # the flow's run logger does not propagate
    try:
        watched = relay_env.run_flow(monkeypatch, mode="watch")
    finally:
        logging.getLogger("prefect.flow_runs").removeHandler(warnings)
    assert watched["state"] == "done" and watched["step"] == 2 * STEPS_PER_SESSION, watched
    runs = relay_env.kernel_runs()
    assert [r.run_id for r in runs] == ["toy-relay-s001-a1", "toy-relay-s002-a1"]
    assert all(r.status == "COMPLETE" for r in runs)
    assert refreshed and runs[1].pushed >= refreshed[0], (runs[1].pushed, refreshed)  # not before the refresh
    assert watched["weights_sha256"] == reference.weights(spec)


def test_a_code_error_in_a_kernel_stops_the_relay_with_the_log_tail(relay_env, monkeypatch):
    from flows.one_relay import RelayFailed

    relay_env.start()
    # 8 x 4 samples per step from a training set of 16: the session runtime raises ValueError at start
    relay_env.write_spec(**{"name": "toy-broken", "params.n_train": 16, "optim.grad_accum": 4})
    with pytest.raises(RelayFailed) as failed:
        relay_env.run_flow(monkeypatch, mode="watch")
    message = str(failed.value)
    # (a ValueError with its traceback, or `relay train`'s one-line "relay: error:" report of an InputError)
    first, _, tail = message.partition("\n--- log tail ---\n")
    assert first.startswith("session 1 failed with a code error: ") and "micro_batch x optim.grad_accum (32)" in first
    assert "run toy-broken-s001-a1" in tail and "is larger than the training set (16 samples)" in tail
    runs = relay_env.kernel_runs()
    assert [(r.run_id, r.status) for r in runs] == [("toy-broken-s001-a1", "ERROR")]  # not retried


class _Records(logging.Handler):
    def __init__(self, on_message):
        super().__init__(logging.WARNING)
        self.on_message = on_message

    def emit(self, record: logging.LogRecord) -> None:
        self.on_message(record.getMessage())
