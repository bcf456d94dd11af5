"""The claim on a relay step (relay/orchestrator/kaggle/lease.py) against the emulator with request latency, and the
emulator's new faults (latency, the pessimistic status lag). Outcomes only: who holds which generation."""
from __future__ import annotations

import threading
import time

import pytest

from relay.emulator.faults import FaultPlan
from relay.orchestrator.kaggle.lease import Lease, LeaseBusy, LeaseLost, NotALease
from relay.orchestrator.kaggle.types import KernelState
from relay.shared.errors import InputError

from kaggle_fixtures import USER, backend_for, isolated_env, make_emulator, push_script  # noqa: F401

LATENCY = {"seed": 4, "latency": {"min_s": 0.005, "max_s": 0.05}}


class Clock:
    """The holders' shared clock, moved only by the test: a lease's expiry is an event here, not a wait, so a slow
    machine's requests (seconds of them, under load) cannot eat a lease that the test meant to be live."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_of_two_orchestrators_claiming_one_step_at_once_exactly_one_gets_it(make_emulator):
    emu = make_emulator(faults=LATENCY)
    for key in ("push-r1", "handover-r1", "push-r2", "handover-r2"):
        outcome = {}
        start = threading.Barrier(2)

        def take(holder: str) -> None:
            lease = Lease(backend_for(emu, seed=len(holder)), "toy-relay", 30, holder=holder)
            start.wait()
            try:
                outcome[holder] = lease.acquire(key)
            except LeaseBusy as busy:
                outcome[holder] = busy
        threads = [threading.Thread(target=take, args=(h,)) for h in ("A", "BB")]
        [t.start() for t in threads]
        [t.join(60) for t in threads]
        won = [h for h, v in outcome.items() if not isinstance(v, LeaseBusy)]
        assert len(won) == 1, outcome
        lost = next(v for h, v in outcome.items() if h not in won)
        assert lost.claim.holder == won[0] and lost.claim.generation == 1 and "\n" not in str(lost)


def test_an_expired_claim_is_taken_over_and_its_old_holder_stops_before_acting(make_emulator):
    emu = make_emulator(faults=LATENCY)
    clock = Clock()
    dead = Lease(backend_for(emu), "toy-relay", 30, holder="dead", clock=clock)
    taker = Lease(backend_for(emu), "toy-relay", 30, holder="taker", clock=clock)
    claim = dead.acquire("handover-r1")
    with pytest.raises(LeaseBusy):
        taker.acquire("handover-r1")
    clock.advance(claim.expires - clock() + 0.001)  # the dead holder's claim has just expired
    taken = taker.acquire("handover-r1")
    assert (taken.generation, taken.holder) == (2, "taker")
    with pytest.raises(LeaseLost, match="taken over"):
        dead.confirm(claim)
    assert taker.confirm(taken) == taken  # still ours, half the lease left


def test_a_claim_near_its_end_is_renewed_as_the_next_generation(make_emulator):
    emu = make_emulator()
    clock = Clock()
    lease = Lease(backend_for(emu), "toy-relay", 30, holder="me", sleep=clock.advance, clock=clock)
    claim = lease.acquire("push-r1")
    clock.advance(claim.expires - clock() - 12)  # less than half the lease left
    renewed = lease.confirm(claim)  # waits (on the clock) for it to expire, then takes the next generation
    assert (renewed.generation, renewed.holder) == (2, "me")


def test_a_lost_create_response_is_still_our_claim(make_emulator):
    # CreateDataset handled, then the connection dropped: the client's retry is refused "already in use"
    emu = make_emulator(faults={"methods": {"CreateDataset": {"script": ["lost"]}}})
    claim = Lease(backend_for(emu), "toy-relay", 30, holder="me").acquire("push-r1")
    assert (claim.generation, claim.holder) == (1, "me") and emu.faults.injected["lost"] == 1


def test_a_dataset_in_the_way_of_a_claim_is_one_line(make_emulator, tmp_path):
    emu = make_emulator()
    backend = backend_for(emu)
    lease = Lease(backend, "toy-relay", 30)
    folder = tmp_path / "hand"
    folder.mkdir()
    (folder / "x.txt").write_text("x")
    backend.publish_folder(folder, f"{USER}/{lease.slug('push-r1', 1)}", "made by hand here")
    with pytest.raises(NotALease) as err:
        lease.acquire("push-r1")
    assert "is not a relay lease" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("faults, message", [
    ({"latency": {"max_s": -1}}, "latency: need 0 <= min_s <= max_s"),
    ({"latency": {"mean_s": 1}}, "latency: unknown keys ['mean_s']"),
    ({"status_lag": {"pinned": True, "secs": 1}}, "status_lag: unknown keys ['secs']"),
])
def test_bad_fault_specs_are_one_line(faults, message):
    with pytest.raises(InputError, match=message.replace("[", r"\[").replace("]", r"\]")) as err:
        FaultPlan(faults)
    assert "\n" not in str(err.value)


def test_pessimistic_status_lag_answers_pinned_requests_with_the_previous_version(make_emulator):
    emu = make_emulator(faults={"status_lag": {"calls": 2, "pinned": True}})
    backend = backend_for(emu)
    kernel = f"{USER}/lag-pinned"
    push_script(backend, kernel, "print('one')\n")
    while not backend.kernel_status(kernel, 1).state.finished:
        time.sleep(0.05)
    push_script(backend, kernel, "import sys; sys.exit(3)\n")
    # the first two calls on v2, pinned or not, answer v1's final state; then v2 itself
    assert backend.kernel_status(kernel, 2).state is KernelState.COMPLETE
    assert backend.kernel_status(kernel).state is KernelState.COMPLETE
    while not backend.kernel_status(kernel, 2).state.finished:
        time.sleep(0.05)
    assert backend.kernel_status(kernel, 2).state is KernelState.ERROR
    assert backend.kernel_status(kernel, 1).state is KernelState.COMPLETE  # an older version: never lagged
    assert emu.faults.injected["status_lag"] == 2


def test_emulator_flags_for_the_new_faults(tmp_path):
    from relay.emulator.serve_command import build_parser, load_config

    def config(*flags):
        return load_config(build_parser().parse_args(["serve", "--state", str(tmp_path), *flags]))
    faults = config("--status-lag", "20", "--status-lag-pinned", "--latency", "0.2").faults
    assert faults["status_lag"] == {"seconds": 20.0, "pinned": True} and faults["latency"]["max_s"] == 0.2
    for flags, message in ((["--status-lag-pinned"], "needs --status-lag"), (["--latency", "-1"], "--latency -1")):
        with pytest.raises(InputError, match=message) as err:
            config(*flags)
        assert "\n" not in str(err.value)


def test_a_released_claim_is_free_at_once_and_a_step_that_took_effect_keeps_its_claim(make_emulator):
    emu = make_emulator(faults=LATENCY)
    first = Lease(backend_for(emu), "toy-relay", 600, holder="first")
    first.acquire("push-r1")       # refused, say: no effect
    first.acquire("handover-r1")   # published
    first.took_effect("handover-r1")
    first.release_open()           # the process leaves the flow
    second = Lease(backend_for(emu), "toy-relay", 600, holder="second")
    assert (second.acquire("push-r1").generation, second.acquire("push-r1").holder) == (2, "second")
    with pytest.raises(LeaseBusy):
        second.acquire("handover-r1")


def test_a_forked_process_is_another_holder(spawns_processes):
    """A process forked from one that imported the lease module (a fork server: the tests' flow processes) is
    another orchestrator: its claims are not its parent's. (A holder made once at import was both's.)"""
    import os

    from relay.orchestrator.kaggle.lease import this_process

    parent = this_process()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write, this_process().encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 200).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert child != parent and child.split(":")[1] == str(pid)
    assert this_process() == parent and parent.split(":")[1] == str(os.getpid())


def _child_holder(emu, key: str, **lease):
    """A claim taken in the name of a real child process of this machine (its pid and start time), the child left
    running: the test decides when it dies."""
    import subprocess
    import sys

    from relay.orchestrator.kaggle.lease import process_started

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    started = process_started(child.pid)
    holder = Lease(backend_for(emu), "toy-relay", 600, holder=f"host:{child.pid}:dead01",
                   process=(child.pid, started), **lease)
    return child, holder.acquire(key)


def test_a_claim_whose_holder_died_on_this_machine_is_taken_over_at_once(make_emulator):
    # `relay run` SIGKILLed during a hand-over: the user's next `relay run` on the same machine used to wait out
    # the whole lease (20 min) on a claim of a process that no longer existed
    emu = make_emulator()
    clock = Clock()  # never advanced: the claim stays live by the clock throughout
    child, claim = _child_holder(emu, "handover-r1", clock=clock)
    try:
        taker = Lease(backend_for(emu), "toy-relay", 600, holder="taker", clock=clock)
        with pytest.raises(LeaseBusy):  # alive: its claim holds
            taker.acquire("handover-r1")
    finally:
        child.kill()
        child.wait()
    taken = taker.acquire("handover-r1")
    assert (taken.generation, taken.holder) == (2, "taker") and claim.expires > clock() + 500


def test_a_claim_of_another_machine_or_a_reused_pid_is_judged_right(make_emulator):
    import dataclasses
    import os

    from relay.orchestrator.kaggle.lease import process_started, this_machine

    emu = make_emulator()
    child, claim = _child_holder(emu, "push-r1")
    child.kill()
    child.wait()
    assert claim.machine == this_machine() and claim.holder_gone()
    # the same dead pid named by another machine's claim: its process may well live there; wait for the lease
    assert not dataclasses.replace(claim, machine="elsewhere|boot|pid:[1]").holder_gone()
    assert not dataclasses.replace(claim, machine="").holder_gone()  # a claim written before it said
    # a live pid whose start time is not the claim's: reused since by another process, the holder is gone
    me = os.getpid()
    mine = dataclasses.replace(claim, pid=me, started=process_started(me))
    assert not mine.holder_gone() and dataclasses.replace(mine, started=mine.started + 60).holder_gone()
