"""An account's queue for its session slots (tasks/slot_queue.py) on a real Prefect server: first come, first
served; one that takes its slot leaves and joins again at the back; a dead flow run's place is kept for its relay's
next run and passed by the others once it has not been refreshed for the stale time. The clock is the test's
(time.time patched in the module): no waits."""
from __future__ import annotations

import pytest

from tasks import slot_queue
from tasks.slot_queue import SlotQueue


@pytest.fixture
def client(prefect_api):
    from prefect import get_client

    with get_client(sync_client=True) as c:
        yield c


@pytest.fixture
def clock(monkeypatch):
    now = [1_000_000.0]
    monkeypatch.setattr(slot_queue.time, "time", lambda: now[0])
    return now


def test_first_come_first_served_and_back_of_the_queue_after_a_turn(client, clock, request):
    user = f"q{abs(hash(request.node.name)) % 10**8}"
    a, b, c = (SlotQueue(user, r) for r in ("a", "b", "c"))
    assert a.my_turn(client)
    clock[0] += 1
    assert not b.my_turn(client) and not c.my_turn(client)
    a.leave(client)  # a took its slot
    clock[0] += 1
    assert a.my_turn(client) is False  # ready again: behind b and c
    assert b.my_turn(client) and not c.my_turn(client)
    b.leave(client)
    assert c.my_turn(client) and not a.my_turn(client)
    c.leave(client)
    assert a.my_turn(client)
    a.leave(client)


def test_a_dead_runs_place_is_kept_for_its_relay_and_passed_once_stale(client, clock, request, monkeypatch):
    user = f"q{abs(hash(request.node.name)) % 10**8}"
    first, second = SlotQueue(user, "first"), SlotQueue(user, "second")
    assert first.my_turn(client)
    clock[0] += 5
    assert not second.my_turn(client)
    # `first`'s flow run dies: it refreshes no more; `second` keeps its own place fresh
    clock[0] += slot_queue.stale_s() - 10
    assert not second.my_turn(client)  # not stale yet
    clock[0] += 15
    assert second.my_turn(client)      # passed: its flow run is gone
    # the relay's next flow run finds its entry and keeps its place
    reborn = SlotQueue(user, "first")
    assert reborn.my_turn(client) and reborn.since == first.since
    assert not second.my_turn(client)
    monkeypatch.setenv("RELAY_SLOT_QUEUE_STALE_S", "3600")  # a deployment that restarts dead runs slowly
    clock[0] += 600
    assert not second.my_turn(client)
    for q in (reborn, second):
        q.leave(client)


def test_a_limit_set_to_zero_pauses_the_account_instead_of_reading_as_no_server(client, request):
    """A person pauses an account by setting its limit to 0: the take waits (it used to fall back to 'no server
    to count on' and push)."""
    from tasks.account_slots import AccountSlot

    user = f"z{abs(hash(request.node.name)) % 10**8}"
    client.upsert_global_concurrency_limit_by_name(f"kaggle-account-{user}", 0)
    slot = AccountSlot(user, "paused", sessions=1, hold_s=120)
    assert slot.take("paused-s001-a1") is False


