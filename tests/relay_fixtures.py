"""Fixtures for the relay tests: the whole relay (Prefect flow -> Kaggle emulator -> kernels running
`relay train`) on the small `toy` recipe.

Import into a test module with `from relay_fixtures import *` (it re-exports kaggle_fixtures' isolated_env and
make_emulator, which give every test its own HOME/TMPDIR and stop the emulators at teardown).

- `prefect_api` (session): one ephemeral Prefect server for the whole run (prefect_test_harness costs 14-18 s
  per entry), its database a copy of the run's migrated one (tests/prefect_template.py); PREFECT_HOME in a
  temporary folder, analytics off. Yields its API URL, which flow processes
  started by a test (`FlowProcess`) use too.
- `relay_env`: an emulator + the spec + helpers for one test (see RelayEnv).
- `both_flows`: a test that takes it runs twice, its relay driven once by the `relay` flow (one relay) and once
  by the `relays` flow (several under one cap; here the one spec): both take the same per-relay step
  (relay/orchestrator/relay_step.py), so every recovery must hold in both.
- `reference`: uninterrupted `relay train` runs of a spec, started in the background at first use and shared
  by the session; `reference.weights(spec)` waits for the run and returns its weights_sha256.
- Deterministic session lengths: the toy spec sets `session.max_steps`, so every session ends after exactly
  that many optimizer steps whatever the load on the machine; the number of sessions is a fact the tests can
  compare, and a slow start-up can never eat a whole session. Reference runs pass `--max-steps none`.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import pytest
import yaml

from kaggle_fixtures import (FAKE_KEY, KERNEL_ENV, USER, WARM_MODULES, backend_for, isolated_env,  # noqa: F401
                             make_emulator, warm_python)

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable

# Small and fast: ~100 optimizer steps/s on one CPU thread; no transformers import, no data dataset.
TOY_RELAY: dict = {
    "name": "toy-relay",
    "recipe": "toy",
    "seed": 3,
    "params": {"n_train": 256, "n_eval": 64, "hidden": 64},
    "optim": {"micro_batch": 8, "grad_accum": 2, "lr": 0.003, "max_steps": 450, "warmup_steps": 5,
              "log_every_steps": 10, "eval_every_steps": 100},
    "data": {"num_workers": 0},
    # max_steps ends sessions; budget: generous backstop; save_every: small, so a SIGKILL always finds saves
    "session": {"threads": 1, "max_steps": 150, "budget": "10m", "save_every": "0.3s", "safety_margin": "0.5s"},
    "checkpoints": {"keep_last": 2},
    # lease: short, so a killed orchestrator's claim on a step lapses soon (relay/orchestrator/kaggle/lease.py)
    "kaggle": {"session_timeout": "5m", "startup_overhead": "1s", "max_failed_sessions": 2, "lease": "10s"},
}
# how long a flow waits for another flow run's Prefect step lock, where a test turns it on (step_lock=True):
# a SIGKILLed holder's slot is taken back only 60 s after its last renewal (tasks/step_lock.py), so the other
# tests (all on relays named toy-relay) leave it off
STEP_LOCK_WAIT_S = 5
STEPS_PER_SESSION = TOY_RELAY["session"]["max_steps"]

def spec_dict(**overrides) -> dict:
    """TOY_RELAY with dotted-key overrides ({"optim.max_steps": 600}); None deletes a key."""
    from relay.shared.spec import override

    return override(TOY_RELAY, overrides, none_deletes=True)


def write_spec(directory: Path, **overrides) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "spec.yaml"
    path.write_text(yaml.safe_dump(spec_dict(**overrides), sort_keys=False))
    return path


def clean_env(**extra: str) -> dict:
    """The environment of a child process: offline, one thread, no KAGGLE_* of the developer's shell."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KAGGLE_", "PYTEST_", "RELAY_")) and k.lower() not in ("http_proxy", "https_proxy")}
    env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", RELAY_DEVICE="cpu", **KERNEL_ENV)
    env.update(extra)
    return env


