"""The `relays` flow's step locks (tasks/run_step_locks.py): one record for all the relays of a run, seen by another
run's RunStepLocks and by the `relay` flow's StepLock, passed over once its holder stops renewing it (killed), and
no write while the run steps its relays (issue 60: a lease and a record per relay per round). Real Prefect server."""
from __future__ import annotations

from relay_fixtures import PYTHON, REPO  # noqa: F401 - the session's Prefect server (prefect_api)

LEASE_S = 2.0  # how long after the holder's last renewal others pass its record over (production: 60 s)
# A live holder's lease where a check needs it live: a 2-s lease renewed every 0.7 s by a thread lapsed under load
# (a py-spy run at load 10 saw it passed over), so no check waits on the wall clock but the lapse itself.
LIVE_S = 300.0


def _records(prefix: str) -> list:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        found = client.request("POST", "/variables/filter", json={"variables": {"name": {"like_": prefix}}}).json()
    return [v for v in found if v["name"].startswith(prefix)]


def test_one_record_for_a_runs_relays_seen_by_other_runs(prefect_api):
    from tasks import run_step_locks
    from tasks.run_step_locks import RunStepLocks
    from tasks.step_lock import RUN_RECORD, StepLock

    names = [f"rsl-{i}" for i in range(5)]
    first = RunStepLocks(wait_s=300, lease_s=LIVE_S, poll_s=0.2)
    try:
        assert first.hold(names) == names
        assert len(_records(first.prefix)) == 1  # one record names them all
        writes = []
        real = run_step_locks.write_record
        run_step_locks.write_record = lambda *a, **k: (writes.append(a[1]), real(*a, **k))
        try:
            assert all(first.member(n).acquire() for n in names)  # each round's steps: no write
            for n in names:
                first.member(n).release()
        finally:
            run_step_locks.write_record = real
        assert not writes, writes
        second = RunStepLocks(wait_s=0.5, lease_s=LIVE_S, poll_s=0.2)
        assert second.hold(names[:2] + ["rsl-other"]) == ["rsl-other"]
        assert not second.acquire(names[0])  # held by a live run
        assert not StepLock(names[1], wait_s=0.5, lease_s=LIVE_S, poll_s=0.2).acquire()  # the `relay` flow's too
        second.close()
    finally:
        first.close()
    assert not _records(first.prefix)
    after = StepLock(names[1], wait_s=5, lease_s=LIVE_S, poll_s=0.2)
    try:
        assert after.acquire()  # free at once when the run ends
        blocked = RunStepLocks(wait_s=0.5, lease_s=LIVE_S, poll_s=0.2)
        assert blocked.hold(names[:2]) == [names[0]]  # a StepLock's relay is not taken
        blocked.close()
    finally:
        after.release()
    # no record of this test's runs names a relay (other tests' relays on this worker's server are theirs)
    assert not [r for r in _records(RUN_RECORD) if set(r["value"].get("relays") or ()) & set(names)]


def test_a_killed_runs_record_is_passed_over_after_its_lease(prefect_api):
    from tasks.run_step_locks import RunStepLocks

    dead = RunStepLocks(wait_s=300, lease_s=LEASE_S, poll_s=0.2)
    assert dead.hold(["rsl-killed"]) == ["rsl-killed"]
    dead._stop.set()  # its renewals stop, its record stays: as a SIGKILL leaves it
    dead._thread.join()
    waiter = RunStepLocks(wait_s=300, lease_s=LIVE_S, poll_s=0.2)  # the wait is never spent unless it fails
    try:
        assert waiter.acquire("rsl-killed")
    finally:
        waiter.close()