def test_a_relays_place_becomes_its_slot_and_no_session_deletes_a_record(client, request, monkeypatch):
    """On a SQLite server a variable's PATCH and DELETE can be refused (503), the DELETE most: a relay has one record
    for its place and its slot, the take writes the place into the slot, the give-back writes nothing, and the
    record is deleted once, when the relay needs no more slots; a take that finds every slot running reads so
    instead of trying the increment (which SQLite may refuse too). The account's count stays true throughout."""
    import httpx

    from tasks.account_slots import AccountSlot, limit_name
    from tasks.prefect_writes import kind

    sent: list = []  # the requests the server carried out: one it refused (SQLite's 503) is retried, and counted once
    send = httpx.Client.send

    def counted(self, r, *a, **k):
        response = send(self, r, *a, **k)
        if response.status_code != 503:
            sent.append(kind(r))
        return response

    monkeypatch.setattr(httpx.Client, "send", counted)
    user = f"r{abs(hash(request.node.name)) % 10**8}"
    a, b = AccountSlot(user, "a", sessions=1, hold_s=120), AccountSlot(user, "b", sessions=1, hold_s=120)

    def running() -> int:
        return client.read_global_concurrency_limit_by_name(limit_name(user)).active_slots

    def record(relay: str):
        found = client.read_variable_by_name(f"kaggle-slot-{user}-{relay}")
        return found.value if found is not None else None

    assert a.take("a-s1") and running() == 1       # its turn, a slot free: no place written, the slot recorded
    assert not b.take("b-s1") and "since" in record("b")  # every slot runs: b waits at its place
    a.release()                                    # a's session ended: its slot back, its record left
    assert running() == 0 and "lease_id" in record("a")
    assert b.take("b-s1") and running() == 1 and record("b")["for"] == "b-s1"  # the place became the slot
    assert not a.take("a-s2") and "since" in record("a")   # a joins behind nobody, but b's session runs
    reborn = AccountSlot(user, "b", sessions=1, hold_s=120)  # b's flow run died: the next one finds b's slot
    reborn.keep()
    assert running() == 1
    reborn.release()
    assert running() == 0
    assert a.take("a-s2") and running() == 1 and record("a")["for"] == "a-s2"
    assert "DELETE /variables/name/*" not in sent   # three relay-sessions, no record deleted
    assert sent.count("PATCH /variables/name/*") <= 3  # a place written into a slot, a slot into a place
    assert sent.count("POST /v2/concurrency_limits/increment-with-lease") == 3  # a full limit is read, not tried
    a.release(forget=True)                         # done: its record goes, once
    assert running() == 0 and record("a") is None and sent.count("DELETE /variables/name/*") == 1


def _account(client, request, prefix: str):
    from tasks.account_slots import limit_name

    user = f"{prefix}{abs(hash(request.node.name)) % 10**8}"
    return user, lambda: client.read_global_concurrency_limit_by_name(limit_name(user)).active_slots


@pytest.mark.parametrize("claim_winner", ["recorded", "overwritten"])
def test_two_runs_of_one_relay_taking_a_slot_for_one_push_at_once_keep_one_slot(client, request, monkeypatch,
                                                                                claim_winner):
    """Two flow runs of one relay (a watch beside a schedule) may each take a slot for the same push before their
    claims on Kaggle, and the record keeps the last written. The other lease, named by no record, held a slot of the
    account for the session's whole length (hours): the relay's other run then waited for a slot of a full account
    (the suite hung 400 s on it). After the claim, whichever run wins it, one slot is left, recorded, and it goes
    back with the session."""
    from tasks import account_slots
    from tasks.account_slots import AccountSlot
    from tasks.step_lock import read_record

    user, running = _account(client, request, "d")
    a, b = AccountSlot(user, "r", sessions=2, hold_s=3600), AccountSlot(user, "r", sessions=2, hold_s=3600)
    write_record = account_slots.write_record

    def a_takes_between_the_reads(*args):  # a's whole take after b's first read, before b's write
        monkeypatch.setattr(account_slots, "write_record", write_record)
        assert a.take("r-s1")
        write_record(*args)

    monkeypatch.setattr(account_slots, "write_record", a_takes_between_the_reads)
    assert b.take("r-s1") and running() == 2  # both took one: b's is recorded, a's is named by no record
    winner, loser = (b, a) if claim_winner == "recorded" else (a, b)
    loser.settle("r-s1", pushed=False)   # "another orchestrator is on it": no push
    winner.settle("r-s1", pushed=True)
    assert running() == 1
    assert read_record(client, a.record)["lease_id"] in (winner._mine, loser._mine)
    winner.release()  # the session handed over: the account's slot goes back
    assert running() == 0
    loser.release(forget=True)
    assert running() == 0