# -- Prefect ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    # one per session: tests/conftest.py refuses a module that imports it (a copy of its own would start a second
    # server that takes this process's Prefect settings away from the first one's URL)
    home = tmp_path_factory.mktemp("prefect-home")
    mp = pytest.MonkeyPatch()
    mp.setenv("PREFECT_HOME", str(home))
    mp.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    mp.setenv("DO_NOT_TRACK", "1")
    # hang guards: under `make test` every xdist worker starts its own server at once, beside the first kernels
    mp.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "600")
    mp.setenv("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
    from prefect.settings import PREFECT_API_URL
    from prefect.testing import utilities
    from prefect.testing.utilities import prefect_test_harness

    import prefect_template

    def migrated_temp_dir() -> str:
        """The harness's database folder (its `mkdtemp()`), holding a copy of the run's migrated database under
        the harness's name: its server starts without running every migration (tests/prefect_template.py)."""
        folder = tmp_path_factory.mktemp("prefect-harness-db")
        shutil.copyfile(prefect_template.template(), folder / "prefect-test.db")
        return str(folder)

    mp.setattr(utilities, "mkdtemp", migrated_temp_dir)
    try:
        with prefect_test_harness(server_startup_timeout=600):
            yield PREFECT_API_URL.value()
    finally:
        mp.undo()


# -- uninterrupted reference runs -------------------------------------------------------------------------
class References:
    """`relay train SPEC --budget none --max-steps none` in the background, once per distinct training: specs
    that differ only in what cannot change the weights (the relay's name, its Kaggle and notification settings,
    the session budget and step cap, which the run's flags override) share one run. A test whose weights differed
    from its reference's would fail, so sharing cannot hide a difference."""

    def __init__(self, root: Path):
        self.root = root
        self.runs: Dict[str, tuple] = {}
        self.lock = threading.Lock()

    @staticmethod
    def training(spec: Path) -> str:
        """What of the spec decides the weights, as a key."""
        data = yaml.safe_load(Path(spec).read_text())
        for key in ("name", "kaggle", "notify"):
            data.pop(key, None)
        for key in ("budget", "max_steps"):
            (data.get("session") or {}).pop(key, None)
        code = data.get("code") or {}
        entry = Path(spec).parent / str(code.get("folder", ".")) / str(code.get("entry", ""))
        if code and entry.is_file():  # a user's script: its text decides too
            data["code-text"] = entry.read_text()
        return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:12]

    def start(self, spec: Path) -> str:
        key = self.training(spec)
        with self.lock:
            if key not in self.runs:
                workdir = self.root / key
                workdir.mkdir(parents=True)
                (workdir / "spec.yaml").write_bytes(Path(spec).read_bytes())
                log = open(workdir / "train.log", "w")
                python, env = warm_python(clean_env(HOME=str(workdir), TMPDIR=str(workdir)))
                proc = subprocess.Popen(
                    [python, "-m", "relay", "train", str(workdir / "spec.yaml"), "--workdir", str(workdir / "run"),
                     "--budget", "none", "--max-steps", "none"], cwd=workdir, env=env,
                    stdout=log, stderr=subprocess.STDOUT)
                self.runs[key] = (proc, workdir)
        return key

    def weights(self, spec: Path, timeout: float = 300) -> str:
        proc, workdir = self.runs[self.start(spec)]
        rc = proc.wait(timeout)
        assert rc == 0, f"reference run failed:\n{(workdir / 'train.log').read_text()[-3000:]}"
        progress = json.loads((workdir / "run" / "progress.json").read_text())
        assert progress["status"] == "done" and len(progress["sessions"]) == 1
        return progress["weights_sha256"]

    def stop(self) -> None:
        for proc, _ in self.runs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    refs = References(tmp_path_factory.mktemp("reference"))
    yield refs
    refs.stop()


# -- one relay on an emulator -----------------------------------------------------------------------------
@dataclass
class KernelRun:
    version: int
    run_id: Optional[str]
    status: str
    pushed: float
    started: Optional[float]
    ended: Optional[float]
    failure: str


