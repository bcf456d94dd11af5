"""Session-wide test setup shared by every test module.

- One torch thread (on this shared 2-core box more threads make step times jump 3-80x, and exact resume
  needs the same thread count in every process anyway).
- Offline Hugging Face: without HF_HUB_OFFLINE a `from_pretrained("name")` spends ~27 s failing on DNS.
- `toy_spec(directory, **overrides)`: writes a small `toy` recipe spec and returns its path.
- `relay_cli`: runs `python -m relay ...` in a new process with the venv's python, an isolated HOME and TMPDIR
  and a working directory outside the repository.
- Two tiers: a test that starts a process (a Prefect server, the emulator's kernels, a `relay` subprocess,
  spawned workers) is marked `slow` from the fixtures it uses; `make test-fast` (`-m "not slow"`) runs the rest.
  In that tier a test that starts a process anyway fails and says how to mark it, so the tiers cannot drift.
- In parallel (`make test` runs pytest-xdist workers): each worker is a session of its own, with its own
  Prefect server, temporary folders (the worker's basetemp) and PREFECT_HOME, so workers share no state; the
  tests that start a whole relay are handed out first, so the longest do not start last.
"""
from __future__ import annotations

import _posixsubprocess
import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import pytest
import yaml

# Session fixtures of the relay tests (one Prefect server, reference runs), loaded once with assert rewriting.
pytest_plugins = ["relay_fixtures"]

for _name, _value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                      "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_name, _value)

# A worker of pytest-xdist keeps Prefect's profile and local database apart from the other workers'.
if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("PREFECT_HOME"):
    os.environ["PREFECT_HOME"] = os.path.join(os.environ["PREFECT_HOME"], os.environ["PYTEST_XDIST_WORKER"])
    os.makedirs(os.environ["PREFECT_HOME"], exist_ok=True)  # Prefect makes only the last folder (a fresh clone's
    # .prefect is not there yet: "Failed to create the Prefect home directory")

import torch  # noqa: E402

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable  # the venv's python when run as `.venv/bin/python -m pytest`

TOY_SPEC: dict[str, Any] = {
    "name": "toy-test",
    "recipe": "toy",
    "seed": 3,
    "params": {"n_train": 256, "n_eval": 64, "hidden": 64},
    "optim": {"micro_batch": 8, "grad_accum": 2, "lr": 0.003, "epochs": 2, "warmup_steps": 5,
              "log_every_steps": 8},
    "data": {"num_workers": 0},
    "session": {"threads": 1, "save_every": "1h", "safety_margin": 0},
}


# Fixtures that start processes: a test using any of them (directly or through another fixture) is `slow`.
SLOW_FIXTURES = {"relay_cli", "prefect_api", "make_emulator", "relay_env", "reference", "spawns_processes"}


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts processes (Prefect server, emulator kernels, subprocesses)")


@pytest.hookimpl(tryfirst=True)  # before xdist starts the workers
def pytest_sessionstart(session):
    config = session.config
    if (getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER")
            and "not slow" not in (config.option.markexpr or "")):
        # The xdist controller, idle otherwise: it makes the run's migrated Prefect database (~10 CPU s) while the
        # workers import torch and Prefect, instead of every worker's first relay test waiting on one that makes it.
        import threading

        import prefect_template

        prefect_template.ROOT = config._tmp_path_factory.getbasetemp()  # the workers' basetemps are in it
        threading.Thread(target=prefect_template.template, name="prefect-template", daemon=True).start()


# The order in which xdist workers are handed tests: a whole relay (Prefect + emulator + kernels, 0.5-3 min)
# first, then what starts a server or the emulator, then other processes, then the tests that start none.
LONGEST_FIRST = ({"relay_env"}, {"prefect_api", "make_emulator", "reference"}, SLOW_FIXTURES)


def _expected_length(item) -> int:
    names = set(getattr(item, "fixturenames", ()))
    return next((rank for rank, fixtures in enumerate(LONGEST_FIRST) if names & fixtures), len(LONGEST_FIRST))


