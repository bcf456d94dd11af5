"""Runs pushed kernels as local processes, the way a Kaggle session would.

Each version runs `sys.executable source.py` (so it gets this venv; with `warm_modules`, forked warm instead:
warm_zygote.py) in its own process group, cwd = its working folder, with mounted inputs under input/<slug> named by KAGGLE_INPUT_DIR and the working folder by
KAGGLE_WORKING_DIR; the environment is built from scratch, so no credential of the emulator's host process
reaches a kernel. Enforced: the session timeout (SIGTERM to the group, grace, SIGKILL; the output is what the
working folder holds then), the output cap, injected kills; GPU wall time is charged to the quota ledger. A
wedged version (the `wedge` fault) keeps RUNNING after its process ended (relay/emulator/kernels_api.py ends it);
a deleted one is killed at once and leaves the store alone.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

from relay.emulator.config import EmulatorConfig
from relay.emulator.faults import FaultPlan
from relay.emulator.protocol import tree_size
from relay.emulator.store import Store, write_json
from relay.shared.warm_start import WarmStarter

log = logging.getLogger(__name__)
NO_INTERNET_PROXY = "http://127.0.0.1:9"  # a closed port: well-behaved HTTP clients fail fast, as offline
# What Kaggle shows for a batch run stopped at the session limit: status CANCEL_ACKNOWLEDGED and this message
SESSION_LIMIT_STATUS = "CANCEL_ACKNOWLEDGED"
IMPORT_TIME_VARIABLES = ("OMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH_", "CUDA_")
SESSION_LIMIT_MESSAGE = "Your notebook was stopped because it exceeded the max allowed execution duration"


class KernelRunner:
    def __init__(self, store: Store, config: EmulatorConfig, faults: FaultPlan):
        self.store, self.config, self.faults = store, config, faults
        self.stopping = threading.Event()
        self.threads: Dict[str, threading.Thread] = {}
        self.logs: Dict[str, List[dict]] = {}   # live logs of versions in flight
        self.expired: set = set()               # versions whose session limit was moved to now (expire_now)
        self.deleted: set = set()               # versions whose kernel was deleted: killed, nothing recorded
        self.lock = threading.Lock()

    def start(self, ref: str, number: int) -> None:
        key = f"{ref}/v{number}"
        thread = threading.Thread(target=self._guarded, args=(ref, number), name=f"kernel {key}", daemon=True)
        with self.lock:
            self.threads[key] = thread
            self.logs[key] = []
            self.deleted.discard(key)  # a kernel deleted and pushed again starts its versions at 1 again
            self.expired.discard(key)
        thread.start()

    def expire_now(self, ref: str, number: int) -> None:
        """Reach version `number`'s session limit now (SIGTERM, grace, SIGKILL, CANCEL_ACKNOWLEDGED), as if its
        time were up: tests trigger the timeout on an event instead of waiting a machine-dependent time."""
        with self.lock:
            self.expired.add(f"{ref}/v{number}")

    def delete(self, ref: str, number: int) -> None:
        """The kernel was deleted (DeleteKernel): SIGKILL its process now; the store no longer holds the version."""
        with self.lock:
            self.deleted.add(f"{ref}/v{number}")
            thread = self.threads.get(f"{ref}/v{number}")
        if thread is not None and thread is not threading.current_thread():
            thread.join(10)

    def live_log(self, ref: str, number: int) -> Optional[List[dict]]:
        with self.lock:
            entries = self.logs.get(f"{ref}/v{number}")
            return list(entries) if entries is not None else None

    def stop(self, timeout: float = 10.0) -> None:
        self.stopping.set()
        for thread in list(self.threads.values()):
            thread.join(timeout)

    # -- one session -----------------------------------------------------------------------------
    def _guarded(self, ref: str, number: int) -> None:
        try:
            self._run(ref, number)
        except Exception as exc:  # noqa: BLE001 - a runner bug must end the session, not hang it
            log.exception("kernel %s v%d: runner failed", ref, number)
            self._finish(ref, number, "ERROR", f"emulator runner error: {exc}", None, [])

    def _run(self, ref: str, number: int) -> None:
        version = self.store.kernel_version(ref, f"v{number}")
        if self.stopping.wait(self.config.queue_delay):
            return self._finish(ref, number, "ERROR", "The emulator stopped before this session ran.", None, [])
        if f"{ref}/v{number}" in self.deleted:
            return self._finish(ref, number, "ERROR", "deleted", None, [])
        base = self.store.kernel_dir(ref, number)
        working, inputs = base / "working", base / "input"
        for folder in (working, inputs, base / "home", base / "tmp"):
            folder.mkdir(parents=True, exist_ok=True)
        self._mount(version, inputs)
        starter = self._warm_starter()  # ready before the session's clock starts
        with self.store.lock:
            version.update(status="RUNNING", started=time.time())
            self.store.save()
        started = version["started"]
        entries = self.logs[f"{ref}/v{number}"]
        proc = self._launch(starter, ["-u", str(base / "source.py")], working, self._env(version, base))
        readers = [threading.Thread(target=self._collect, args=(stream, name, started, entries), daemon=True)
                   for stream, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))]
        for reader in readers:
            reader.start()
        reason = self._supervise(proc, ref, number, started, version["timeout_s"], working)
        for reader in readers:
            reader.join(5)
        rc = proc.returncode
        wedged = version.get("wedge") and reason != SESSION_LIMIT_MESSAGE and not self.stopping.is_set()
        if reason is None and rc == 0:
            return self._finish(ref, number, "COMPLETE", "", rc, entries, wedged)
        if reason == SESSION_LIMIT_MESSAGE:
            if not self.config.timeout_keeps_output:
                shutil.rmtree(working, ignore_errors=True)
                working.mkdir()
            return self._finish(ref, number, SESSION_LIMIT_STATUS, reason, rc, entries)
        message = reason or f"Kernel exited with code {rc}"
        return self._finish(ref, number, "ERROR", message, rc, entries, wedged)

    def _supervise(self, proc, ref: str, number: int, started: float,
                   timeout_s: float, working: Path) -> Optional[str]:
        deadline = started + self.config.wall(timeout_s)
        kill_at = self.faults.kill_at(ref, number)
        next_size_check = 0.0
        key = f"{ref}/v{number}"
        while proc.poll() is None:
            now = time.time()
            if key in self.deleted:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
                return "deleted"
            if now >= deadline or key in self.expired:
                self._terminate(proc)
                return SESSION_LIMIT_MESSAGE
            if kill_at is not None and now - started >= kill_at:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
                return "The kernel was killed (injected fault)."
            if self.stopping.is_set():
                self._terminate(proc, grace=min(1.0, self.config.sigterm_grace))
                return "The emulator stopped while this session ran."
            if now >= next_size_check:
                next_size_check = now + 0.5
                if tree_size(working) > self.config.output_cap_bytes:
                    self._terminate(proc)
                    return f"Output exceeds the {self.config.output_cap_bytes / 1e9:g} GB limit of the working folder."
            time.sleep(0.05)
        _signal_group(proc, signal.SIGKILL)  # leftovers the kernel started must not outlive it
        if tree_size(working) > self.config.output_cap_bytes:
            return f"Output exceeds the {self.config.output_cap_bytes / 1e9:g} GB limit of the working folder."
        return None

    def _terminate(self, proc, grace: Optional[float] = None) -> None:
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(self.config.sigterm_grace if grace is None else grace)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(proc, signal.SIGKILL)
        proc.wait()

    @staticmethod
    def _collect(stream, name: str, started: float, entries: List[dict]) -> None:
        for raw in iter(stream.readline, b""):
            entries.append({"stream_name": name, "time": round(time.time() - started, 3),
                            "data": raw.decode("utf-8", "replace")})
        stream.close()

    def _finish(self, ref: str, number: int, status: str, failure: str, rc: Optional[int], entries: list,
                wedged: bool = False) -> None:
        """Record how the run ended; a wedged one only remembers it (its status stays RUNNING, its GPU time
        runs on: KernelsService._end_wedge records it later); a deleted one records nothing (DeleteKernel did)."""
        key = f"{ref}/v{number}"
        with self.store.lock:  # one step: a reader never sees the run ended but not yet charged (quota 0)
            if key in self.deleted:
                with self.lock:
                    self.logs.pop(key, None)
                return log.info("kernel %s v%d: deleted", ref, number)
            write_json(self.store.kernel_dir(ref, number) / "log.json", entries)
            version = self.store.kernel_version(ref, f"v{number}")
            if wedged:
                version["wedged"] = {"status": status, "failure": failure, "exit_code": rc}
            else:
                self.end(ref, version, status, failure, rc, time.time())
            self.store.save()
        with self.lock:
            self.logs.pop(key, None)
        log.info("kernel %s v%d: %s %s%s", ref, number, status, failure, " (wedged: still RUNNING)" if wedged else "")

    def end(self, ref: str, version: dict, status: str, failure: str, rc: Optional[int], ended: float,
            charge: bool = True) -> None:
        """A run's end in the store, its GPU time charged to the quota unless `charge` is False (a deleted kernel's
        session, charged when its ghost ends; the caller holds the store's lock)."""
        version.update(status=status, failure=failure, ended=ended, exit_code=rc)
        if charge and version.get("enable_gpu") and version.get("started"):
            self.store.charge(self.store.kernels[ref]["owner"], ref, version["number"], version["started"], ended,
                              self.config.time_scale)

    def _warm_starter(self) -> Optional[WarmStarter]:
        """The zygote sessions are forked from (warm_zygote.py), None without `warm_modules`."""
        if not self.config.warm_modules:
            return None
        # What the warm modules read when imported (threads, devices) must be set when the zygote imports them.
        at_import = {k: v for k, v in self.config.kernel_env.items() if k.startswith(IMPORT_TIME_VARIABLES)}
        zygote_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", **at_import}
        return WarmStarter.shared(self.config.warm_modules, zygote_env)

    @staticmethod
    def _launch(starter: Optional[WarmStarter], args: List[str], cwd: Path, env: dict):
        """`python ARGS` in a process group of its own: a fresh interpreter, or forked warm."""
        if starter is None:
            return subprocess.Popen([sys.executable, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True)
        return starter.start(args, cwd, env)

    # -- environment -----------------------------------------------------------------------------
    def _mount(self, version: dict, inputs: Path) -> None:
        for source in version["sources"]:
            owner, slug = source["ref"].split("/", 1)
            if self.config.mount_layout == "nested":  # Kaggle's layout since 2026-08
                folder = "datasets" if source["kind"] == "dataset" else "notebooks"
                target = inputs / folder / owner / slug
            else:                                     # older images: <input>/<slug>
                target = inputs / slug
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists():
                continue
            if source["kind"] == "dataset":
                origin = self.store.dataset_dir(source["ref"], source["version"])
            else:
                origin = self.store.kernel_dir(source["ref"], source["version"]) / "working"
            shutil.copytree(origin, target, copy_function=_link_or_copy, symlinks=False)

    def _env(self, version: dict, base: Path) -> dict:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(base / "home"),
               "TMPDIR": str(base / "tmp"), "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1",
               "KAGGLE_INPUT_DIR": str(base / "input"), "KAGGLE_WORKING_DIR": str(base / "working"),
               "KAGGLE_KERNEL_RUN_TYPE": "Batch", "KAGGLE_EMULATOR": "1"}
        if not version.get("enable_internet"):
            for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
                env[name] = NO_INTERNET_PROXY
        env.update(self.config.kernel_env)
        env.update(version.get("env") or {})  # the `machine` fault: what this session runs on
        return env


def _link_or_copy(src: str, dst: str) -> None:
    """Hard links keep mounting a large checkpoint cheap; fall back to a copy across filesystems."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _signal_group(proc, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def read_log(path: Path) -> list:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return []
