"""A fault the tests and benches inject into a relay on the emulator: the SIGKILL of a session kernel inside a
checkpoint save.

A kernel run with RELAY_TEST_STOP_MID_SAVE=<step> (relay/shared/environment.py; the seam is in
relay/kernel/session/checkpoint.py) stops itself (SIGSTOP) in its first save at or past that step, its files written
and its folder not yet renamed. The killer finds that process stopped and kills it there, so the save is provably
torn on a machine of any speed: an event, not a timer.
"""
from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Callable, Optional

TORN_PREFIX = ".tmp-step-"  # a save in progress: `.tmp-step-<step>-<pid>` (its writer's pid)


class MidSaveKiller(threading.Thread):
    """SIGKILLs the first process of kernel `kernel` (of Emulator `emu`) that the seam stopped inside a save after
    it committed saves of its own (so the relay can salvage one); continues (SIGCONT) any later one. `killed`: the
    kernel version, the run id (`run_id_of` its source: the relay's marker, which the emulator does not read), the
    torn folder and the committed ones. A kill the caller does not want: `vet` raises, before it lands."""

    def __init__(self, emu, kernel: str, run_id_of: Callable[[str], Optional[str]] = lambda source: None):
        super().__init__(daemon=True, name="mid-save-killer")
        self.emu, self.kernel, self.run_id_of = emu, kernel, run_id_of
        self.done = threading.Event()
        self.killed: Optional[dict] = None
        self.continued: list = []  # the kernel versions continued
        self.error: Optional[BaseException] = None

    def vet(self, kill: dict) -> None:
        """Raise if this kill (as `killed` will say it) is not the one wanted."""

    def run(self) -> None:
        try:
            while not self.done.wait(0.05):
                with self.emu.store.lock:
                    kernel = self.emu.store.kernels.get(self.kernel) or {"versions": []}
                    running = [v["number"] for v in kernel["versions"] if v["status"] == "RUNNING"]
                for number in running:
                    self._check(number)
        except BaseException as exc:  # noqa: BLE001 - the caller reports it
            self.error = exc

    def _check(self, number: int) -> None:
        folder = self.emu.store.kernel_dir(self.kernel, number) / "working" / "relay" / "checkpoints"
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            return
        for torn in (n for n in names if n.startswith(TORN_PREFIX)):
            pid = int(torn.rsplit("-", 1)[1])
            if not stopped(pid):
                continue
            if self.killed is not None:
                os.kill(pid, signal.SIGCONT)
                self.continued.append(number)
                continue
            final = torn[len(".tmp-"):].rsplit("-", 1)[0]
            committed = sorted(n for n in names if n.startswith("step-"))
            if not ((folder / torn).is_dir() and not (folder / final).exists() and committed):
                raise AssertionError(f"kernel version {number} stopped outside a torn save after saves: {names}")
            source = (self.emu.store.kernel_dir(self.kernel, number) / "source.py").read_text()
            kill = {"version": number, "run_id": self.run_id_of(source), "torn": torn, "committed": committed}
            self.vet(kill)
            os.killpg(os.getpgid(pid), signal.SIGKILL)
            self.killed = kill


def stopped(pid: int) -> bool:
    """Whether process `pid` is stopped by a signal (state T in /proc/PID/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "T"
