"""The relay's actions on Kaggle: observe, push a session, hand a finished session's checkpoint over.

No Prefect here (tasks/ wraps these with retries and artifacts); every function takes the backend, so the
same code runs against Kaggle and against the local emulator.
"""
from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

from relay.orchestrator import goodput, history, tb_history, tracking_handoff
from relay.orchestrator.chain import Action, Do, Names, Observation, hit_session_limit
from relay.orchestrator.kaggle import control_record
from relay.orchestrator.kaggle.backend import KaggleBackend
from relay.orchestrator.kaggle.types import NotFound, SessionKernel
from relay.shared.progress import Progress
from relay.shared.spec import RunSpec
from relay.shared.version import code_version

log = logging.getLogger(__name__)

WORKDIR = "relay"  # the session workdir inside the kernel's working folder
# metrics.jsonl: the handed-over session's own lines; history.jsonl: the run so far, compacted (history.py)
PUBLISHED_FILES = ("progress.json", history.METRICS, history.HISTORY)
SESSION_LIMIT = "session_limit"  # stop reason of a session Kaggle stopped at its maximum duration


def observe(backend: KaggleBackend, names: Names, local: Path, grace_s: Optional[float] = None) -> Observation:
    """What Kaggle shows. The kernel's state is read for the version that carries its run id, by version
    label: for about a minute after a push Kaggle's "latest" status and output still show the previous
    version's final state, which would read as "finished" before the new run has even started. A version
    whose status is not available yet (no number, not found) is "starting" (None), never finished.
    Given `grace_s` (kaggle.startup_overhead), a running kernel's deadline too (running_deadline; past it, the
    one its own lines give, for a session queued longer than the grace): the flow, `relay status` and `relay stop
    --now` judge a wedge alike. The user's `relay stop` / `relay resume` is read with it
    (relay/orchestrator/kaggle/control_record.py)."""
    user = control_record.read(backend, names.owner, names.name) or {}
    published = read_published_progress(backend, names.checkpoint_dataset, local / "published")
    current = backend.current_run(names.kernel)
    run, version = current if current is not None else (None, None)
    state, failure = None, ""
    if run is not None and version:
        try:
            status = backend.kernel_status(names.kernel, version)
            state, failure = status.state.value, status.failure_message
        except NotFound:
            log.info("kernel %s v%s: no status yet (starting)", names.kernel, version)
    deadline = None
    if state == "running" and grace_s is not None:
        plan = backend.current_plan(names.kernel) or {}  # read once: both deadlines come from it
        deadline = running_deadline(plan, run, grace_s)
        if deadline is not None and deadline < time.time():  # wedged, or queued longer than the grace?
            deadline = max(deadline, deadline_from_log(backend, names, run, plan, grace_s) or deadline)
    return Observation(published, run, state, failure, features_published=_exists(backend, names.features_dataset),
                       kernel_version=version or None, deadline=deadline, observed_at=time.time(),
                       stopped_by_user=control_record.stop_line(user), ended_by_user=user.get("ended_run"),
                       deleted_run=user.get("deleted_run"), deleted_charges=tuple(user.get("deleted_charges") or ()))


def running_deadline(plan: dict, run_id: Optional[str], grace_s: float) -> Optional[float]:
    """When Kaggle should have ended the running session at the latest: its push (read back from the pushed
    source), plus the timeout the push asked Kaggle for (kaggle_timeout_s: its budget and the margins), plus
    `grace_s` for the queue before Kaggle's own clock starts. Past it, a session still reported running is
    wedged. `plan`: the kernel's current plan (backend.current_plan). None for a kernel pushed without them."""
    if plan.get("run_id") != run_id or plan.get("pushed_at") is None or plan.get("timeout_s") is None:
        return None
    return float(plan["pushed_at"]) + float(plan["timeout_s"]) + grace_s