# Session fixtures of the relay_fixtures plugin: a module that imports one gets a copy of its own, set up a second
# time (a second Prefect server that takes this process's Prefect settings from the first; a second set of
# reference runs).
PLUGIN_SESSION_FIXTURES = ("prefect_api", "reference")


def pytest_collection_modifyitems(config, items):
    plugin = sys.modules["relay_fixtures"]
    for module in {item.module for item in items if getattr(item, "module", None) is not None}:
        imported = [name for name in PLUGIN_SESSION_FIXTURES if vars(module).get(name) is getattr(plugin, name)]
        if imported:
            raise pytest.UsageError(f"{module.__file__}: imports the session fixture(s) {imported} from "
                                    "relay_fixtures; request them by name only")
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker sorts alike: xdist checks the collections match
        items.sort(key=_expected_length)


@pytest.fixture(scope="session", autouse=True)
def _prefect_template_root(tmp_path_factory):
    """Where tests/prefect_template.py keeps the run's migrated Prefect database: the run's temporary folder,
    shared by the xdist workers (each worker's is a folder in it)."""
    import prefect_template

    base = tmp_path_factory.getbasetemp()
    prefect_template.ROOT = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture
def spawns_processes():
    """Request this in a test that starts processes by itself (subprocess, torch.multiprocessing): it marks
    the test `slow`."""


# The test being run (its setup, call and teardown), for the fast tier's guard below.
_RUNNING: dict[str, Any] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _RUNNING["item"] = item


