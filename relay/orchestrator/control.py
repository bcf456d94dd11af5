"""`relay stop NAME|SPEC [--now]` and `relay resume NAME|SPEC`: the user's say over a relay, recorded on Kaggle
(relay/orchestrator/kaggle/control_record.py) so that every orchestrator of the relay obeys it.

A stop lets the running session train on: it is handed over as usual, then nothing more is pushed. `--now` also
ends the running session, by deleting its kernel: Kaggle's public API has no cancel, so deleting is the only
lever, and what the session trained since the last published checkpoint is lost (said, and asked, first). A
resume lets the next `relay run` or tick go on from the last published checkpoint.
"""
from __future__ import annotations

from typing import Callable

from relay.orchestrator import chain, live_progress
from relay.orchestrator.kaggle import control_record
from relay.orchestrator.status import FOLLOW_S, find_relay
from relay.shared import progress_line


def stop(target: str, backend_factory: Callable, now: bool = False, yes: bool = False, why: str = "",
         emit=print, ask: Callable[[str], str] = input, follow_s: float = FOLLOW_S) -> int:
    name, _, backend, names, obs = find_relay(target, backend_factory, "relay stop")
    if obs.published is not None and obs.published.status == "done":
        emit(f"relay {name} is done: nothing to stop")
        return 0
    running = chain.decide(name, obs)
    # a session queued or training on Kaggle, or one Kaggle still reports running past its end (wedged)
    running = running if running.do in (chain.Do.WAIT, chain.Do.WEDGED) else None
    if obs.stopped_by_user and not (now and running):
        emit(f"relay {name} is stopped already ({obs.stopped_by_user}); `relay resume {name}` to go on")
        return 0
    previous = control_record.read(backend, names.owner, names.name) or {}
    ended_run = previous.get("ended_run")
    if now and running:
        emit(f"relay stop --now ends session {running.session} ({running.run_id}) by deleting its kernel"
             f" {names.kernel}: Kaggle has no other way to stop a session. {lost_progress(backend, names, obs, running, follow_s)}")
        if not yes and not _confirmed(ask, "Delete the kernel and lose that progress? [y/N] "):
            emit("nothing changed: the relay goes on")
            return 1
        ended_run = running.run_id
    # recorded before the kernel is deleted: an orchestrator that sees the kernel gone must also see the stop
    control_record.write(backend, names.owner, names.name, control_record.STOPPED, why, ended_run,
                         **control_record.carried_on(previous))
    step = obs.published_step
    if now and running:
        backend.delete_kernel(names.kernel)
        emit(f"relay {name}: session {running.session} ended (kernel {names.kernel} deleted); stopped at the last"
             f" published checkpoint, step {step}")
    elif running:
        emit(f"relay {name}: stopped; session {running.session} ({running.run_id}) trains on and is handed over as"
             f" usual, then nothing more is pushed (`relay stop {name} --now` ends it now)")
    else:
        emit(f"relay {name}: stopped at step {step}; nothing more is pushed")
    emit(f"every orchestrator of the relay sees the stop on Kaggle; `relay resume {name}` to go on")
    return 0


def resume(target: str, backend_factory: Callable, emit=print) -> int:
    name, _, backend, names, obs = find_relay(target, backend_factory, "relay resume")
    previous = control_record.read(backend, names.owner, names.name) or {}
    if previous.get("state") != control_record.STOPPED:
        emit(f"relay {name} is not stopped: nothing to resume")
        return 0
    # the run ended by `relay stop --now` stays known: the session is pushed again as a new attempt
    control_record.write(backend, names.owner, names.name, control_record.RESUMED,
                         ended_run=previous.get("ended_run"), **control_record.carried_on(previous))
    step = obs.published_step
    emit(f"relay {name}: resumed; the next `relay run` or tick goes on from the last published checkpoint"
         f" (step {step})")
    return 0


def lost_progress(backend, names: chain.Names, obs: chain.Observation, running: chain.Action,
                  follow_s: float) -> str:
    """What ending the running session now loses: its steps since the last published checkpoint, as its log shows
    them (read for `follow_s` seconds)."""
    published = obs.published_step
    records = live_progress.LiveSession(backend, names.kernel, running.run_id).start().wait(follow_s)
    latest = progress_line.newest(records)
    if latest is None:
        return (f"Its log shows no progress yet; whatever it trained since the last published checkpoint (step"
                f" {published}) is lost.")
    step = int(latest.get("step", published))
    return (f"It is at step {step} (its log); the last published checkpoint is at step {published}: the"
            f" {max(0, step - published)} steps since are lost, and trained again after `relay resume`.")


def _confirmed(ask: Callable[[str], str], question: str) -> bool:
    try:
        return ask(question).strip().lower() in ("y", "yes")
    except EOFError:  # no terminal and no --yes: no
        return False
