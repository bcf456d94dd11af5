"""Fixtures for the Kaggle backend and emulator tests (import them into a test module with
`from tests.kaggle_fixtures import *`, or `from kaggle_fixtures import ...`).

Every test gets its own HOME and TMPDIR (the kaggle client keeps upload-resume state in $TMPDIR), no KAGGLE_*
variables from the developer's shell, emulators on random free ports of 127.0.0.1 that are stopped at
teardown, and a fast bounded retry policy.
"""
from __future__ import annotations

import atexit
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable, List

import pytest

from relay.emulator import Emulator, EmulatorConfig
from relay.emulator.runner import IMPORT_TIME_VARIABLES
from relay.shared.warm_start import ZYGOTE
from relay.orchestrator.kaggle import ClientBackend, KaggleCredentials, RetryPolicy

USER = "alice"
FAKE_KEY = "f4k3k3y-0123456789abcdef-LEAKCHECK"
VENV_BIN = Path(sys.executable).parent
KERNEL_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# Sessions are forked from a process that imported these once (relay/shared/warm_zygote.py): ~3 CPU s less each
# for torch, ~0.06 s more for the libraries every `relay train` imports next (0.39-0.44 -> 0.32-0.37 CPU s a toy
# session; all installed on Kaggle's images; the relay itself comes from the kernel's own bundle, as on Kaggle). RELAY_TEST_WARM=0 runs every session in a
# fresh interpreter instead.
WARM_MODULES = (["torch", "torch._dynamo", "yaml", "pydantic.main", "psutil", "safetensors.torch", "tqdm.auto"]
                if os.environ.get("RELAY_TEST_WARM", "1") != "0" else [])
# Libraries the Accelerate and HF examples import (a tiny BERT, its tokenizer, Trainer): ~1 CPU s more a session
# after WARM_MODULES; only their verify-resume tests name them (an extra ~1 s once for every other one's zygote).
HF_MODULES = ("accelerate", "transformers.models.bert.modeling_bert", "transformers.tokenization_utils_fast")
_WARM_LISTENER: dict = {}


def verify_warm(*extra: str) -> dict:
    """The variables that make `relay verify-resume` fork its sessions from a zygote of its own that imported
    WARM_MODULES and `extra` (RELAY_WARM_MODULES, relay/kernel/verify.py); {} under RELAY_TEST_WARM=0: cold."""
    return {"RELAY_WARM_MODULES": ",".join([*WARM_MODULES, *extra])} if WARM_MODULES else {}
_WARM_LOCK = threading.Lock()


