"""The orchestrator's half of tracking (docs/tracking.md): one TensorBoard log and one W&B run per relay.

At each handoff, with `c` the step of the checkpoint being published:
- TensorBoard: the session's own event files under `tensorboard/` (the relay's writer, HF's, Lightning's, the
  user's own) are cut at `c` (events past it were logged by a session after its last checkpoint: the next
  session logs those steps again) and staged flat into the checkpoint dataset beside the log so far, which the
  published checkpoint's files become, compacted into one history file (relay/orchestrator/tb_history.py): a
  hand-over moves one session's events and a bounded history, whatever the run's length. The same files are
  copied to `<state_dir>/<name>/tensorboard/` (`tensorboard --logdir` on it). The restart markers (purge_step)
  are left out: after the cut they purge nothing, and TensorBoard applies them in file-name order, which
  sessions started in the same second would not keep.
- W&B offline: the session's offline run(s) under `wandb/` are cut at `c` with W&B's record protobuf
  (relay/orchestrator/wandb_file.py); rows a SIGKILLed session had logged but wandb-core had not yet written are filled in
  from metrics.jsonl (the relay's own records); then `wandb sync --id RUN` uploads them, the API key from a
  Prefect Secret block in the sync's environment only. A tracker problem is a warning: the handoff goes on.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

from relay.orchestrator import tb_history
from relay.orchestrator.tb_history import is_event_file
from relay.shared.progress import Progress

log = logging.getLogger(__name__)
TB_PREFIX = "tensorboard/"
WANDB_PREFIX = "wandb/"


def stage_tensorboard(files: dict[str, Path], stage: Path, max_step: int, local: Optional[Path],
                      staged: Optional[list[str]] = None) -> list[str]:
    """Cut each event file (relative name -> local path) at `max_step` into the flat `stage`, beside `staged` (the
    history already there); mirror them all to `local/tensorboard`. Returns the staged names."""
    staged = list(staged or [])
    for rel, path in sorted(files.items()):
        name = Path(rel).name if Path(rel).name not in staged else rel.replace("/", "_")
        try:
            cut_event_file(path, stage / name, max_step)
        except ImportError:  # the orchestrator lacks the [tensorboard] extra: carry the file as it is
            log.warning("TensorBoard is not installed here (pip install kaggle-relay[tensorboard]): %s is carried"
                        " uncut (TensorBoard's purge_step still hides superseded steps)", rel)
            shutil.copyfile(path, stage / name)
        except Exception as err:  # noqa: BLE001 - a torn file must not stop the handoff
            log.warning("TensorBoard file %s could not be cut (%s); left out", rel, err)
            continue
        staged.append(name)
    if local is not None and staged:
        target = local / "tensorboard"
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        for name in staged:
            shutil.copyfile(stage / name, target / name)
    return staged


def stage_history(previous: list[Path], stage: Path) -> list[str]:
    """The published checkpoint's log (its history and its session's files) as the new history in `stage`
    (relay/orchestrator/tb_history.py): bounded, whatever the run's length. Without TensorBoard installed here the
    files are carried as they are. Returns the staged names."""
    if not previous:
        return []
    try:
        tb_history.compact(previous, stage / tb_history.HISTORY)
        return [tb_history.HISTORY]
    except ImportError:
        log.warning("TensorBoard is not installed here (pip install kaggle-relay[tensorboard]): the log so far is"
                    " carried whole")
    except Exception as err:  # noqa: BLE001 - a torn file must not stop the handoff
        log.warning("TensorBoard: the log so far could not be compacted (%s); carried whole", err)
    for path in previous:
        shutil.copyfile(path, stage / path.name)
    return [path.name for path in previous]


def cut_event_file(src: Path, dst: Path, max_step: int) -> int:
    """Copy the events of `src` with step <= max_step (read and written with TensorBoard's own record
    reader/writer), without restart markers; a torn tail ends the copy. Returns the events kept."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto import event_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter

    kept = 0
    with open(dst, "wb") as f:
        writer = RecordWriter(f)
        for raw in RawEventFileLoader(str(src)).Load():
            event = event_pb2.Event.FromString(raw)
            if event.step > max_step or event.HasField("session_log"):
                continue
            writer.write(raw)
            kept += 1
        writer.flush()
    return kept


def wandb_runs(root: Path) -> list[Path]:
    """The offline run folders under `root` (a session's `wandb/`), oldest first."""
    return sorted(p for p in root.glob("offline-run-*") if p.is_dir() and list(p.glob("run-*.wandb")))


def prepare_wandb(runs: list[Path], run_id: str, after: int, max_step: int, metrics: Optional[Path],
                  project: str) -> list[Path]:
    """Cut each offline run of `run_id` at `max_step` and fill in the rows after `after` (the step this session
    resumed from) that a killed session had not written (wandb-core writes its file in blocks: a SIGKILL loses
    the unwritten tail, or the whole file of a short session); the runs ready for `wandb sync`."""
    from relay.orchestrator import wandb_file

    ready = []
    for run in runs:
        for path in run.glob("run-*.wandb"):
            found = wandb_file.run_id(path)
            if found is None:  # nothing durable, not even the run record
                wandb_file.start_file(path, run_id, project)
            elif found != run_id:
                log.warning("W&B: %s belongs to run %s, not the relay's %s; not synced", path, found, run_id)
                continue
            dropped = wandb_file.cut(path, max_step)
            steps = [after] + [s for s, _ in wandb_file.history(path)]
            if metrics is not None:
                filled = wandb_file.append_rows(path, _missing_rows(metrics, max(steps), max_step))
                if filled:
                    log.info("W&B: %d rows of %s written from metrics.jsonl (its session was killed)", filled, run.name)
            log.info("W&B: %s cut at step %d (%d superseded rows dropped)", run.name, max_step, dropped)
            ready.append(run)
    return ready