@dataclass
class RelayEnv:
    root: Path
    make_emulator: Callable
    prefect_api: str
    emu: object = None
    spec: Optional[Path] = None
    processes: List[subprocess.Popen] = field(default_factory=list)
    flow: str = "relay"  # or "relays": which flow drives the relay (the `both_flows` fixture sets it)

    # setup
    def start(self, **emulator_settings):
        emulator_settings.setdefault("kernel_env", dict(KERNEL_ENV))
        self.emu = self.make_emulator(self.root / "emulator", **emulator_settings)
        return self.emu

    def write_spec(self, **overrides) -> Path:
        self.spec = write_spec(self.root / "spec", **overrides)
        return self.spec

    @property
    def name(self) -> str:  # read often by the polls of wait_for: each text parsed once
        return _spec_name(self.spec.read_text())

    @property
    def kernel(self) -> str:
        return f"{USER}/{self.name}-session"

    @property
    def ckpt(self) -> str:
        return f"{USER}/{self.name}-ckpt"

    def backend(self, seed: int = 0):
        return backend_for(self.emu, seed=seed, attempts=14)

    # driving the flow
    def run_flow(self, monkeypatch, mode: str = "watch", state_dir: str = "orchestrator", seed: int = 0,
                 poll_seconds: float = 0.3, step_lock: bool = False) -> dict:
        """The relay's flow (`self.flow`) in this process (the session's Prefect server), with a fast retry policy;
        the `relays` flow's summary of this relay, in the `relay` flow's keys."""
        import tasks.relay_host as relay_host

        monkeypatch.setattr(relay_host, "make_backend", lambda credentials_block=None: self.backend(seed))
        args = dict(mode=mode, poll_seconds=poll_seconds, state_dir=str(self.root / state_dir),
                    step_lock_wait_s=STEP_LOCK_WAIT_S if step_lock else 0)
        if self.flow == "relays":
            import flows.relays_sharing_quota as relays_sharing_quota

            return one_of_relays(relays_sharing_quota.relays(specs=[str(self.spec)], cap=2, **args), self.name)
        import flows.one_relay as one_relay

        return one_relay.relay(spec=str(self.spec), **args)

    def flow_thread(self, monkeypatch, folder: str, script: str, spec: dict, poll_seconds: float,
                    live_seconds: float):
        """The `relay` flow (watch) on a user script (`folder`/train.py with `spec`) in a thread of this process,
        so the test can look at Prefect while it runs; returns (the thread, the dict its summary lands in)."""
        import flows.one_relay as one_relay
        import tasks.relay_host as relay_host

        code = self.root / folder
        code.mkdir()
        (code / "train.py").write_text(script)
        self.spec = code / "spec.yaml"
        self.spec.write_text(yaml.safe_dump({"code": {"folder": ".", "entry": "train.py"}, **spec}))
        monkeypatch.setattr(relay_host, "make_backend", lambda credentials_block=None: self.backend())
        result: dict = {}
        thread = threading.Thread(target=lambda: result.update(one_relay.relay(
            spec=str(self.spec), poll_seconds=poll_seconds, live_seconds=live_seconds,
            state_dir=str(self.root / "orch"))), daemon=True)
        thread.start()
        return thread, result

    def flow_process(self, mode: str = "watch", state_dir: str = "orchestrator", seed: int = 0,
                     log_name: str = "flow.log", step_lock: bool = False,
                     flow: Optional[str] = None, tick_every: float = 0.2) -> subprocess.Popen:
        """The relay's flow (`flow`, else self.flow: "relay" or "relays") in a child process (so a test can
        SIGKILL it), against the same Prefect server.
        mode "tick-loop": ticks until done, as a schedule would, `tick_every` seconds after each tick's end (each
        tick is a whole flow run, ~0.6 CPU s of the flow process and the server). step_lock=True: it takes the
        relay's Prefect step lock; without it, it stands for an orchestrator that shares nothing with the others
        but Kaggle (a GitHub Actions tick beside a Prefect server)."""
        driver = self.root / "flow_driver.py"
        driver.write_text(FLOW_DRIVER)
        env = clean_env(HOME=str(self.root / "flow-home"), TMPDIR=str(self.root / "flow-tmp"),
                        PREFECT_API_URL=self.prefect_api, PREFECT_HOME=os.environ.get("PREFECT_HOME", ""),
                        PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1",
                        RELAY_TEST_ENDPOINT=self.emu.url, RELAY_TEST_USER=USER, RELAY_TEST_KEY=FAKE_KEY,
                        RELAY_TEST_STEP_LOCK_WAIT=str(STEP_LOCK_WAIT_S if step_lock else 0),
                        RELAY_TEST_TICK_EVERY=str(tick_every), RELAY_TEST_WAKE=str(self.root / WAKE_FILE))
        for d in ("flow-home", "flow-tmp"):
            (self.root / d).mkdir(exist_ok=True)
        with open(self.root / log_name, "a") as log:
            proc = start_flow_process([str(driver), str(self.spec), mode, str(self.root / state_dir), str(seed),
                                       flow or self.flow], env, log)
        self.processes.append(proc)
        return proc

    def wake_follow(self) -> None:
        """The flow process's wait on its running session (tasks/live_view.follow_sessions) ends once, now: it looks
        at Kaggle again, as it would at the session's deadline (a test that moved that deadline in the emulator)."""
        (self.root / WAKE_FILE).touch()

    # what the emulator holds
    def kernel_runs(self) -> List[KernelRun]:
        from relay.orchestrator.kaggle.kernel_source import find_run_id

        with self.emu.store.lock:
            kernel = json.loads(json.dumps(self.emu.store.kernels.get(self.kernel) or {"versions": []}))
        runs = []
        for v in kernel["versions"]:
            source = (self.emu.store.kernel_dir(self.kernel, v["number"]) / "source.py").read_text()
            runs.append(KernelRun(v["number"], find_run_id(source), v["status"], v["pushed"], v.get("started"),
                                  v.get("ended"), v.get("failure", "")))
        return runs

    def ckpt_versions(self) -> List[dict]:
        with self.emu.store.lock:
            return json.loads(json.dumps((self.emu.store.datasets.get(self.ckpt) or {}).get("versions", [])))

    def published_progress(self) -> dict:
        versions = self.ckpt_versions()
        return json.loads((self.emu.store.dataset_dir(self.ckpt, versions[-1]["number"]) / "progress.json").read_text())

    def stop(self) -> None:
        for proc in self.processes:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


