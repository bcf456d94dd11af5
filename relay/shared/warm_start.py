"""Processes started warm: the starter's side of warm_zygote.py (why and how: there).

Two users name the modules imported once in a zygote, each off by default (a fresh interpreter per process):
the emulator's runner (`EmulatorConfig.warm_modules`) and `relay verify-resume` (RELAY_WARM_MODULES,
relay/kernel/verify.py). `WarmStarter.shared` keeps one zygote per set of modules and startup environment in
this process (every emulator of a test worker shares it), and `start` returns a `WarmProcess`, the part of
subprocess.Popen they use. Protocol, JSON lines on a socket pair: the zygote says {"ready"} once it imported
the modules; the starter sends {"id", "argv", "cwd", "env"} with the child's stdout and stderr write ends as
passed descriptors; the zygote answers {"id", "pid"} once forked, and {"exit": pid, "code"} when that child ends
(the code as Popen's: negative for a signal).
"""
from __future__ import annotations

import atexit
import itertools
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

ZYGOTE = Path(__file__).with_name("warm_zygote.py")
_SHARED: Dict[Tuple, "WarmStarter"] = {}
_SHARED_LOCK = threading.Lock()


class WarmStarter:
    def __init__(self, modules: Sequence[str], env: Dict[str, str]):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.zygote = subprocess.Popen([sys.executable, str(ZYGOTE), str(theirs.fileno()), *modules],
                                       pass_fds=[theirs.fileno()], env=env, cwd="/", stdin=subprocess.DEVNULL,
                                       start_new_session=True)
        theirs.close()
        self.sock, self.ids = ours, itertools.count()
        self.send_lock, self.changed = threading.Lock(), threading.Condition()
        self.pids: Dict[int, dict] = {}   # request id -> the zygote's answer
        self.codes: Dict[int, int] = {}   # pid -> exit code
        self.ready = False
        self.closed = False                # the zygote's end of the socket closed: it has ended, or is ending
        threading.Thread(target=self._read, name="warm-start replies", daemon=True).start()

    @classmethod
    def shared(cls, modules: Sequence[str], env: Dict[str, str]) -> "WarmStarter":
        key = (tuple(modules), tuple(sorted(env.items())))
        with _SHARED_LOCK:
            starter = _SHARED.get(key)
            if starter is None or starter._gone():
                starter = _SHARED[key] = cls(modules, env)
        with starter.changed:  # its imports take seconds: not inside a session's clock
            if not starter.changed.wait_for(lambda: starter.ready or starter._gone(), timeout=300):
                raise RuntimeError("warm start: the zygote did not import its modules within 300 s")
        return starter

    def start(self, args: Sequence[str], cwd: Path, env: Dict[str, str], output: Optional[int] = None
              ) -> "WarmProcess":
        """`python ARGS` in a session and process group of its own, cwd, env, stdout and stderr piped (or both
        written to the descriptor `output`: WarmProcess.stdout and .stderr are None then)."""
        if output is not None:
            out_r, out_w, err_r, err_w = None, os.dup(output), None, os.dup(output)
        else:
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
        request_id = next(self.ids)
        request = {"id": request_id, "argv": list(args), "cwd": str(cwd), "env": env}
        try:
            with self.send_lock:
                socket.send_fds(self.sock, [json.dumps(request).encode() + b"\n"], [out_w, err_w])
            with self.changed:
                if not self.changed.wait_for(lambda: request_id in self.pids or self._gone(), timeout=120):
                    raise RuntimeError("warm start: the zygote did not answer within 120 s")
                answer = self.pids.pop(request_id, None)
        except BaseException:
            _close(out_r, err_r)
            raise
        finally:
            _close(out_w, err_w)
        if answer is None or "pid" not in answer:
            _close(out_r, err_r)
            raise RuntimeError(f"warm start: {answer.get('error') if answer else 'the zygote exited'}"
                               f" (zygote exit code {self.zygote.poll()})")
        stdout, stderr = (None, None) if output is not None else (os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"))
        return WarmProcess(self, answer["pid"], stdout, stderr)

    def stop(self) -> None:
        try:  # the zygote leaves on end of file (shutdown: the reader thread's file keeps the socket open)
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        try:
            self.zygote.wait(10)
        except subprocess.TimeoutExpired:
            self.zygote.kill()
            self.zygote.wait()

    def exit_code(self) -> Optional[int]:
        """The zygote's exit status once it has ended (an import failed, or it was stopped), None while it serves."""
        return self.zygote.wait() if self.closed else self.zygote.poll()

    def _gone(self) -> bool:
        # its socket closes as it exits, a moment before it can be reaped: waiters are woken by the close only
        return self.closed or self.zygote.poll() is not None

    def _read(self) -> None:
        for line in self.sock.makefile("rb"):
            message = json.loads(line)
            with self.changed:
                if "ready" in message:
                    self.ready = True
                elif "exit" in message:
                    self.codes[message["exit"]] = message["code"]
                elif "id" in message:
                    self.pids[message["id"]] = message
                self.changed.notify_all()
        with self.changed:
            self.closed = True
            self.changed.notify_all()


def _close(*fds: Optional[int]) -> None:
    for fd in fds:
        if fd is not None:
            os.close(fd)


class WarmProcess:
    """What the runner uses of subprocess.Popen: pid (also its process group), stdout, stderr, poll, wait."""

    def __init__(self, starter: WarmStarter, pid: int, stdout, stderr):
        self.starter, self.pid, self.stdout, self.stderr = starter, pid, stdout, stderr
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            with self.starter.changed:
                self.returncode = self.starter.codes.pop(self.pid, None)
                if self.returncode is None and self.starter._gone():
                    self.returncode = -9  # the zygote died with its children unreported: as if killed
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        with self.starter.changed:
            if not self.starter.changed.wait_for(lambda: self.poll() is not None, timeout=timeout):
                raise subprocess.TimeoutExpired(f"warm kernel {self.pid}", timeout)
        return self.returncode


@atexit.register
def _stop_shared() -> None:
    with _SHARED_LOCK:
        for starter in _SHARED.values():
            starter.stop()
        _SHARED.clear()
