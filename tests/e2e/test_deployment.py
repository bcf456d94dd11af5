"""What a user runs, end to end: a real Prefect server, the `relay-pool` process work pool, the deployments of
deploy/prefect.yaml (`prefect deploy --all`), a process worker, a Kaggle emulator holding the demo data, the emulator's
credentials in a Prefect Secret block (as production keeps Kaggle's), and
`prefect deployment run 'relay/price-model-demo' --watch` completing a short relay of 2 sessions (one hand-over).

The server is the worker's shared Prefect server (the `prefect_api` fixture), not one `prefect server start`ed for
this test (~10 CPU s with its start and idle services): the subject is what is deployed on a server and run by its
worker, not how a server starts. What the test put on it (deployments, work pool, Secret block, the relays' slots
and locks) is deleted at its end. Every process runs in its own process group with an isolated HOME, TMPDIR and
PREFECT_HOME, and is stopped at the end. About 2-3 minutes on 2 CPU cores.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import yaml

from byo_fixtures import copy_example
from kaggle_fixtures import KERNEL_ENV, isolated_env, make_emulator  # noqa: F401
from relay.orchestrator.kaggle import ClientBackend, KaggleCredentials
from relay_fixtures import forget_relays

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PREFECT = str(BIN / "prefect")
USER = "demo"  # owner of demo/price-data, which examples/price-demo.yaml mounts
sys.path.insert(0, str(REPO / "deploy"))
import seed_emulator  # noqa: E402


SAVE_SECRET = ("import os; from prefect.blocks.system import Secret; "
               "Secret(value=os.environ['SECRET_JSON']).save('emulator-credentials', overwrite=True)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STEPS_PER_SESSION = 30  # 60 steps -> 2 sessions on any machine (time-based sessions varied 1-5 with load)
SESSIONS = 2  # one hand-over is what the deployment adds; the relay's recoveries are proved by the relay tests


def short_spec(path: Path) -> Path:
    """examples/price-demo.yaml cut to 60 steps; sessions end after STEPS_PER_SESSION steps
    (`session.max_steps`), the 10 min budget being only a backstop."""
    spec = yaml.safe_load((REPO / "examples" / "price-demo.yaml").read_text())
    spec["name"] = "price-deploy-test"
    spec["optim"].pop("epochs")
    spec["optim"]["max_steps"] = 60
    spec["session"]["budget"] = "10m"
    spec["session"]["max_steps"] = STEPS_PER_SESSION
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


class Processes:
    """Popen in new sessions (own process groups), logs in files, all stopped by stop_all()."""

    def __init__(self, logs: Path):
        self.logs, self.started = logs, []

    def start(self, name: str, args: list, env: dict) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "w")
        proc = subprocess.Popen(args, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.started.append((name, proc))
        return proc

    def stop_all(self) -> None:
        for _, proc in reversed(self.started):  # the worker before the server, so it can deregister
            try:  # a worker's flow runs are its children in sessions of their own: not in its group
                below = psutil.Process(proc.pid).children(recursive=True)
            except psutil.Error:
                below = []
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # whatever is left in the group
            except ProcessLookupError:
                pass
            proc.wait()
            for child in below:  # else a flow run still waiting outlives the test (one ran 15 min into the suite)
                try:
                    child.kill()
                except psutil.Error:
                    pass

    def tails(self, n: int = 40) -> str:
        out = []
        for path in sorted(self.logs.glob("*.log")):
            lines = path.read_text(errors="replace").splitlines()[-n:]
            out.append(f"--- {path.name} ---\n" + "\n".join(lines))
        return "\n".join(out)


def wait_healthy(api_url: str, server: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.poll() is None, "the Prefect server exited"
        try:
            with urllib.request.urlopen(f"{api_url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"Prefect server not healthy after {timeout} s")


def api_post(api_url: str, path: str, body: dict, attempts: int = 5):
    """A read-only POST (the filter endpoints). On a loaded machine the server's SQLite can hold a request
    for many seconds while the worker and `prefect deploy` write, so a slow answer is retried, not a failure."""
    request = urllib.request.Request(f"{api_url}{path}", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    for attempt in range(attempts):
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return json.loads(r.read())
        except OSError as e:  # a timeout, a reset connection, or URLError wrapping either
            if attempt == attempts - 1:
                raise AssertionError(f"the Prefect server did not answer {path} in {attempts} tries: {e}") from e


def run_cli(args: list, env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_byo_demo_deployment_is_declared_like_the_price_demo():
    """Cheap (no server): `prefect deployment run 'relay/byo-plain-demo'` relays examples/byo-plain the way
    'relay/price-model-demo' relays the price model (its run through a real server is this file's other test's)."""
    from relay.shared import spec as spec_mod

    deployments = {d["name"]: d for d in yaml.safe_load((REPO / "deploy" / "prefect.yaml").read_text())["deployments"]}
    byo, demo = deployments["byo-plain-demo"], deployments["price-model-demo"]
    assert byo["entrypoint"] == demo["entrypoint"] and byo["work_pool"] == demo["work_pool"]
    assert {k: v for k, v in byo["parameters"].items() if k != "spec"} == \
        {k: v for k, v in demo["parameters"].items() if k != "spec"}
    assert spec_mod.load(REPO / byo["parameters"]["spec"]).code.entry.startswith("train.py")


def forget_deployed(names: set) -> None:
    """Delete from the worker's shared Prefect server what this test deployed and saved on it."""
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        for deployment in client.read_deployments():
            if deployment.name in names:
                client.delete_deployment(deployment.id)
        for remove in (lambda: client.delete_work_pool("relay-pool"),
                       lambda: client.delete_block_document(
                           client.read_block_document_by_name("emulator-credentials", "secret").id)):
            try:
                remove()
            except ObjectNotFound:
                pass
    forget_relays()