def test_a_take_that_finds_the_account_full_leaves_another_runs_slot_recorded(client, request, monkeypatch):
    """A run whose take read the relay's record before the relay's other run recorded a slot, and found the account
    full (that slot among the full ones), waits without writing its place over the slot: a place written there
    left the slot named by no record (held for the session's whole length) and the waiting run waiting for it."""
    from tasks import account_slots
    from tasks.account_slots import AccountSlot
    from tasks.step_lock import read_record

    user, running = _account(client, request, "f")
    a, b = AccountSlot(user, "r", sessions=1, hold_s=3600), AccountSlot(user, "r", sessions=1, hold_s=3600)
    real_read = account_slots.read_record

    def b_reads_before_a_writes(client_, name):  # b's first read falls before a's take
        monkeypatch.setattr(account_slots, "read_record", real_read)
        found = real_read(client_, name)
        assert a.take("r-s1")
        return found

    monkeypatch.setattr(account_slots, "read_record", b_reads_before_a_writes)
    assert not b.take("r-s1")  # the account's one slot is a's
    assert read_record(client, a.record)["lease_id"] == a._mine and running() == 1
    b.settle("r-s1", pushed=False)
    a.settle("r-s1", pushed=True)
    a.release(forget=True)
    assert running() == 0 and read_record(client, a.record) is None


def test_a_wait_for_a_slot_ends_when_another_run_of_the_relay_is_done_with_its_place(client, request):
    """A watch waits for a full account's slot while the relay's other flow run takes its place and finishes the
    relay: the wait ends at its next look (it used to wait for a slot of the account, up to 15 min)."""
    import time

    from tasks.account_slots import AccountSlot

    user, running = _account(client, request, "w")
    other = AccountSlot(user, "x", sessions=1, hold_s=3600)
    assert other.take("x-s1")  # another relay's session holds the account's one slot
    watch, schedule = AccountSlot(user, "r", sessions=1, hold_s=3600), AccountSlot(user, "r", sessions=1, hold_s=3600)
    assert not watch.take("r-s1") and not schedule.take("r-s1")  # both wait at the relay's one place
    schedule.release(forget=True)  # the schedule's run found the relay done (another run finished it)
    assert watch.wait_free(time.monotonic() + 30, 0.05) is True  # not False after 30 s: the place is gone
    other.release(forget=True)
    watch.release(forget=True)
    assert running() == 0


def test_a_flow_run_ends_giving_back_a_slot_the_relays_record_does_not_name(client, request, monkeypatch):
    """The last interleaving of two runs of one relay: one run's take, begun before the other's, writes the record
    after the other pushed and settled (a long take on a loaded server). The run that pushed is a tick: it ends
    after its push, and the lease it took, named by no record, is given back as its flow run ends."""
    from tasks import account_slots
    from tasks.account_slots import AccountSlot

    user, running = _account(client, request, "c")
    tick, watch = AccountSlot(user, "r", sessions=2, hold_s=3600), AccountSlot(user, "r", sessions=2, hold_s=3600)
    real_read = account_slots.read_record

    def the_tick_pushes_meanwhile(client_, name):  # the watch's first read, then the tick's whole push
        monkeypatch.setattr(account_slots, "read_record", real_read)
        found = real_read(client_, name)
        assert tick.take("r-s1")
        tick.settle("r-s1", pushed=True)
        return found

    monkeypatch.setattr(account_slots, "read_record", the_tick_pushes_meanwhile)
    assert watch.take("r-s1")          # it wrote its slot over the tick's record
    watch.settle("r-s1", pushed=False)  # it lost the claim; the record names its slot: it counts the session
    assert running() == 2
    tick.close()  # the tick's flow run ends
    assert running() == 1
    watch.release(forget=True)  # the session handed over
    assert running() == 0
