"""`relay logs NAME|SPEC [--session N] [--follow]`: a session's log, read from Kaggle.

The running session's (the kernel's current version's) comes from Kaggle's log stream, followed by
relay.orchestrator.live_progress.LiveSession, which reconnects after a drop and skips what the stream replays, so each
line is printed once. An earlier session's is the stored log of the newest kernel version that ran it.
"""
from __future__ import annotations

from typing import Callable, Optional

from relay.orchestrator import chain, live_progress
from relay.orchestrator.kaggle.types import KaggleError
from relay.orchestrator.status import FOLLOW_S, find_relay
from relay.shared.errors import InputError


def logs(target: str, backend_factory: Callable, session: Optional[int] = None, follow: bool = False,
         write: Callable[[str], None] = print, follow_s: float = FOLLOW_S) -> int:
    """`relay logs NAME|SPEC [--session N] [--follow]`: a session's log (the kernel's current one by default) from
    Kaggle's log stream, each line once across reconnects (relay.orchestrator.live_progress.LiveSession); with --follow
    until the session ends, else what the stream gives within `follow_s` seconds. An earlier session: the stored
    log of the newest kernel version that ran it."""
    name, _, backend, names, obs = find_relay(target, backend_factory, "relay logs")
    current = chain.parse_run_id(obs.kernel_run)
    if current is None:
        raise InputError(f"relay logs {name}: kernel {names.kernel} holds no session (deleted by `relay stop"
                         " --now`, or none pushed yet)")
    if session is not None and session != current[0]:
        events = _stored_log(backend, names, obs, session)
        if events is None:
            raise InputError(f"relay logs {name}: no version of kernel {names.kernel} ran session {session}"
                             f" (its current one runs session {current[0]})")
        for event in events:
            write(_line(event))
        return 0
    printing = [True]  # a line the stream gives after the command returned is not printed

    def show(event: dict) -> None:
        if printing[0]:
            write(_line(event))

    following = live_progress.LiveSession(backend, names.kernel, obs.kernel_run, on_event=show).start()
    following.wait(follow_s)
    while follow and not following.finished:
        following.wait(3600)
    printing[0] = False
    if following.ended:
        return 0
    if follow:  # the stream dropped more often than the reconnects allow
        raise KaggleError(f"relay logs {name}: Kaggle's log stream of {names.kernel} kept dropping; run it again")
    write(f"[relay logs: session {current[0]} ({obs.kernel_run}) is still running; --follow follows it to its end]")
    return 0


def _stored_log(backend, names: chain.Names, obs: chain.Observation, session: int) -> Optional[list]:
    """The stored log of the newest kernel version whose run is session `session`; None when no version ran it."""
    for version in range((obs.kernel_version or 1) - 1, 0, -1):
        parsed = chain.parse_run_id(backend.version_run(names.kernel, version))
        if parsed is not None and parsed[0] == session:
            return backend.version_log(names.kernel, version)
    return None


def _line(event: dict) -> str:
    return str(event.get("data", "")).rstrip("\n")
