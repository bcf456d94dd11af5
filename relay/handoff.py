"""The relay's actions on Kaggle: observe, push a session, hand a finished session's checkpoint over.

No Prefect here (tasks/ wraps these with retries and artifacts); every function takes the backend, so the
same code runs against Kaggle and against the local emulator.
"""
from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from relay.chain import Action, Names, Observation
from relay.kaggle.backend import KaggleBackend
from relay.kaggle.types import NotFound, SessionKernel
from relay.session import checkpoint
from relay.spec import RunSpec
from relay.version import code_version

log = logging.getLogger(__name__)

WORKDIR = "relay"  # the session workdir inside the kernel's working folder
PUBLISHED_FILES = ("progress.json", "metrics.jsonl")


def observe(backend: KaggleBackend, names: Names, local: Path) -> Observation:
    published = read_published_progress(backend, names.checkpoint_dataset, local / "published")
    current = backend.current_run(names.kernel)
    state, failure = None, ""
    if current is not None:
        status = backend.kernel_status(names.kernel)
        state, failure = status.state.value, status.failure_message
    return Observation(published, current[0] if current else None, state, failure,
                       features_published=_exists(backend, names.features_dataset))


def read_published_progress(backend: KaggleBackend, dataset: str, dest: Path) -> Optional[dict]:
    try:
        path = backend.download_dataset_file(dataset, "progress.json", dest)
    except NotFound:
        return None
    return json.loads(Path(path).read_text())


def published_metrics(backend: KaggleBackend, names: Names, local: Path, progress: dict) -> Optional[Path]:
    """metrics.jsonl of the published checkpoint (all sessions so far), fetched once per handed-over run."""
    path = local / "published" / f"metrics-{progress.get('run_id')}.jsonl"
    if not path.is_file():
        try:
            tmp = backend.download_dataset_file(names.checkpoint_dataset, "metrics.jsonl", local / "published" / "tmp")
        except NotFound:
            return None
        tmp.replace(path)
    return path


def _exists(backend: KaggleBackend, dataset: str) -> bool:
    try:
        return bool(backend.list_dataset_files(dataset))
    except NotFound:
        return False


def session_kernel(spec: RunSpec, spec_text: str, names: Names, action: Action, budget_s: Optional[float],
                   features_published: bool, has_checkpoint: bool) -> SessionKernel:
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
        session_timeout_s=int(k.session_timeout),
        workdir_name=WORKDIR,
        code_folder=spec.code.folder if spec.code else None,
        code_exclude=tuple(spec.code.exclude) if spec.code else (),
        pip=tuple(k.pip),
    )


@dataclass
class HandOver:
    """What a finished (or failed) session left, and what was published from it."""

    ok: bool
    reason: str = ""
    progress: Optional[dict] = None
    step: int = 0
    version: Optional[int] = None
    log_tail: str = ""
    published: list = field(default_factory=list)


def hand_over(backend: KaggleBackend, spec: RunSpec, names: Names, action: Action, obs: Observation,
              local: Path) -> HandOver:
    """Download the kernel's output, verify it is this run's, and publish its newest valid checkpoint as
    the next version of the checkpoint dataset (plus the features once, and the model when done)."""
    out = backend.download_output(names.kernel, local / "outputs" / action.run_id, action.run_id, WORKDIR)
    tail = _log_tail(out.log_path)
    if out.stale:
        return HandOver(False, f"stale output: it belongs to run {out.found_run_id}, not {action.run_id}",
                        log_tail=tail)
    workdir = out.directory / WORKDIR
    valid = checkpoint.list_valid(workdir / "checkpoints", verify_hashes=True)
    before = int((obs.published or {}).get("global_step", 0))
    if not valid or out.progress is None:
        return HandOver(False, "the session left no valid checkpoint", log_tail=tail)
    newest = valid[0]
    if newest.step <= before and out.progress.get("status") != "done":
        return HandOver(False, f"no progress: newest checkpoint is step {newest.step}, published {before}",
                        log_tail=tail)
    stage = _stage(local / "stage" / action.run_id, newest, workdir, out.progress)
    result = backend.publish_folder(stage, names.checkpoint_dataset, f"{spec.name} checkpoint",
                                    notes=f"run {action.run_id}, step {newest.step}, code {code_version()}")
    published = [f"{names.checkpoint_dataset} v{result.version}"]
    if not obs.features_published and (workdir / "cache").is_dir() and any((workdir / "cache").iterdir()):
        res = backend.publish_folder(workdir / "cache", names.features_dataset, f"{spec.name} features",
                                     notes=f"built by run {action.run_id}")
        published.append(f"{names.features_dataset} v{res.version}")
    progress = json.loads((stage / "progress.json").read_text())
    if progress.get("status") == "done" and (workdir / "export").is_dir():
        res = backend.publish_folder(workdir / "export", names.model_dataset, f"{spec.name} model",
                                     notes=f"final weights of run {action.run_id}")
        published.append(f"{names.model_dataset} v{res.version}")
    return HandOver(True, "handed over", progress, newest.step, result.version, tail, published)


def _stage(stage: Path, newest: checkpoint.Checkpoint, workdir: Path, progress: dict) -> Path:
    """One flat folder (datasets skip subfolders): the checkpoint's files, progress and metrics."""
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir(parents=True)
    for f in newest.path.iterdir():
        shutil.copy2(f, stage / f.name)
    progress = dict(progress, checkpoint=".")
    if progress.get("global_step") != newest.step:
        # the kernel died after its last save: the checkpoint is the truth, progress.json may be ahead
        progress.update(global_step=newest.step, status="paused", stop_reason="killed")
    (stage / "progress.json").write_text(json.dumps(progress, indent=1, sort_keys=True))
    if (workdir / "metrics.jsonl").is_file():
        shutil.copy2(workdir / "metrics.jsonl", stage / "metrics.jsonl")
    return stage


def _log_tail(path: Optional[Path], lines: int = 40) -> str:
    if not path or not Path(path).is_file():
        return ""
    text = Path(path).read_text(errors="replace")
    try:  # Kaggle's log is a JSON array of {stream_name, time, data}
        text = "".join(entry.get("data", "") for entry in json.loads(text))
    except (ValueError, AttributeError, TypeError):
        pass
    return "\n".join(text.splitlines()[-lines:])