def deadline_from_lines(records: list, plan: dict, grace_s: float) -> Optional[float]:
    """The deadline again, from the session's own progress lines (the kernel's clock and the budget they say is
    left), for a session queued longer than `grace_s`, whose clock started later than the push allows for: its
    start is a line's time + time left - its budget. None when its lines cannot say (none, no budget in the plan)
    or when it already ended (an `end` line: the process is done, whatever Kaggle reports)."""
    if any(r.get("kind") == "end" for r in records) or plan.get("budget") is None or plan.get("timeout_s") is None:
        return None
    newest = next((r for r in reversed(records) if r.get("time") is not None and r.get("time_left_s") is not None),
                  None)
    if newest is None:
        return None
    started = float(newest["time"]) + float(newest["time_left_s"]) - float(plan["budget"])
    return started + float(plan["timeout_s"]) + grace_s


WEDGE_LOG_S = 5.0  # how long a wedge check reads the session's log for its newest progress line


def deadline_from_log(backend: KaggleBackend, names: Names, run_id: str, plan: dict, grace_s: float,
                      wait_s: float = WEDGE_LOG_S) -> Optional[float]:
    """deadline_from_lines of the session's log, read for at most `wait_s`; None when it cannot say (no timed
    line, an `end` line, a stream that does not answer)."""
    from relay.orchestrator.live_progress import LiveSession

    live = LiveSession(backend, names.kernel, run_id).start()
    try:
        records = live.wait(wait_s, until=lambda seen: any(r.get("kind") == "end" for r in seen))
        return deadline_from_lines(records, plan, grace_s)
    except Exception as err:  # noqa: BLE001 - the deadline from the push stands
        log.info("the log of %s was not read (%s)", run_id, err)
        return None
    finally:
        live.close()


def read_published_progress(backend: KaggleBackend, dataset: str, dest: Path) -> Optional[Progress]:
    try:
        path = backend.download_dataset_file(dataset, "progress.json", dest)
    except NotFound:
        return None
    return Progress.from_json(Path(path).read_bytes(), f"{dataset}: progress.json")


def published_metrics(backend: KaggleBackend, names: Names, local: Path, progress: Progress) -> Optional[Path]:
    """The run's whole metrics history up to the published `progress` (every session so far), kept in `local`
    (relay/orchestrator/history.py): a session's lines are downloaded only when this folder did not see it."""
    return history.local_metrics(backend, names.checkpoint_dataset, local, progress)


def _exists(backend: KaggleBackend, dataset: str) -> bool:
    try:
        return bool(backend.list_dataset_files(dataset))
    except NotFound:
        return False


def kaggle_timeout_s(spec: RunSpec, budget_s: Optional[float]) -> int:
    """The limit Kaggle itself enforces on a session: its training budget, plus the start-up before the
    session's clock starts (kaggle.startup_overhead) and once more session.safety_margin for a final save slower
    than the session planned, never more than kaggle.session_timeout. The session ends itself at its budget;
    this is the last guard, so a hung or wedged session costs at most the margins, not a 12 h session."""
    k = spec.kaggle
    if budget_s is None or budget_s != budget_s or budget_s == float("inf"):
        return int(k.session_timeout)
    return int(min(k.session_timeout, budget_s + k.startup_overhead + spec.session.safety_margin) + 0.999)


def session_kernel(spec: RunSpec, spec_text: str, names: Names, action: Action, budget_s: Optional[float],
                   features_published: bool, has_checkpoint: bool, charges: tuple = ()) -> SessionKernel:
    k = spec.kaggle
    data = k.data_mount or (k.dataset_sources[0] if k.dataset_sources else None)
    return SessionKernel(
        kernel=names.kernel,
        title=f"{spec.name} session",  # Kaggle derives the slug from the title: keep them equal
        spec_text=spec_text,
        run_id=action.run_id,
        budget_s=budget_s,
        checkpoint_dataset=names.checkpoint_dataset if has_checkpoint else None,
        data_dataset=data,
        features_datasets=(names.features_dataset,) if features_published else (),
        extra_datasets=tuple(s for s in k.dataset_sources if s != data),
        competitions=tuple(k.competition_sources),
        enable_gpu=k.enable_gpu,
        enable_internet=k.enable_internet,
        machine_shape=k.machine_shape,
        pin_image=k.pin_image,
        session_timeout_s=kaggle_timeout_s(spec, budget_s),
        workdir_name=WORKDIR,
        code_folder=spec.code.folder if spec.code else None,
        code_exclude=tuple(spec.code.exclude) if spec.code else (),
        pip=tuple(k.pip),
        charges=tuple(charges),  # failed attempts since the last hand-over (goodput.failed_charges)
    )