# What starts a process: subprocess binds _posixsubprocess.fork_exec at its import, so both names are patched.
_PROCESS_STARTERS = [(_posixsubprocess, "fork_exec"), (subprocess, "_fork_exec")] + [
    (os, name) for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system") if hasattr(os, name)]


@pytest.fixture(scope="session", autouse=True)
def _fast_tier_starts_no_process(request):
    """In the fast tier, starting a process is a mistake in the tier, reported as such (not a slow pass). Patched
    for the whole session, so that a module- or session-scoped fixture that starts one is caught too."""
    if "not slow" not in (request.config.option.markexpr or ""):
        yield
        return

    def guard(original):
        def refuse(*args, **kwargs):
            item = _RUNNING.get("item")
            if item is not None and item.get_closest_marker("slow"):
                return original(*args, **kwargs)
            raise RuntimeError(f"{getattr(item, 'nodeid', 'a test')} starts a process but is not marked slow: request the "
                               "`spawns_processes` fixture (tests/conftest.py) so `make test-fast` leaves it out")
        return refuse

    with pytest.MonkeyPatch.context() as patch:
        for owner, name in _PROCESS_STARTERS:
            patch.setattr(owner, name, guard(getattr(owner, name)))
        yield


def deep_merge(base: dict, overrides: dict) -> dict:
    """`overrides` may nest dicts ({"optim": {"lr": 1}}) or use dotted keys ({"optim.lr": 1}); None deletes."""
    from relay.shared.spec import override

    return override(base, overrides, none_deletes=True)


def toy_spec_dict(*layers: dict, **overrides) -> dict:
    """TOY_SPEC with each layer of overrides merged in order, then the keyword overrides."""
    out = TOY_SPEC
    for layer in (*layers, overrides):
        out = deep_merge(out, layer)
    return copy.deepcopy(out)


def write_spec(directory: Path, data: dict, name: str = "spec.yaml") -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture
def toy_spec():
    """toy_spec(directory, name="spec.yaml", **overrides) -> Path of a written toy spec."""

    def make(directory: Path, name: str = "spec.yaml", **overrides) -> Path:
        return write_spec(directory, toy_spec_dict(**overrides), name)

    return make


class RelayCLI:
    """`python -m relay` in a fresh process: isolated HOME/TMPDIR, offline, cwd outside the repository."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.home, self.tmp, self.cwd = self.root / "home", self.root / "tmp", self.root / "cwd"
        for d in (self.home, self.tmp, self.cwd):
            d.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("KAGGLE_", "PYTEST_", "RELAY_")) and k not in ("PYTHONPATH", "COV_CORE_SOURCE")}
        env.update(HOME=str(self.home), TMPDIR=str(self.tmp), PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1",
                   OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   MPLCONFIGDIR=str(self.home / ".mpl"), RELAY_DEVICE="cpu")
        from kaggle_fixtures import verify_warm

        env.update(verify_warm())  # verify-resume's sessions forked warm (unless RELAY_TEST_WARM=0)
        self.env = env

    def argv(self, *args: str, preimport: Sequence[str] = ()) -> list[str]:
        if not preimport:
            return [PYTHON, "-m", "relay", *map(str, args)]
        # Same entry point as `-m relay`, after importing some modules first (outside the session clock).
        code = ";".join([*(f"import {m}" for m in preimport), "import runpy",
                         "runpy.run_module('relay', run_name='__main__', alter_sys=True)"])
        return [PYTHON, "-c", code, *map(str, args)]

    def train_args(self, spec: Path, workdir: Path, budget: Optional[object] = None, *extra: str) -> list[str]:
        args = ["train", str(spec), "--workdir", str(workdir)]
        if budget is not None:
            args += ["--budget", str(budget)]
        return args + [str(e) for e in extra]

    def run(self, *args: str, timeout: float = 180, preimport: Sequence[str] = (),
            env: Optional[dict] = None) -> subprocess.CompletedProcess:
        """`env`: variables set over this CLI's (e.g. verify_warm(...)'s)."""
        from kaggle_fixtures import WARM_MODULES, warm_python

        if set(preimport) <= set(WARM_MODULES):  # forked warm, they are imported already: `-m relay` as it is
            preimport = ()
        python, env = warm_python({**self.env, **(env or {})})
        return subprocess.run([python, *self.argv(*args, preimport=preimport)[1:]], env=env, cwd=self.cwd,
                              capture_output=True, text=True, timeout=timeout)

    def popen(self, *args: str, preimport: Sequence[str] = (), **kwargs) -> subprocess.Popen:
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
        kwargs.setdefault("env", self.env)
        return subprocess.Popen(self.argv(*args, preimport=preimport), cwd=self.cwd, text=True, **kwargs)

    def train(self, spec: Path, workdir: Path, budget: Optional[object] = None, *extra: str,
              check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        proc = self.run(*self.train_args(spec, workdir, budget, *extra), **kwargs)
        if check and proc.returncode != 0:
            raise AssertionError(f"relay train exited {proc.returncode}\n--- stderr ---\n{proc.stderr[-4000:]}")
        return proc


@pytest.fixture(scope="session")
def relay_cli(tmp_path_factory) -> RelayCLI:
    return RelayCLI(tmp_path_factory.mktemp("relay-cli"))


@pytest.fixture
def register_recipe(monkeypatch):
    """register_recipe(name, cls): make a test recipe class known to the spec and the runtime (for this test).
    The class must live at module level of an imported module (the registry stores 'module:Class')."""
    from relay.kernel import recipes
    from relay.shared import params

    def register(name: str, cls: type) -> str:
        monkeypatch.setitem(recipes._REGISTRY, name, f"{cls.__module__}:{cls.__qualname__}")
        monkeypatch.setitem(params.BUILT_IN, name, cls.Params)  # what a spec validates `params:` with
        return name

    return register


def load_toy_spec(*layers: dict, **overrides):
    """A validated RunSpec of the toy recipe (for driving relay.kernel.run.run_session in-process)."""
    from relay.shared import spec

    return spec.validate(toy_spec_dict(*layers, **overrides), source="test-spec")


# RELAY_TEST_CPU_LOG=FILE: each test's CPU seconds, its processes' included (tests/cpu_log.py)
if os.environ.get("RELAY_TEST_CPU_LOG"):
    from cpu_log import pytest_runtest_protocol  # noqa: F401 (a hook: pytest finds it by name)