DEPLOYMENTS = {"run", "relays", "price-model-demo", "byo-plain-demo", "price-model-kaggle", "price-model-tick",
               "relays-kaggle", "relays-tick"}


def test_deployment_run_watch_completes_a_relay(make_emulator, tmp_path, prefect_api):
    t0 = time.monotonic()
    key = secrets.token_hex(16)
    api_url = prefect_api
    (tmp_path / "logs").mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PREFECT_", "KAGGLE_")) and k.lower() not in ("http_proxy", "https_proxy")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), PREFECT_API_URL=api_url,
               PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1", PREFECT_CLI_PROMPT="false",
               HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs = Processes(tmp_path / "logs")
    try:
        # the emulator and the data a user would upload
        emulator = make_emulator(users={USER: key}, kernel_env=dict(KERNEL_ENV))
        backend = ClientBackend(KaggleCredentials(USER, key=key), emulator.url, dataset_poll_s=0.1)
        published = seed_emulator.seed(backend, tmp_path / "data")
        assert published.dataset == "demo/price-data" and published.version == 1
        spec = short_spec(tmp_path / "price-deploy-test.yaml")
        t_healthy = time.monotonic() - t0
        project = tmp_path / "my-project"  # a user's own script, outside the repository, that fails at once
        spec_file = copy_example("byo-plain", project, **{"optim.max_steps": 20})
        spec_file.write_text(spec_file.read_text().replace("name: byo-plain", "name: byo-submit"))
        script = project / "train.py"
        script.write_text(script.read_text().replace("    session.restore()  # relay\n",
                                                     "    session.restore()  # relay\n    raise KeyError('label')\n"))
        submit = [sys.executable, "-m", "relay", "run", "spec.yaml", "--submit", "--poll", "0.3",
                  "--credentials-block", "emulator-credentials"]
        undeployed = subprocess.run(submit, env=env, cwd=project, capture_output=True, text=True, timeout=120)
        assert undeployed.returncode == 2 and undeployed.stderr.splitlines() == [
            f"relay: error: --submit: no deployment relay/run on {api_url}: deploy it with prefect deploy --name run"
            " --no-prompt --prefect-file deploy/prefect.yaml (docs/prefect.md)"], undeployed.stderr
        made = run_cli([PREFECT, "work-pool", "create", "relay-pool", "--type", "process"], env, 60)
        assert made.returncode == 0, made.stdout + made.stderr
        # The worker knows where Kaggle is but holds no credential: the run reads them from a Secret block.
        procs.start("worker", [PREFECT, "worker", "start", "--pool", "relay-pool", "--name", "test-worker"],
                    dict(env, RELAY_KAGGLE_ENDPOINT=emulator.url, PREFECT_WORKER_QUERY_SECONDS="2"))
        secret = procs.start("secret", [sys.executable, "-c", SAVE_SECRET],
                             dict(env, SECRET_JSON=json.dumps({"username": USER, "key": key})))
        deployed = run_cli([PREFECT, "deploy", "--all", "--no-prompt", "--prefect-file", "deploy/prefect.yaml"],
                           env, 600)  # a hang guard: 7 deployments took > 120 s beside a parallel suite
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        assert secret.wait(60) == 0, procs.tails()
        deployments = {d["name"]: d for d in api_post(api_url, "/deployments/filter", {})}
        assert set(deployments) == DEPLOYMENTS
        assert all(d["work_pool_name"] == "relay-pool" for d in deployments.values())
        tick = deployments["price-model-tick"]
        assert tick["parameters"]["mode"] == "tick"
        assert [(s["schedule"]["cron"], s["active"]) for s in tick["schedules"]] == [("*/15 * * * *", False)]
        assert tick["global_concurrency_limit"]["limit"] == 1  # two ticks never race
        assert deployments["price-model-kaggle"]["job_variables"]["env"]["RELAY_KAGGLE_ENDPOINT"] == ""
        assert deployments["price-model-demo"]["pull_steps"] == [
            {"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}]
        t_ready = time.monotonic() - t0

        try:
            run = run_cli([PREFECT, "deployment", "run", "relay/price-model-demo", "--watch",
                           "--param", f"spec={spec}", "--param", f"state_dir={tmp_path / 'orchestrator'}",
                           "--param", "poll_seconds=0.5", "--param", "max_hours=0.25",
                           "--param", "credentials_block=emulator-credentials"], env, 600)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the relay did not complete in 600 s\n{procs.tails()}")
        t_run = time.monotonic() - t0 - t_ready
        assert run.returncode == 0, f"{run.stdout[-4000:]}\n{run.stderr[-2000:]}\n{procs.tails()}"
        assert "Completed" in run.stdout

        # `relay run --submit`: the generic deployment takes the user's spec; the failure's reason is printed.
        failed = subprocess.run(submit, env=env, cwd=project, capture_output=True, text=True, timeout=600)
        assert failed.returncode == 1, failed.stdout[-4000:] + failed.stderr[-2000:] + procs.tails()
        assert "submitted flow run" in failed.stdout and "decide: push byo-submit-s001-a1" in failed.stdout
        stopped = [line for line in failed.stdout.splitlines() if line.startswith("relay: stopped: ")]
        assert len(stopped) == 1 and stopped[0].startswith(
            "relay: stopped: the flow run ended Failed: session 1 failed with a code error:") and \
            "raised KeyError: 'label'" in stopped[0], failed.stdout[-4000:]
        assert key not in failed.stdout + failed.stderr

        # `relay run A B --submit`: the generic `relays` deployment relays both on the worker (the emulator)
        team = tmp_path / "team-project"
        first = copy_example("byo-plain", team, **{"optim.max_steps": 20})
        for name in ("byo-many-a", "byo-many-b"):
            (team / f"{name}.yaml").write_text(first.read_text().replace("name: byo-plain", f"name: {name}"))
        several = subprocess.run([sys.executable, "-m", "relay", "run", "byo-many-a.yaml", "byo-many-b.yaml", "--submit",
                                  "--poll", "0.3", "--credentials-block", "emulator-credentials"], env=env, cwd=team,
                                 capture_output=True, text=True, timeout=600)
        assert several.returncode == 0, several.stdout[-4000:] + several.stderr[-2000:] + procs.tails()
        assert "of relays/relays" in several.stdout and several.stdout.count("done: step 20/20") == 2, several.stdout

        # What Kaggle (the emulator) holds: the checkpoint dataset says done, after SESSIONS sessions.
        progress_file = backend.download_dataset_file("demo/price-deploy-test-ckpt", "progress.json",
                                                      tmp_path / "check")
        progress = json.loads(progress_file.read_text())
        assert progress["status"] == "done" and progress["global_step"] == progress["total_steps"] == 60
        assert len(progress["sessions"]) == SESSIONS, progress["sessions"]
        print([(s["step_start"], s["step_end"], round(s["seconds"], 1)) for s in progress["sessions"]])
        run_id, version = backend.current_run("demo/price-deploy-test-session")
        assert version >= len(progress["sessions"]) and run_id == progress["run_id"]
        print(f"emulator seeded at {t_healthy:.0f} s, deployed at {t_ready:.0f} s;"
              f" relay of {len(progress['sessions'])} sessions in {t_run:.0f} s")
    finally:
        procs.stop_all()
        forget_deployed(DEPLOYMENTS)
    for name, proc in procs.started:
        with pytest.raises(ProcessLookupError):
            os.killpg(proc.pid, 0)  # nothing left of any process group