# A flow process is forked from a process of this worker that imported Prefect, the relay's flows, the kaggle
# client and matplotlib once (tests/flow_preimports.py; relay/shared/warm_zygote.py): in a session of its own, as
# Popen(start_new_session=True) would start it, so os.killpg(proc.pid) is the kill it stands for. Prefect reads
# its settings when imported, so that process gets every PREFECT_* variable a flow process gets (the same for
# all tests of a worker: its server, its home).
def start_flow_process(args: List[str], env: dict, log):
    """`python ARGS` with `env` in a session of its own, its output into the file `log`: Popen-like (pid, poll,
    wait). Forked warm unless RELAY_TEST_WARM=0."""
    if not WARM_MODULES:
        return subprocess.Popen([PYTHON, *args], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    from relay.shared.warm_start import WarmStarter

    own = Path(env["PREFECT_HOME"]) / "flow-zygote"  # its HOME and TMPDIR: the worker's, not a test's
    own.mkdir(parents=True, exist_ok=True)
    zygote_env = {k: v for k, v in env.items() if k.startswith("PREFECT_") or k in ("PATH", "LANG", "DO_NOT_TRACK")}
    zygote_env.update(HOME=str(own), TMPDIR=str(own), PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))
    starter = WarmStarter.shared(["flow_preimports"], zygote_env)
    return starter.start(args, REPO, env, output=log.fileno())


class DatasetProcessing(threading.Thread):
    """Kaggle's dataset processing, driven by the test: every new dataset version becomes READY at once,
    except those the test holds (a publish the orchestrator is left waiting on)."""

    def __init__(self, emu):
        super().__init__(daemon=True, name="dataset-processing")
        self.emu, self.held, self.done = emu, set(), threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.05):
            with self.emu.store.lock:
                for ref, dataset in self.emu.store.datasets.items():
                    for version in dataset["versions"]:
                        if (ref, version["number"]) not in self.held and version["ready_at"] > time.time():
                            version["ready_at"] = time.time()


@functools.lru_cache(maxsize=64)
def _spec_name(text: str) -> str:
    return yaml.safe_load(text)["name"]


@pytest.fixture
def relay_env(tmp_path, isolated_env, make_emulator, prefect_api):  # noqa: F811
    env = RelayEnv(tmp_path / "relay", make_emulator, prefect_api)
    env.root.mkdir()
    yield env
    env.stop()
    forget_account_slots()


def forget_account_slots() -> None:
    """Every test's relays run on an emulator of their own, but the tests of one worker share its Prefect server:
    the account slots a killed or stopped relay still holds (tasks/account_slots.py: a lease as long as its
    session may run) would make the next test's relays of the same account wait for them."""
    from prefect import get_client

    with get_client(sync_client=True) as client:
        for limit in client.read_global_concurrency_limits(limit=200, offset=0):
            if limit.name.startswith("kaggle-account-"):
                client.delete_global_concurrency_limit_by_name(limit.name)
        for variable in client.read_variables(limit=200):
            if variable.name.startswith(("kaggle-slot-", "relay-view-")):  # and what ticks showed
                client.delete_variable_by_name(variable.name)


