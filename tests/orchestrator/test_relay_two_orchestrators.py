"""Two orchestrators on one relay (issue 20): a Prefect schedule and a GitHub Actions tick firing together, a
laptop beside both, a retried tick job. The emulator adds request latency, so their check-then-act steps
interleave as over a real network. Whatever the mix: each session pushed once, each checkpoint published
once, the weights of one uninterrupted run; a SIGKILLed holder of a step's claim delays the relay by at most
its lease. Also: under the pessimistic status lag (pinned requests lie too) each session is pushed once.

Every proof is an outcome (what Kaggle holds at the end) or is triggered by an event (a dataset version
created); no assertion depends on how fast the machine is. The toy spec's lease is 10 s.
"""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from relay.orchestrator.kaggle.lease import Lease

from relay_fixtures import STEPS_PER_SESSION, USER, DatasetProcessing, wait_for  # noqa: E402

SESSIONS = 2
MAX_STEPS = SESSIONS * STEPS_PER_SESSION
RUN_IDS = [f"toy-relay-s{i:03d}-a1" for i in range(1, SESSIONS + 1)]


def latency(seed: int) -> dict:
    return {"seed": seed, "latency": {"min_s": 0.005, "max_s": 0.06}}


def _log(env, name: str, tail: int = 6000) -> str:
    path: Path = env.root / name
    return path.read_text()[-tail:] if path.exists() else "(no log)"


def _summary(env, name: str) -> dict:
    return json.loads(_log(env, name, 10 ** 7).split("RELAY-SUMMARY ", 1)[1].splitlines()[0])


def _claims(emu) -> dict:
    """lease dataset slug -> its lease.json (holder, key, expiry)."""
    found = {}
    with emu.store.lock:
        refs = [r for r in emu.store.datasets if "-lease-" in r]
    for ref in refs:
        found[ref.split("/", 1)[1]] = json.loads((emu.store.dataset_dir(ref, 1) / "lease.json").read_text())
    return found


def assert_one_run(env, reference, spec) -> None:
    """Each session pushed once and complete, each handed over once, the uninterrupted run's weights."""
    runs = env.kernel_runs()
    assert [r.run_id for r in runs] == RUN_IDS, runs
    assert all(r.status == "COMPLETE" for r in runs), runs
    published = [json.loads((env.emu.store.dataset_dir(env.ckpt, v["number"]) / "progress.json").read_text())
                 for v in env.ckpt_versions()]
    assert [p["run_id"] for p in published] == RUN_IDS
    model = (env.emu.store.datasets.get(f"{USER}/toy-relay-model") or {}).get("versions", [])
    assert len(model) == 1, model
    assert published[-1]["status"] == "done" and published[-1]["global_step"] == MAX_STEPS
    assert published[-1]["weights_sha256"] == reference.weights(spec)


@pytest.mark.parametrize("first, second, second_locked, seed, flows", [
    ("watch", "watch", True, 1, ("relay", "relay")),            # two deployments (or a person) on one server
    ("tick-loop", "tick-loop", False, 2, ("relays", "relays")),  # a Prefect schedule and a GitHub Actions cron
    ("watch", "tick-loop", False, 3, ("relay", "relays")),       # a laptop's watch beside a scheduled round
    ("watch", "tick-loop", False, 4, ("relays", "relay")),       # a round beside a scheduled tick
])  # the first always takes the Prefect step lock; each flow meets the other and itself, watching and ticking
def test_two_orchestrators_push_and_publish_each_step_once(relay_env, reference, first, second, second_locked,
                                                           seed, flows):
    emu = relay_env.start(faults=latency(seed))
    spec = relay_env.write_spec(**{"optim.max_steps": MAX_STEPS})
    reference.start(spec)
    a = relay_env.flow_process(mode=first, state_dir="orch-a", seed=seed, log_name="a.log", step_lock=True,
                               flow=flows[0])
    b = relay_env.flow_process(mode=second, state_dir="orch-b", seed=seed + 100, log_name="b.log",
                               step_lock=second_locked, flow=flows[1])
    assert a.wait(400) == 0, _log(relay_env, "a.log")
    assert b.wait(400) == 0, _log(relay_env, "b.log")

    assert_one_run(relay_env, reference, spec)
    assert _summary(relay_env, "a.log")["weights_sha256"] == _summary(relay_env, "b.log")["weights_sha256"]
    # every push and every hand-over was claimed on Kaggle first
    keys = {c["key"] for c in _claims(emu).values()}
    assert {f"push-{r}" for r in RUN_IDS} | {f"handover-{r}" for r in RUN_IDS} <= keys, keys


