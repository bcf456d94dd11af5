"""Helpers for tests that stop and kill processes: the rank processes of a `relay train`, and the kill of a
kernel inside a checkpoint save (event-driven, so the kill is torn on a machine of any speed)."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Optional

import psutil

from relay.orchestrator.chain import parse_run_id


def ranks(proc) -> list[psutil.Process]:
    """The rank processes of a `relay train` process, rank 0 first (started in rank order): the children of its
    forkserver (relay/kernel/session/distributed.py)."""
    kids = []
    for server in psutil.Process(proc.pid).children():
        try:
            if "forkserver" not in " ".join(server.cmdline()):
                continue
            kids += [(p.create_time(), p) for p in server.children()]
        except psutil.Error:  # a helper process that came and went while we looked
            continue
    return [p for _, p in sorted(kids, key=lambda kid: (kid[0], kid[1].pid))]


class MidSaveKiller(threading.Thread):
    """SIGKILLs the kernel that stops itself mid-save (the RELAY_TEST_STOP_MID_SAVE seam in
    relay.kernel.session.checkpoint: files written, folder not yet renamed) after committing checkpoints of its own
    (so the relay can salvage one); any later kernel the seam stops is continued. Event-driven: the kill lands
    inside the save on a machine of any speed."""

    def __init__(self, env):
        super().__init__(daemon=True, name="mid-save-killer")
        self.env, self.done = env, threading.Event()
        self.killed: Optional[dict] = None
        self.continued: list = []
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        try:
            while not self.done.is_set():
                for run in self.env.kernel_runs():
                    if run.status == "RUNNING":
                        self._check(run)
                time.sleep(0.05)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def _check(self, run) -> None:
        folder = self.env.emu.store.kernel_dir(self.env.kernel, run.version) / "working" / "relay" / "checkpoints"
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            return
        for torn in (n for n in names if n.startswith(".tmp-step-")):
            pid = int(torn.rsplit("-", 1)[1])
            if not _stopped(pid):
                continue
            final = torn[len(".tmp-"):].rsplit("-", 1)[0]
            committed = sorted(n for n in names if n.startswith("step-"))
            if self.killed is None:
                assert (folder / torn).is_dir() and not (folder / final).exists() and committed, (torn, names)
                assert (parse_run_id(run.run_id) or (0, 0))[0] >= 2, run
                os.killpg(os.getpgid(pid), signal.SIGKILL)
                self.killed = {"version": run.version, "run_id": run.run_id, "torn": torn, "committed": committed}
            else:
                os.kill(pid, signal.SIGCONT)
                self.continued.append(run.run_id)


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped by a signal (state T in /proc/PID/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def run_flow_with_a_kill_mid_save(relay_env, monkeypatch) -> tuple[dict, MidSaveKiller]:
    """The relay flow to its end while a MidSaveKiller watches its kernels; asserts a kernel was killed mid-save.
    Returns the flow's summary and the killer (which kernel it killed, which it continued)."""
    killer = MidSaveKiller(relay_env)
    killer.start()
    try:
        summary = relay_env.run_flow(monkeypatch)
    finally:
        killer.done.set()
        killer.join(5)
    assert killer.error is None and killer.killed, killer.error
    return summary, killer