def forget_relays() -> None:
    """forget_account_slots, and what relays keep on the worker's shared Prefect server under their names: their
    step locks (the limits `relay-<name>`, the records `relay-step-lock-<name>` and a `relays` run's
    `relay-steps-<run>-<n>`: tasks/step_lock.py) and the notices told (`relay-notified-<name>`: tasks/notify.py).
    The tests of a worker run one at a time."""
    from prefect import get_client

    forget_account_slots()
    with get_client(sync_client=True) as client:
        for limit in client.read_global_concurrency_limits(limit=200, offset=0):
            if limit.name.startswith("relay-"):
                client.delete_global_concurrency_limit_by_name(limit.name)
        for variable in client.read_variables(limit=200):
            if variable.name.startswith(("relay-step-lock-", "relay-notified-", "relay-steps-")):
                client.delete_variable_by_name(variable.name)


@pytest.fixture
def prefect_server(prefect_api) -> dict:
    """{"PREFECT_API_URL": the worker's shared Prefect server}: what a user's shell exports for `relay run` to report
    to a server (README) instead of starting an embedded one, ~5 CPU s a run, for a test whose subject is not that
    start (the README newcomer's keeps it). What relays kept on the server under their names is forgotten before
    and after the test, so a relay of the same name in another test starts clean."""
    forget_relays()
    yield {"PREFECT_API_URL": prefect_api}
    forget_relays()


@pytest.fixture(params=["relay", "relays"])
def both_flows(request, relay_env) -> str:
    relay_env.flow = request.param
    return request.param


def one_of_relays(summary: dict, name: str) -> dict:
    """The `relays` flow's summary of one relay, in the keys of the `relay` flow's summary."""
    return dict(summary["relays"][name], overall=summary["state"])


WAKE_FILE = "wake-follow"  # RelayEnv.wake_follow's; the flow driver removes it as it wakes the follow
FLOW_DRIVER = '''\
"""TEST-ONLY (tests/relay_fixtures.py): run the relay's flow (argv 5: relay | relays) in a child process the test
may SIGKILL. The backend is the emulator's, with a fast retry policy (the production default backs off for seconds)."""
import json
import os
import random
import sys
import time

import tasks.live_view as live_view
import tasks.relay_host as relay_host
from relay.orchestrator.kaggle import ClientBackend, KaggleCredentials, RetryPolicy


def make_backend(credentials_block=None):
    policy = RetryPolicy(attempts=14, base_delay_s=0.01, multiplier=2.0, max_delay_s=0.2,
                         rng=random.Random(int(sys.argv[4])))
    return ClientBackend(KaggleCredentials(os.environ["RELAY_TEST_USER"], key=os.environ["RELAY_TEST_KEY"]),
                         os.environ["RELAY_TEST_ENDPOINT"], policy, dataset_poll_s=0.1, dataset_wait_s=60)


relay_host.make_backend = make_backend


def monotonic():
    """time.monotonic, past any wait's end once when the test asks (RelayEnv.wake_follow: the file RELAY_TEST_WAKE)."""
    try:
        os.remove(os.environ["RELAY_TEST_WAKE"])
    except FileNotFoundError:
        return time.monotonic()
    return float("inf")


live_view.monotonic = monotonic
kwargs = dict(poll_seconds=0.3, state_dir=sys.argv[3], step_lock_wait_s=float(os.environ["RELAY_TEST_STEP_LOCK_WAIT"]))
if sys.argv[5] == "relays":
    import flows.relays_sharing_quota as relays_sharing_quota
    from relay.shared.spec import load

    name = load(sys.argv[1]).name

    def run(mode, **extra):
        summary = relays_sharing_quota.relays(specs=[sys.argv[1]], mode=mode, cap=2, **kwargs)
        return dict(summary["relays"][name], overall=summary["state"])
else:
    import flows.one_relay as one_relay

    def run(mode, **extra):
        return one_relay.relay(spec=sys.argv[1], mode=mode, **extra, **kwargs)
if sys.argv[2] == "tick-loop":  # a schedule's ticks, RELAY_TEST_TICK_EVERY seconds apart
    while True:
        summary = run("tick", tick_follow_seconds=0.2)
        if summary["state"] == "done":
            break
        time.sleep(float(os.environ["RELAY_TEST_TICK_EVERY"]))
else:
    summary = run(sys.argv[2])
print("RELAY-SUMMARY " + json.dumps(summary), flush=True)
'''


def run_ids_pushed(runs: List[KernelRun]) -> List[str]:
    return [r.run_id for r in runs]


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.01):
    """Poll `predicate` until it returns something truthy (returned); fail the test after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
