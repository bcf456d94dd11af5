"""`relay status NAME|SPEC`: where a relay stands, read from Kaggle alone (no local state, so it works from any
machine): the sessions handed over with their table (what each ran on; a session on another CPU, GPU, torch or
image than the one before is named: bit-identity with an uninterrupted run is not promised across them), the
kernel's current session, what the relay will do
next (relay.orchestrator.chain.decide, the very decision a tick would take), the plan and ETA, and the loss-curve and
timeline PNGs."""
from __future__ import annotations

import re
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

from relay.shared import progress_line, runtime
from relay.shared.errors import InputError

_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{2,49}$")


def resolve_name(target: str, command: str = "relay status"):
    """(name, spec or None) from a spec file or a relay name."""
    from relay.shared import spec as spec_mod

    path = Path(target)
    if path.suffix in (".yaml", ".yml") or path.is_file():
        run_spec = spec_mod.load(path)
        return run_spec.name, run_spec
    if not _NAME.match(target):
        raise InputError(f"{command}: {target!r} is neither a folder, a spec file nor a relay name"
                         " ([a-z0-9-], 3-50 characters)")
    # no spec file: find_relay reads the one the relay's sessions run with from its kernel (pushed_spec); until
    # then, and for a kernel that carries none, Kaggle's defaults (12 h sessions, 30 h a week)
    return target, SimpleNamespace(kaggle=spec_mod.KaggleConfig(), session=spec_mod.SessionConfig(),
                                   source="Kaggle's defaults (no spec file given, none read from its kernel)")


def pushed_spec(backend, kernel: str):
    """The spec the relay's sessions run with, read from its kernel's current source (every push embeds it:
    relay/orchestrator/kaggle/kernel_source.py): its kaggle, session and optim sections, all a plan needs (its
    code.folder names a folder on the machine that pushed, not this one). None when the kernel carries none."""
    import yaml

    from relay.shared import spec as spec_mod

    try:
        text = backend.current_spec_text(kernel)
        data = yaml.safe_load(text) if text else None
        if not isinstance(data, dict):
            return None
        return SimpleNamespace(name=data.get("name"), kaggle=spec_mod.KaggleConfig.model_validate(data.get("kaggle") or {}),
                               session=spec_mod.SessionConfig.model_validate(data.get("session") or {}),
                               optim=spec_mod.OptimConfig.model_validate(data.get("optim") or {}),
                               source=f"the one its sessions run with (kernel {kernel}'s current version)")
    except Exception:  # noqa: BLE001 - no kernel, another one's source, an old spec: Kaggle's defaults, said so
        return None


FOLLOW_S = 5.0  # how long a command reads the running session's log stream for its newest progress


def find_relay(target: str, backend_factory: Callable, command: str = "relay status"):
    """(name, spec, backend, names, observation) of the relay that NAME|SPEC `target` names, read from Kaggle;
    InputError when Kaggle holds no such relay or does not answer."""
    from relay.orchestrator import chain, handoff
    from relay.orchestrator.kaggle import KaggleError

    name, run_spec = resolve_name(target, command)
    backend = backend_factory()
    names = chain.Names(backend.username, name)
    if isinstance(run_spec, SimpleNamespace):  # a name: plan with the spec its sessions run with
        run_spec = pushed_spec(backend, names.kernel) or run_spec
    try:
        with tempfile.TemporaryDirectory(prefix="relay-status-") as scratch:  # nothing written for a wrong name
            obs = handoff.observe(backend, names, Path(scratch), run_spec.kaggle.startup_overhead)
    except KaggleError as err:
        raise InputError(f"{command} {name}: {err}") from None
    if obs.published is None and obs.kernel_run is None:
        raise InputError(f"{command}: no relay named {name} for Kaggle user {names.owner}"
                         f" (no dataset {names.checkpoint_dataset}, no kernel {names.kernel})")
    return name, run_spec, backend, names, obs