def code_changed(backend: KaggleBackend, names: Names, spec: RunSpec, spec_text: str,
                 pushed: Optional[dict] = None) -> bool:
    """Whether what a push would ship now (the relay's code, the user's code folder, the spec) differs from the
    kernel's current version: after a code error, a fixed script or spec is worth a new attempt, the same
    one is not. Read back from the pushed source (`pushed`: its plan, when read already), so it holds on any
    machine."""
    import hashlib

    from relay.orchestrator.kaggle.bundle import build_bundle

    if pushed is None:
        pushed = backend.current_plan(names.kernel) or {}
    bundle = build_bundle(user_code=spec.code.folder if spec.code else None,
                          exclude=tuple(spec.code.exclude) if spec.code else ())
    if pushed.get("bundle_sha256") != hashlib.sha256(bundle.data).hexdigest():
        return True
    spec_sha = pushed.get("spec_sha256")  # kernels pushed before it was recorded: the bundle alone decides
    return spec_sha is not None and spec_sha != hashlib.sha256(spec_text.encode()).hexdigest()


@dataclass
class HandOver:
    """What a finished (or failed) session left, and what was published from it."""

    ok: bool
    reason: str = ""
    progress: Optional[Progress] = None
    step: int = 0
    version: Optional[int] = None
    log_tail: str = ""
    published: list = field(default_factory=list)
    stale: bool = False  # the output may be another version's (Kaggle's status lag): see pushed_within

    def __post_init__(self) -> None:  # a parsed document (tests, old callers) reads as the model
        self.progress = Progress.read(self.progress)


def pushed_within(plan: dict, run_id: str, seconds: float) -> bool:
    """Whether the kernel's current version (the one carrying `run_id`) was pushed less than `seconds` ago:
    then output of another run is Kaggle's status lag (even a pinned request may answer the previous version
    for a while), not a failed session. `plan`: the kernel's current plan (backend.current_plan), where the
    push time is read back from the pushed source."""
    at = plan.get("pushed_at")
    return plan.get("run_id") == run_id and at is not None and time.time() - float(at) < seconds


def _no_check() -> None:
    return None


def _lag_suspect(found_run_id: Optional[str], obs: Observation) -> bool:
    """Output that may belong to another version: another run's id, or none at all while the status says
    complete (a finished relay session always leaves its run id; a failed one may leave nothing)."""
    return found_run_id is not None or obs.kernel_state == "complete"