def warm_python(env: dict) -> tuple[str, dict]:
    """(python, env) to run `python -m relay ...` forked warm by a listener of this worker, in the caller's process
    group (relay/shared/warm_zygote.py --listen; a process started in a session of its own, or any other command
    line, runs the real interpreter). The returned pid is the shim's, which stands for the process: tests that
    read a process's own state (/proc, its children) run the real interpreter."""
    if not WARM_MODULES:
        return sys.executable, env
    with _WARM_LOCK:
        if not _WARM_LISTENER:
            zygote_env = {"PATH": os.environ["PATH"], "LANG": "C.UTF-8", "TMPDIR": tempfile.gettempdir(),
                          **{k: v for k, v in KERNEL_ENV.items() if k.startswith(IMPORT_TIME_VARIABLES)}}
            listener = subprocess.Popen([sys.executable, str(ZYGOTE), "--listen", *WARM_MODULES], cwd="/",
                                        env=zygote_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            _WARM_LISTENER.update(json.loads(listener.stdout.readline()), process=listener)
            atexit.register(listener.stdin.close)  # it ends with this process
    return _WARM_LISTENER["python"], {**env, "RELAY_WARM_SOCKET": _WARM_LISTENER["socket"]}


@pytest.fixture
def isolated_env(tmp_path, monkeypatch):
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    tmp.mkdir()
    for name in list(os.environ):
        if name.startswith("KAGGLE_") or name.lower() in ("http_proxy", "https_proxy", "no_proxy"):
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # gettempdir() is cached per process
    return tmp_path


@pytest.fixture
def make_emulator(isolated_env) -> Callable[..., Emulator]:
    """make_emulator(**EmulatorConfig fields) -> a started Emulator with user alice/FAKE_KEY."""
    started: List[Emulator] = []

    def make(state_dir: Path = None, **settings) -> Emulator:
        settings.setdefault("users", {USER: FAKE_KEY})
        settings.setdefault("kernel_env", dict(KERNEL_ENV))
        settings.setdefault("warm_modules", list(WARM_MODULES))
        settings.setdefault("sigterm_grace", 2.0)
        settings.setdefault("retry_after", "0")
        emulator = Emulator(state_dir or isolated_env / f"state{len(started)}", EmulatorConfig(**settings))
        started.append(emulator.start())
        return emulator

    yield make
    for emulator in started:
        emulator.stop()


def fast_policy(seed: int = 0, attempts: int = 12) -> RetryPolicy:
    return RetryPolicy(attempts=attempts, base_delay_s=0.01, multiplier=2.0, max_delay_s=0.2,
                       rng=random.Random(seed))


def backend_for(emulator: Emulator, seed: int = 0, attempts: int = 12, **kwargs) -> ClientBackend:
    kwargs.setdefault("dataset_poll_s", 0.1)
    kwargs.setdefault("dataset_wait_s", 60)
    return ClientBackend(KaggleCredentials(USER, key=FAKE_KEY), emulator.url, fast_policy(seed, attempts), **kwargs)


def cli_env(port: int, home: Path, tmp: Path, user: str = USER, key: str = FAKE_KEY) -> dict:
    """The environment `relay emulator serve` tells a user to export, for an unmodified kaggle CLI."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KAGGLE_") and k.lower() not in ("http_proxy", "https_proxy", "no_proxy")}
    env.update(HOME=str(home), TMPDIR=str(tmp), KAGGLE_USERNAME=user, KAGGLE_KEY=key,
               KAGGLE_API_ENVIRONMENT="LOCALHOST", HTTP_PROXY=f"http://127.0.0.1:{port}")
    return env


def run_kaggle(env: dict, *args: str, cwd: Path = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([str(VENV_BIN / "kaggle"), *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def push_script(backend: ClientBackend, kernel: str, source: str, gpu: bool = True, datasets=(),
                timeout_s: int = None, title: str = None):
    """Push a plain script through the real client (kernels_push), for tests of the emulator's limits."""
    import json as _json

    folder = Path(tempfile.mkdtemp(prefix="push-"))
    (folder / "run.py").write_text(source)
    (folder / "kernel-metadata.json").write_text(_json.dumps({
        "id": kernel, "title": title or kernel.split("/")[1].replace("-", " ").title(), "code_file": "run.py",
        "language": "python", "kernel_type": "script", "enable_gpu": gpu, "enable_internet": False,
        "dataset_sources": list(datasets)}))
    timeout = str(timeout_s) if timeout_s else None
    return backend.client.run("push", lambda api: api.kernels_push(str(folder), timeout=timeout))


def wait_state(backend: ClientBackend, kernel: str, timeout: float = 60):
    import time as _time

    deadline = _time.time() + timeout
    while _time.time() < deadline:
        status = backend.kernel_status(kernel)
        if status.state.finished:
            return status
        _time.sleep(0.1)
    raise AssertionError(f"{kernel} did not finish in {timeout}s")


# The toy recipe's spec as the text a SessionKernel carries (backend and emulator tests).
TOY_SPEC_YAML = """\
name: toy-relay
recipe: toy
seed: 0
params: {n_train: 64, n_eval: 16, hidden: 8}
optim: {micro_batch: 8, epochs: 1, log_every_steps: 2}
data: {num_workers: 0}
session: {budget: none, threads: 1, safety_margin: 0}
"""