def report(target: str, backend_factory: Callable, out_dir: Path | None = None, emit=print,
           follow_s: float = FOLLOW_S) -> int:
    from relay.orchestrator import attempts, chain, goodput, goodput_chart, handoff, live_progress, policy, report as rep
    from relay.orchestrator.kaggle import KaggleError, NotFound

    name, run_spec, backend, names, obs = find_relay(target, backend_factory)
    out = Path(out_dir or Path("relay-runs") / name)
    try:
        quota = backend.quota()
    except KaggleError as err:
        raise InputError(f"relay status {name}: {err}") from None
    progress = obs.published or {}
    action = chain.decide(name, obs)
    if action.do is chain.Do.WEDGED:  # what the relay does about it, in the `next:` line
        action = chain.on_wedged(action, run_spec.kaggle.on_wedged)
    records, eta = [], None
    if action.do is chain.Do.WAIT and obs.kernel_state == "running":  # the running session, from its log stream
        records = live_progress.LiveSession(backend, names.kernel, action.run_id).start().wait(follow_s)
        eta = live_progress.estimate(records, run_spec.session.max_steps)
    newest = progress_line.newest(records) or {}
    emit(f"relay {name} (Kaggle user {names.owner}): {obs.handed_over} session(s) handed over, step"
         f" {progress.get('global_step', 0)}/{progress.get('total_steps') or newest.get('total_steps') or '?'}"
         + (f"; session {newest.get('session')} running at step {newest.get('step')}" if newest else ""))
    rows = rep.session_table(progress)
    if records:
        row = live_progress.running_row(records)
        rows = rows + [row] if row is not None else rows
    if rows:
        emit(rep.format_table(rows))  # with what each session ran on, and what changed from the one before
    ledger = goodput.from_progress(progress, run_spec.session.save_every)  # where the GPU time charged went
    if progress.get("sessions"):
        emit(ledger.line())
    for note in runtime.change_notes(progress.get("sessions") or []):  # another CPU, GPU, torch, image ...
        emit(f"warning: {note}")
    if obs.kernel_run:
        state = obs.kernel_state or "starting"
        emit(f"kernel: {names.kernel} v{obs.kernel_version or '?'} runs {obs.kernel_run}: {state}"
             + (f" ({obs.failure_message})" if obs.failure_message else ""))
    if records:
        emit(live_progress.eta_text(records, run_spec.session.max_steps, obs.deadline, obs.kernel_state))
    if obs.stopped_by_user and action.do is not chain.Do.STOPPED:
        emit(f"stopped by the user (relay stop) {obs.stopped_by_user}: the running session is handed over, then"
             f" nothing more is pushed until `relay resume {name}`")
    emit(f"next: {action.do.value} {action.run_id or ''} ({action.reason})".replace("  ", " "))
    from relay.orchestrator import storage

    emit(storage.storage_line(storage.relay_storage(backend, names), run_spec.kaggle.checkpoint_versions))
    if newest.get("total_steps") and not progress.get("total_steps"):  # the first session: its lines say it
        progress = {**progress, "total_steps": newest["total_steps"]}
    emit(f"spec: {getattr(run_spec, 'source', None) or target}")  # where the plan's spec figures come from
    emit(policy.plan_text(run_spec, progress, quota, datetime.now(timezone.utc), running=eta))
    if progress.get("sessions"):
        try:
            # the history the relay's flow keeps beside it (relay-runs/<name>/history), added to if it lacks a session
            metrics = handoff.published_metrics(backend, names, out, progress)
        except NotFound:
            metrics = None
        emit(f"timeline: {rep.plot_timeline(attempts.every_attempt(progress), out / 'timeline.png')}")
        if ledger.charged_s > 0:
            emit(f"goodput chart: {goodput_chart.plot_goodput(ledger, out / 'goodput.png')}")
        if metrics is not None and rep.read_metrics(metrics):
            emit(f"curves: {rep.plot_curves(metrics, out / 'curves.png', progress=progress)}")
    return 0