def hand_over(backend: KaggleBackend, spec: RunSpec, names: Names, action: Action, obs: Observation,
              local: Path, confirm: Callable[[], None] = _no_check,
              wandb_key=tracking_handoff.key_from_env) -> HandOver:
    """Download the kernel's output (of the observed version), verify it is this run's, and publish its
    newest valid checkpoint as the next version of the checkpoint dataset (plus the features once, and the
    model when done), with the relay's TensorBoard log cut at its step; then sync the W&B offline run
    (`wandb_key`: where the API key comes from). `confirm` runs before each publication (the orchestrator's
    claim on this step is still its own: relay/orchestrator/kaggle/lease.py) and raises to stop.
    Only what is published is downloaded (relay/orchestrator/kaggle/selective_output.py): the newest valid
    checkpoint straight into the flat staging folder, verified as it arrives; the cache and the export only when
    they are published. The checkpoint version is published last (it is what the next tick reads as "handed
    over"), and every folder is deleted as soon as its version is confirmed."""
    root = local / "handoff" / action.run_id
    out = backend.open_handoff_output(names.kernel, root, WORKDIR, version=obs.kernel_version)
    tail = _log_tail_text(out.log_text)
    try:
        if out.found_run_id != action.run_id:
            whose = f"it belongs to run {out.found_run_id}" if out.found_run_id else "it holds no run's files"
            return HandOver(False, f"stale output: {whose}, not {action.run_id}'s",
                            log_tail=tail, stale=_lag_suspect(out.found_run_id, obs))
        before = int(obs.published_step)
        if not out.candidates or out.progress is None:
            return HandOver(False, "the session left no valid checkpoint", log_tail=tail)
        newest = out.candidates[0]
        if newest.step <= before and out.progress.status != "done":
            return HandOver(False, f"no progress: newest checkpoint is step {newest.step}, published {before}",
                            log_tail=tail)
        want_cache = not obs.features_published
        want_export = out.progress.status == "done" and out.progress.global_step == newest.step
        extra = max(out.size_of("cache") if want_cache else 0, out.size_of("export") if want_export else 0)
        out.ensure_space(newest.nbytes + extra,
                         f"run {action.run_id}'s checkpoint (step {newest.step})"
                         + (" and its cache/export" if extra else ""))
        stage = root / "stage"
        newest = _fetch_newest_valid(out, stage)
        if newest is None:
            return HandOver(False, "the session left no valid checkpoint (every one failed verification)",
                            log_tail=tail)
        progress = _staged_progress(out.progress, newest.step,
                                    hit_session_limit(obs.kernel_state, obs.failure_message))
        # what this attempt was charged, as the relay saw it (relay/orchestrator/goodput.py). Only what every
        # orchestrator reads alike from Kaggle, never this one's clock: two handing the same session over must
        # stage the same progress.json, or its publication's marker differs and the checkpoint is published
        # twice. A wedged attempt is charged to its deadline (the relay deletes it right after), a clean one to
        # its process's end (its `end` line).
        wedged = action.do is Do.WEDGED
        plan = backend.current_plan(names.kernel)
        charge = goodput.charge_record(action.run_id, out.log_text, plan, obs.deadline if wedged else None,
                                       wedged=wedged)
        # and the failed attempts before it that handed nothing over, carried in its pushed plan
        progress = goodput.with_charge(obs.published, progress, charge, goodput.carried(plan, action.run_id))
        (stage / "progress.json").write_text(json.dumps(progress.to_dict(), indent=1, sort_keys=True))
        # this session's own lines, and the run so far compacted from the published history (bounded: what is
        # moved per hand-over does not grow with the run); the whole history stays in `local`
        out.fetch_file(history.METRICS, stage / history.METRICS)
        index, run_of = history.session_key(progress, action.run_id)
        previous = history.previous_records(backend, names.checkpoint_dataset, root / "previous") \
            if obs.published else []
        own = history.stage(stage, index, previous)
        def published_log() -> list[Path]:  # the log so far: fetched only where the session has one to continue
            return tb_history.previous_files(backend, names.checkpoint_dataset, root / "previous-tb",
                                             local / "tensorboard") if obs.published else []

        tracking_handoff.stage_from_output(out, root, stage, newest.step, local, previous=published_log,
                                           wanted=spec.tracking.tensorboard)

        published = []
        if want_cache:
            published += _publish_tree(backend, out, root, "cache", names.features_dataset, f"{spec.name} features",
                                       f"built by run {action.run_id}", confirm)
        if progress.status == "done":
            published += _publish_tree(backend, out, root, "export", names.model_dataset, f"{spec.name} model",
                                       f"final weights of run {action.run_id}", confirm)
        known = {n: h for n, h in out.sha256.items() if (stage / n).is_file() and n != "progress.json"}
        confirm()
        result = backend.publish_folder(stage, names.checkpoint_dataset, f"{spec.name} checkpoint",
                                        notes=f"run {action.run_id}, step {newest.step}, code {code_version()}",
                                        known_sha256=known, keep_versions=spec.kaggle.checkpoint_versions)
        published.insert(0, f"{names.checkpoint_dataset} v{result.version}")
        try:  # a cache: a reader fetches what it lacks (history.local_metrics), so a failure here fails nothing
            history.LocalHistory(local).add(index, run_of, own, earlier=lambda: previous,
                                            run_ids=history.run_ids(progress))
        except OSError as err:
            log.warning("metrics history: session %d not kept locally (%s); it is fetched when read", index, err)
        if spec.tracking.wandb is not None:  # after the publish: a tracker never holds the relay up
            tracking_handoff.sync_session(spec, progress, _fetch_wandb(out, root), before, newest.step,
                                          stage / history.METRICS, wandb_key)
        return HandOver(True, "handed over", progress, newest.step, result.version, tail, published)
    finally:
        shutil.rmtree(root, ignore_errors=True)  # confirmed or not: everything here can be fetched again


