"""Helpers for tests that stop and kill processes: the rank processes of a `relay train`, and the kill of a
kernel inside a checkpoint save (event-driven, so the kill is torn on a machine of any speed)."""
from __future__ import annotations

import psutil

from relay.emulator import mid_save_kill
from relay.orchestrator.chain import parse_run_id
from relay.orchestrator.kaggle.kernel_source import find_run_id


def ranks(proc) -> list[psutil.Process]:
    """The rank processes of a `relay train` process, rank 0 first (started in rank order): its children forked
    from it (on CPU), or the children of its forkserver (with GPUs; relay/kernel/session/distributed.py)."""
    launcher = psutil.Process(proc.pid)
    kids = []
    for child in launcher.children():
        try:
            if "forkserver" in " ".join(child.cmdline()):
                kids += [(p.create_time(), p) for p in child.children()]
            elif child.cmdline() == launcher.cmdline():
                kids.append((child.create_time(), child))
        except psutil.Error:  # a helper process that came and went while we looked
            continue
    return [p for _, p in sorted(kids, key=lambda kid: (kid[0], kid[1].pid))]


class MidSaveKiller(mid_save_kill.MidSaveKiller):
    """The emulator's mid-save kill (relay/emulator/mid_save_kill.py) of a RelayEnv's kernel: the killed session
    must be the second or a later one (the first has no checkpoint published before it to salvage from)."""

    def __init__(self, env):
        super().__init__(env.emu, env.kernel, run_id_of=find_run_id)

    def vet(self, kill: dict) -> None:
        assert (parse_run_id(kill["run_id"]) or (0, 0))[0] >= 2, kill


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
