"""`relay run SPEC`: the relay of a spec, run to the end (or one tick with --tick) from the user's own folder.

The `relay` Prefect flow runs in this process on an embedded, ephemeral Prefect (none to set up; with
PREFECT_API_URL set it reports to that server instead). Paths: SPEC is relative to the current folder, paths
inside the spec to the spec's folder. The session table, the PNGs and the cached Kaggle facts go under --out
(default: relay-runs/ beside the spec, or ~/relay-runs when the spec lies inside the kaggle-relay checkout).
The relay keeps no state of its own: stop it anywhere (Ctrl-C) and run it again, here or on another machine.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Optional, Sequence, Union

from relay.shared.code_folder import mark_outputs
from relay.shared.errors import InputError
from relay.shared.version import PACKAGE_DIR


def outputs_dir(spec_path: Path, out: Optional[str]) -> Path:
    if out is not None:
        folder = Path(out)
        if folder.exists() and not folder.is_dir():
            raise InputError(f"--out {out}: exists and is not a folder")
        return folder
    folder = spec_path.resolve().parent / "relay-runs"
    checkout = PACKAGE_DIR.parent
    if (checkout / "pyproject.toml").is_file() and folder.is_relative_to(checkout):
        return Path.home() / "relay-runs"  # never write a user's run into the project's own checkout
    return folder


def _still_running(run_spec, local: Path) -> Optional[str]:
    """The cheap tick: one look at Kaggle (the same observe and decide the flow makes, a few calls); the
    reason when the only step is to wait for a queued or running session, or none at all (stopped by the user),
    else None (the flow acts)."""
    from relay.orchestrator import chain, handoff
    from relay.orchestrator.kaggle import from_env

    backend = from_env()
    names = chain.Names(backend.username, run_spec.name)
    action = chain.decide(run_spec.name, handoff.observe(backend, names, local, run_spec.kaggle.startup_overhead))
    if action.do is chain.Do.STOPPED:
        return action.reason
    if action.do is not chain.Do.WAIT:
        return None
    return f"session {action.session} ({action.run_id}) {action.reason.removeprefix('kernel ')}"


def run(spec: Union[str, Sequence[str]], out: Optional[str] = None, tick: bool = False,
        poll_seconds: Optional[float] = None, submit: bool = False, credentials_block: Optional[str] = None,
        emit=print) -> int:
    """One spec: the `relay` flow. Several (`relay run a.yaml b.yaml`): the `relays` flow, one account's relays
    sharing its session slots."""
    specs = [spec] if isinstance(spec, str) else list(spec)
    if len(specs) > 1:
        return _run_several(specs, out, tick, poll_seconds, submit, credentials_block, emit)
    return _run(specs[0], out, tick, poll_seconds, submit, credentials_block, emit)


def _spec_path(spec: str) -> Path:
    path = Path(spec)
    if not path.is_file():
        raise InputError(f"{spec}: no such spec file (SPEC is relative to the current folder, {Path.cwd()})")
    return path


def _load(spec: str):
    """The spec parsed, once in this process: the flow gets it as it is (a bad spec: one line, exit 2, nothing
    pushed)."""
    from relay.front_door import read_spec

    path = _spec_path(spec)
    return path, read_spec(path)


def _prepare(run_spec, folder: Path) -> None:
    if run_spec.code is not None and Path(run_spec.code.folder).resolve().is_relative_to(folder.resolve()):
        raise InputError(f"code.folder: {run_spec.code.folder} is inside the relay's output folder {folder};"
                         " point it at the folder of your code (or --out elsewhere)")
    folder.mkdir(parents=True, exist_ok=True)
    mark_outputs(folder)  # never shipped as code, whatever it is named (relay.shared.code_folder)
    # `relay emulator serve`'s exports proxy HTTP to the emulator; the embedded Prefect server is on 127.0.0.1
    for name in ("NO_PROXY", "no_proxy"):
        hosts = [h for h in os.environ.get(name, "").split(",") if h]
        os.environ[name] = ",".join(hosts + ["127.0.0.1"] * ("127.0.0.1" not in hosts))


def _run_several(specs: Sequence[str], out: Optional[str], tick: bool, poll_seconds: Optional[float],
                 submit: bool, credentials_block: Optional[str], emit) -> int:
    """The `relays` flow over every spec, here (on the embedded Prefect, or PREFECT_API_URL's server): at most the
    smallest kaggle.account_sessions of them at once, each relay's outputs under --out (default: beside the first
    spec) in a folder of its name."""
    if submit and not os.environ.get("PREFECT_API_URL"):
        raise InputError("--submit: PREFECT_API_URL is not set (the Prefect server to submit to); without"
                         " --submit the relays run here")
    loaded = [_load(spec) for spec in specs]
    names = [read.name for _, read in loaded]
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise InputError(f"name: {', '.join(twice)} named by more than one spec; each relay needs its own name")
    folder = outputs_dir(loaded[0][0], out)
    for _, read in loaded:
        _prepare(read.spec, folder)
    cap = min(read.spec.kaggle.account_sessions for _, read in loaded)
    if submit:  # a worker of the server runs the relays flow (deployment relays/relays)
        from relay.submit import stop_reason, submit as submit_run

        state, message, account = submit_run([path for path, _ in loaded], folder, tick, poll_seconds,
                                             credentials_block, emit)
        for name in names:
            emit(f"-- {name}")
            _outputs(emit, name, folder / name, None, account)
        return 0 if state == "Completed" else _stopped(emit, f"the flow run ended {state}: {stop_reason(message)}")
    if poll_seconds is None:
        poll_seconds = 2.0 if os.environ.get("RELAY_KAGGLE_ENDPOINT") else 30.0
    if not os.environ.get("PREFECT_API_URL"):
        from relay.orchestrator import embedded_prefect

        embedded_prefect.configure(folder)
    signal.signal(signal.SIGTERM, _interrupt)
    from flows.relays_sharing_quota import relays
    from relay.orchestrator.kaggle import KaggleUnresponsive
    from relay.orchestrator.relay_context import RelayFailed

    emit(f"relays {', '.join(names)}: {'one tick' if tick else 'to the end'}, at most {cap} session(s) at once;"
         f" outputs in {folder}")
    failed = None
    try:
        summary = relays(specs=[read for _, read in loaded], mode="tick" if tick else "watch",
                         credentials_block=credentials_block, poll_seconds=poll_seconds,
                         state_dir=str(folder))
    except RelayFailed as err:
        summary, failed = None, str(err)
    except KaggleUnresponsive as err:
        return _unanswered(emit, ", ".join(names), err)
    except KeyboardInterrupt:
        emit("relay: interrupted; nothing is lost: `relay run` again continues from what Kaggle shows")
        return 130
    for name in names:
        emit(f"-- {name}")
        _outputs(emit, name, folder / name, None)
    return _stopped(emit, failed) if failed else 0


def _run(spec: str, out: Optional[str], tick: bool, poll_seconds: Optional[float], submit: bool,
         credentials_block: Optional[str], emit) -> int:
    if submit and not os.environ.get("PREFECT_API_URL") and _spec_path(spec):
        raise InputError("--submit: PREFECT_API_URL is not set (the Prefect server to submit to); without"
                         " --submit the relay runs here")
    path, loaded = _load(spec)
    run_spec = loaded.spec
    folder = outputs_dir(path, out)
    _prepare(run_spec, folder)
    local = folder / run_spec.name

    if submit:  # a worker of the server runs it: its environment says emulator or Kaggle, and how often to poll
        from relay.submit import stop_reason, submit as submit_run

        state, message, account = submit_run([path], folder, tick, poll_seconds, credentials_block, emit)
        if state != "Completed":
            return _stopped(emit, f"the flow run ended {state}: {stop_reason(message)}")
        _outputs(emit, run_spec.name, local, None, account)
        return 0

    if poll_seconds is None:  # the emulator answers at once; Kaggle is polled gently
        poll_seconds = 2.0 if os.environ.get("RELAY_KAGGLE_ENDPOINT") else 30.0
    from relay.orchestrator.kaggle import KaggleUnresponsive

    if tick and not os.environ.get("PREFECT_API_URL"):
        try:
            waiting = _still_running(run_spec, local)
        except KaggleUnresponsive as err:
            return _unanswered(emit, run_spec.name, err)
        if waiting:  # nothing to do but wait: no Prefect, no artifacts that an ephemeral server would drop
            emit(f"relay {run_spec.name}: {waiting}; nothing to do (`relay status {run_spec.name}` shows its progress)")
            return 0

    embedded = not os.environ.get("PREFECT_API_URL")
    if embedded:  # started here, set up first (a fresh machine, every GitHub Actions tick, starts it in ~20-60 s)
        from relay.orchestrator import embedded_prefect

        embedded_prefect.configure(folder)
    # A supervisor or a CI cancel stops us with SIGTERM: leave as Ctrl-C does, so that the embedded Prefect
    # server (a child process, stopped at exit) ends with us instead of running on orphaned.
    signal.signal(signal.SIGTERM, _interrupt)
    from flows.one_relay import RelayFailed, relay

    emit(f"relay {run_spec.name}: {'one tick' if tick else 'to the end'}; outputs in {local}")
    try:
        summary = relay(spec=loaded, mode="tick" if tick else "watch", poll_seconds=poll_seconds,
                        state_dir=str(folder), credentials_block=credentials_block)
    except RelayFailed as err:
        return _stopped(emit, str(err))
    except KaggleUnresponsive as err:  # a tick (a watch waits it out)
        return _unanswered(emit, run_spec.name, err)
    except RuntimeError as err:  # after RelayFailed, a RuntimeError too
        if not (embedded and "ephemeral Prefect API server" in str(err)):
            raise
        timeout = os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"]
        emit(f"relay: the embedded Prefect server did not start within {timeout} s (a busy machine?); nothing was"
             " pushed: run again, or raise PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, or set"
             " PREFECT_API_URL to a Prefect server")
        return 1
    except KeyboardInterrupt:
        emit("relay: interrupted; nothing is lost: `relay run` again continues from what Kaggle shows")
        return 130
    _outputs(emit, run_spec.name, local, summary)
    return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _unanswered(emit, name: str, err: Exception) -> int:
    """One line for a call Kaggle left unanswered past its bound; the relay is as it was, so run it again."""
    emit(f"relay {name}: Kaggle did not answer: {err}; nothing was lost, the next run or tick looks again")
    return 1


def _stopped(emit, reason: str) -> int:
    first, _, rest = reason.partition("\n")
    emit(f"relay: stopped: {first}")
    if rest:
        emit(rest)
    emit("Fix the cause and run `relay run` again: a changed code or spec is pushed as a new attempt of the same"
         " session, from the same checkpoint (docs/relay.md, 'After a failure').")
    return 1


def _outputs(emit, name: str, local: Path, summary: Optional[dict], account: Optional[str] = None) -> None:
    """The outcome and what the run left under `local` (with --submit, when the worker shares this disk)."""
    from relay.orchestrator import report
    from relay.shared import runtime

    progress_file = local / "published" / "progress.json"
    progress = report.load_progress(progress_file) if progress_file.is_file() else None
    if summary is not None:
        emit(f"{summary['state']}: step {summary['step']}/{summary.get('total_steps') or '?'},"
             f" {summary['sessions']} session(s) handed over")
        if summary["state"] == "stopped":
            emit(summary["why"])
    elif progress is not None:
        emit(f"{progress.status}: step {progress.global_step}/{progress.total_steps or '?'},"
             f" {len(progress.sessions)} session(s) handed over")
    if progress is not None:
        emit(report.format_table(report.session_table(progress)))
        for note in runtime.change_notes([s.as_mapping() for s in progress.sessions]):  # another CPU, GPU ...
            emit(f"warning: {note}")
    for png in ("curves.png", "timeline.png", "goodput.png"):
        if (local / png).is_file():
            emit(f"{png.split('.')[0]}: {local / png}")
    if (summary["state"] if summary is not None else (progress.status if progress else None)) == "done":
        emit(f"the final model: Kaggle dataset {_model_dataset(name, account)} (`kaggle datasets download`)")


def _model_dataset(name: str, account: Optional[str] = None) -> str:
    """The final model's dataset, under the Kaggle account the worker's flow run named (--submit: its tags), else
    this machine's credentials'."""
    from relay.orchestrator import chain
    from relay.orchestrator.kaggle import credentials

    if account:
        return chain.Names(account, name).model_dataset
    try:
        return chain.Names(credentials.resolve().username, name).model_dataset
    except InputError:
        return f"<your Kaggle username>/{name}-model"