def _missing_rows(metrics: Path, last: int, max_step: int) -> list[tuple[int, dict]]:
    """The relay's own records after step `last` up to the checkpoint, as W&B history rows (a later record of
    a step wins: metrics.jsonl may hold a killed session's superseded records before the resumed ones)."""
    rows: dict = {}
    for line in metrics.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        step = int(r.get("step", -1))
        if last < step <= max_step:
            kind = r.get("kind", "train")
            row = rows.setdefault(step, {"_timestamp": r.get("time")})
            row.update({f"{kind}/{k}": v for k, v in r.items() if k not in ("session", "time", "kind", "step")
                        and v is not None})
    return sorted(rows.items())


def sync_command(runs: list[Path], run_id: str, project: str, entity: Optional[str]) -> list[str]:
    cmd = [sys.executable, "-m", "wandb", "sync", "--id", run_id, "-p", project, "--include-synced"]
    return cmd + (["-e", entity] if entity else []) + [str(r) for r in runs]


def run_sync(cmd: list[str], env: dict) -> None:
    """`wandb sync` (a module attribute: tests put a local stand-in here, no W&B server being reachable)."""
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=600)


def sync_wandb(runs: list[Path], run_id: str, cfg, api_key: Callable[[], Optional[str]]) -> bool:
    """Upload the prepared offline runs into the relay's one W&B run. Never raises."""
    if not runs:
        return False
    try:
        key = api_key()
        env = {k: v for k, v in os.environ.items() if not k.startswith("KAGGLE_")}
        env.pop("WANDB_MODE", None)
        if key:
            env["WANDB_API_KEY"] = key  # the sync's environment only: never a file, a log line or a dataset
        run_sync(sync_command(runs, run_id, cfg.project, cfg.entity), env)
        log.info("W&B: synced %d offline run(s) into %s/%s", len(runs), cfg.project, run_id)
        return True
    except Exception as err:  # noqa: BLE001 - a tracker error is a warning
        detail = getattr(err, "stderr", "") or ""
        log.warning("W&B: wandb sync of run %s failed (%s) %s", run_id, type(err).__name__, detail[-300:])
        return False


# -- the handoff's entry points: a streamed output (relay/orchestrator/kaggle/selective_output.py) or a downloaded workdir
def stage_from_output(out, root: Path, stage: Path, max_step: int, local: Optional[Path],
                      previous: Callable[[], list[Path]] = list, wanted: bool = False) -> list[str]:
    """Fetch the output's `tensorboard/` event files (one session's) and stage them cut at `max_step`, beside the
    log so far compacted (`previous()`: the published checkpoint's event files, fetched when the output has event
    files or `wanted`, the spec's tracking.tensorboard). An output file the published checkpoint holds already (a
    kernel of an older relay copied the log so far into its folder) is not fetched again."""
    from relay.orchestrator.kaggle.selective_output import stream_verified

    mine = {rel: url for rel, url in out.urls.items() if rel.startswith(TB_PREFIX) and is_event_file(rel)}
    before = previous() if (mine or wanted) else []
    carried = {p.name for p in before} | {tb_history.HISTORY}
    files = {}
    for rel, url in mine.items():
        if Path(rel).name in carried:
            continue
        target = root / "tb-raw" / rel[len(TB_PREFIX):]
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            stream_verified(out.client, url, target)
        except Exception as err:  # noqa: BLE001 - a tracker file is never a reason to fail a handoff
            log.warning("TensorBoard file %s not fetched (%s)", rel, err)
            continue
        files[rel[len(TB_PREFIX):]] = target
    return stage_tensorboard(files, stage, max_step, local, stage_history(before, stage))


def fetch_wandb(out, root: Path) -> Optional[Path]:
    """The output's offline W&B runs (not `latest-run`, a link to one of them) into `root/wandb`."""
    from relay.orchestrator.kaggle.selective_output import stream_verified

    dest = root / "wandb"
    for rel, url in out.urls.items():
        parts = rel.split("/")
        if len(parts) > 2 and parts[0] == "wandb" and parts[1].startswith("offline-run-") and parts[2] != "tmp":
            target = dest.joinpath(*parts[1:])
            target.parent.mkdir(parents=True, exist_ok=True)
            stream_verified(out.client, url, target)
    return dest if dest.is_dir() else None


def sync_session(spec, progress: Optional[Progress], wandb_root: Optional[Path], after: int, max_step: int,
                 metrics: Optional[Path], api_key: Callable[[], Optional[str]]) -> bool:
    """Cut, fill and `wandb sync` one handed-over session's offline run into the relay's W&B run."""
    cfg = spec.tracking.wandb
    tracking = (progress.tracking if progress else None) or {}
    if cfg is None or wandb_root is None or tracking.get("wandb_mode", "offline") != "offline":
        return False
    run_id = tracking.get("wandb_run_id")
    if not run_id:
        log.warning("W&B: the handed-over progress has no tracking.wandb_run_id; nothing to sync")
        return False
    try:
        runs = prepare_wandb(wandb_runs(wandb_root), run_id, after, max_step, metrics, cfg.project)
    except Exception as err:  # noqa: BLE001 - wandb missing here, a torn file: a warning
        log.warning("W&B: the offline run could not be prepared for sync (%s: %s)", type(err).__name__, err)
        return False
    return sync_wandb(runs, run_id, cfg, api_key)


def key_from_env() -> Optional[str]:
    return os.environ.get("WANDB_API_KEY")