@pytest.fixture
def drop_step_lock(prefect_api):
    """A killed holder's slot would hold up the session's later tests for a lease (60 s) each."""
    yield
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.delete_global_concurrency_limit_by_name("relay-toy-relay")
        except ObjectNotFound:  # nobody left it taken (the holder died before creating it, or it was freed)
            pass


def test_a_killed_claim_holder_on_this_machine_is_taken_over_at_once_never_stops_it(relay_env, both_flows,
                                                                                   reference, drop_step_lock):
    emu = relay_env.start(faults=latency(7), dataset_processing_delay=3600)
    # a lease far longer than B's bounded wait: B finishes only if it takes the claim over at once
    spec = relay_env.write_spec(**{"optim.max_steps": MAX_STEPS, "kaggle.lease": "10m"})
    reference.start(spec)
    processing = DatasetProcessing(emu)
    processing.held.add((relay_env.ckpt, 1))  # session 1's checkpoint version stays unconfirmed
    processing.start()

    # A (a Prefect tick loop) claims session 1's hand-over, creates the checkpoint version and is SIGKILLed
    # while waiting for Kaggle to process it: it dies holding both guards, the Prefect step lock (B's wait for
    # it is bounded) and the claim on Kaggle
    a = relay_env.flow_process(mode="tick-loop", state_dir="orch-a", seed=7, log_name="a.log", step_lock=True)
    wait_for(lambda: relay_env.ckpt_versions() or a.poll() is not None, 300, "session 1's checkpoint version")
    os.killpg(a.pid, signal.SIGKILL)
    assert a.wait() == -signal.SIGKILL, _log(relay_env, "a.log")
    handover = Lease(relay_env.backend(), "toy-relay", 10).slug(f"handover-{RUN_IDS[0]}", 1)
    dead = _claims(emu)[handover]
    taken_over = handover[:-1] + "2"

    # B (a Prefect watch) sees session 1 not handed over (its version is unconfirmed), finds A's claim, waits
    # is a process of this machine that no longer exists, takes it over at once (generation 2), finds A's version
    # by its marker and finishes the relay
    b = relay_env.flow_process(mode="watch", state_dir="orch-b", seed=8, log_name="b.log", step_lock=True)
    wait_for(lambda: taken_over in _claims(emu) or b.poll() is not None, 300, "the claim taken over")
    processing.held.clear()
    assert b.wait(400) == 0, _log(relay_env, "b.log")
    processing.done.set()
    assert_one_run(relay_env, reference, spec)
    claims = _claims(emu)
    taken = claims[taken_over]
    assert taken["key"] == dead["key"] and taken["holder"] != dead["holder"], (dead, taken)
    assert dead["machine"] == taken["machine"] and dead["pid"] != taken["pid"]
    # taken before the dead holder's lease ended: its process is gone from this machine (another machine's waits)
    assert taken["expires"] - 600 < dead["expires"] - 0.5


def test_pessimistic_status_lag_pushes_each_session_once(relay_env, both_flows, reference, monkeypatch):
    # after each push the first 8 status/output calls on the new version, pinned or not, answer the previous
    # version (its final state and its files): the relay reads the stale output as the lag, looks again, and
    # never pushes a second attempt while the first runs
    emu = relay_env.start(faults={"seed": 5, "status_lag": {"calls": 8, "pinned": True}})
    spec = relay_env.write_spec(**{"optim.max_steps": MAX_STEPS})
    reference.start(spec)
    summary = relay_env.run_flow(monkeypatch)
    assert summary["state"] == "done", summary
    assert emu.faults.injected["status_lag"] >= 2
    assert_one_run(relay_env, reference, spec)


def test_one_relays_steps_are_serialized_on_a_prefect_server_by_its_name(prefect_api):
    from tasks.step_lock import StepLock

    # a free slot is taken whatever the machine's load (a generous wait that is never spent); a held one is
    # waited for 1 s, then gone on without
    first, second = StepLock("lock-test", wait_s=120), StepLock("lock-test", wait_s=1)
    other = StepLock("another-relay", wait_s=120)
    try:
        assert first.acquire() and other.acquire()  # another relay is not held up
        assert not second.acquire()  # held: after its bounded wait it goes on (guarded by the Kaggle claims)
        assert second.wait_s == 0  # and does not wait again in this run
        first.release()
        third = StepLock("lock-test", wait_s=120)
        assert third.acquire()
    finally:
        for lock in (first, second, other, locals().get("third")):
            if lock is not None:
                lock.release()