def _fetch_wandb(out, root: Path) -> Optional[Path]:
    try:
        return tracking_handoff.fetch_wandb(out, root)
    except Exception as err:  # noqa: BLE001 - a tracker error is a warning
        log.warning("W&B: the offline run could not be fetched (%s)", err)
        return None


def _publish_tree(backend: KaggleBackend, out, root: Path, name: str, dataset: str, title: str,
                  notes: str, confirm: Callable[[], None] = _no_check) -> list[str]:
    """Fetch one output folder (the cache, the export), publish it, and delete it at once."""
    folder = out.fetch_tree(name, root / name)
    if folder is None:
        return []
    confirm()
    result = backend.publish_folder(folder, dataset, title, notes=notes)
    shutil.rmtree(folder)
    return [f"{dataset} v{result.version}"]


def _fetch_newest_valid(out, stage: Path):
    """The newest candidate whose files arrive intact; an older one when the newest fails its manifest."""
    from relay.orchestrator.kaggle.selective_output import ChecksumMismatch

    for cand in out.candidates:
        if stage.exists():
            shutil.rmtree(stage)
        stage.mkdir(parents=True)
        try:
            out.fetch_checkpoint(cand, stage)
            return cand
        except ChecksumMismatch as err:
            log.warning("checkpoint %s of the output fails verification (%s); trying an older one", cand.name, err)
    return None


def _staged_progress(progress: Progress, step: int, session_limit: bool = False) -> Progress:
    progress = replace(progress, checkpoint=".")
    if progress.global_step != step or not progress.has("global_step"):
        # the kernel died after its last save: the checkpoint is the truth, progress.json may be ahead
        progress = replace(progress, global_step=step, status="paused", stop_reason="killed")
    if session_limit and progress.status != "done":
        # kept in the published progress, so the next plan still warns that the budget is too long
        progress = replace(progress, stop_reason=SESSION_LIMIT)
        if progress.sessions:
            last = replace(progress.sessions[-1], stop_reason=SESSION_LIMIT)
            progress = replace(progress, sessions=progress.sessions[:-1] + (last,))
    return progress


def log_tail(path: Optional[Path], lines: int = 40) -> str:
    """The last lines of a kernel log file, as text (Kaggle stores it as JSON)."""
    if not path or not Path(path).is_file():
        return ""
    return _log_tail_text(Path(path).read_text(errors="replace"), lines)


def _log_tail_text(text: str, lines: int = 40) -> str:
    try:  # Kaggle's log is a JSON array of {stream_name, time, data}
        text = "".join(entry.get("data", "") for entry in json.loads(text))
    except (ValueError, AttributeError, TypeError):
        pass
    return "\n".join(text.splitlines()[-lines:])
