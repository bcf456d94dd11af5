"""TensorBoard and Weights & Biases inside a session: one run across the relay, each step logged once.

The session's metrics records (what metrics.jsonl holds: train/eval/memory/stage) go to the trackers the spec
turns on (`tracking:`), at the relay's optimizer step:
- TensorBoard: this session's event files in `workdir/tensorboard/` (the log so far stays in the checkpoint
  dataset: the orchestrator stages it beside them at each hand-over, compacted: relay/orchestrator/tb_history.py).
  The writer opens with `purge_step` = the resumed step + 1, so TensorBoard drops what a killed session logged
  after its last checkpoint; the orchestrator also cuts every file at the published checkpoint's step
  (relay/orchestrator/tracking_handoff.py), so the assembled folder holds each step once for any reader. HF's
  `report_to="tensorboard"` writes here too (TENSORBOARD_LOGGING_DIR).
- W&B: one run whose id is created by the first session and kept in the relay's bookkeeping (every checkpoint,
  progress.json `tracking.wandb_run_id`); each session resumes it by id. Offline (no internet) the run is
  written under `workdir/wandb/` and the orchestrator cuts it at the checkpoint's step and `wandb sync`s it.
  Every `run.log` without `step=` (HF's WandbCallback, Lightning's WandbLogger) is pinned to the relay's step,
  so history steps are the optimizer steps in every session and superseded ones can be dropped by step.
Writers are flushed before every checkpoint commits: what a checkpoint covers is on disk when it is valid.
A tracker that fails is a warning and is switched off; it never fails the session. torch and wandb are
imported only when a tracker is on.
"""
from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path
from typing import Any, Callable, Optional
from relay.shared.environment import SessionEnvironment

log = logging.getLogger(__name__)

TB_DIR = "tensorboard"
WANDB_DIR = "wandb"
_BOOKKEEPING = {"session", "time", "kind", "step"}


class Trackers:
    """The session's trackers. `config`: the spec's `tracking` section as a dict (None or {} = all off)."""

    def __init__(self, config: Optional[dict], workdir: Path, *, main: bool = True, internet: bool = False):
        config = config or {}
        self.workdir = Path(workdir)
        self.tensorboard_dir = self.workdir / TB_DIR
        self.tb_on = bool(config.get("tensorboard")) and main
        self.wandb_config = config.get("wandb") if main else None
        self.internet = internet
        self.writer = None
        self.run = None
        self.main = main
        self.writers: list = []  # the script's own SummaryWriters (Session.track_writer): flushed before a save
        self.muted: set = set()  # trackers a trainer reports to itself (HF report_to): the relay skips them
        self._step: Callable[[], int] = lambda: 0

    @property
    def enabled(self) -> bool:
        return self.writer is not None or self.run is not None

    def start(self, step: int, state: dict, *, name: Optional[str] = None,
              current_step: Optional[Callable[[], int]] = None) -> None:
        """Open the trackers for a session resuming at `step`. `state`: the relay's tracking state, saved in
        every checkpoint and progress.json (the W&B run id is created there once); `current_step` gives the
        step of log calls without one."""
        self._step = current_step or (lambda: step)
        if self.main:  # HF's report_to="tensorboard" writes here, on or off (TensorBoardCallback reads it)
            _point_hf_here(self.tensorboard_dir)
        if self.tb_on:
            self._guard("TensorBoard", self._start_tensorboard, step)
        if self.wandb_config:
            self._guard("W&B", self._start_wandb, step, state, name)

    def _start_tensorboard(self, step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.tensorboard_dir.mkdir(parents=True, exist_ok=True)  # its own files only: the log so far is published
        # purge_step: TensorBoard drops the steps >= it logged before this restart (a killed session's tail)
        self.writer = SummaryWriter(str(self.tensorboard_dir), purge_step=step + 1, flush_secs=30)
        from tensorboard.compat.proto.summary_pb2 import Summary

        self._summary = Summary

    def _start_wandb(self, step: int, tracking: dict, name: Optional[str]) -> None:
        import wandb

        cfg = self.wandb_config
        run_id = tracking.setdefault("wandb_run_id", _new_run_id())
        mode = cfg.get("mode", "auto")
        if mode == "auto":
            mode = "online" if self.internet else "offline"
        if mode == "online" and not _online_key(cfg.get("kaggle_secret", "WANDB_API_KEY")):
            log.warning("W&B: no API key in this session (Kaggle secret %s); logging offline instead",
                        cfg.get("kaggle_secret"))
            mode = "offline"
        tracking["wandb_mode"] = mode
        settings = wandb.Settings(console="off", x_disable_stats=True, silent=True)
        kwargs = dict(project=cfg["project"], entity=cfg.get("entity"), id=run_id, name=name,
                      dir=str(self.workdir), mode=mode, settings=settings)
        if mode == "online" and step:  # rewind the run to the checkpoint: a killed session's tail is dropped
            try:
                self.run = wandb.init(resume_from=f"{run_id}?_step={step}", **{k: v for k, v in kwargs.items()
                                                                                if k != "id"})
            except Exception as err:  # noqa: BLE001 - rewind is a server feature; resume the plain way
                log.warning("W&B: rewinding run %s to step %d failed (%s); resuming it", run_id, step, err)
        if self.run is None:
            self.run = wandb.init(resume="allow", **kwargs)
        self._pin_steps(wandb)

    def _pin_steps(self, wandb) -> None:
        """Every log call without `step=` (HF's and Lightning's loggers) lands at the relay's optimizer step."""
        original, current = self.run.log, self._step

        def log_at_relay_step(data: dict, step: Optional[int] = None, commit: Optional[bool] = None, **kw: Any):
            return original(data, step=current() if step is None else step, commit=commit, **kw)

        self.run.log = log_at_relay_step
        wandb.log = log_at_relay_step

    def log(self, record: dict) -> None:
        """One metrics record ({"kind", "step", values...}) as `<kind>/<key>` scalars at its step."""
        if not self.enabled:
            return
        kind, step = record.get("kind", "train"), int(record.get("step", 0))
        values = {f"{kind}/{k}": v for k, v in record.items() if k not in _BOOKKEEPING and v is not None}
        numbers = {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.writer is not None and "tensorboard" not in self.muted:
            self._guard("TensorBoard", self._write_tb, step, numbers, values)
        if self.run is not None and "wandb" not in self.muted:
            self._guard("W&B", self.run.log, values, step=step)

    def _write_tb(self, step: int, numbers: dict, values: dict) -> None:
        # one event per record with every scalar in it (what add_scalar writes, one value each: ~4x cheaper)
        summary = self._summary(value=[self._summary.Value(tag=t, simple_value=v) for t, v in numbers.items()])
        self.writer._get_file_writer().add_summary(summary, step)
        for tag, value in values.items():
            if isinstance(value, str):  # a stage name: text, shown in TensorBoard's text tab
                self.writer.add_text(tag, value, step)

    def flush(self) -> None:
        """Before a checkpoint commits: every step it covers is on disk (a SIGKILL after it loses none)."""
        for writer in ([self.writer] if self.writer is not None else []) + self.writers:
            self._guard("TensorBoard", writer.flush)

    def close(self) -> None:
        if self.writer is not None:
            self._guard("TensorBoard", self.writer.close)
            self.writer = None
        if self.run is not None:
            run, self.run = self.run, None
            try:
                run.finish()
            except Exception as err:  # noqa: BLE001
                log.warning("W&B: finishing the run failed (%s); the session goes on", err)

    def _guard(self, what: str, fn: Callable, *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - a tracker is never a reason for a session to fail
            log.warning("%s tracking failed (%s: %s); it is off for the rest of this session",
                        what, type(err).__name__, err)
            if what == "TensorBoard":
                self.writer = None
            else:
                self.run = None


_HF_DIR = "TENSORBOARD_LOGGING_DIR"
_set_here: list = []  # the values this module set (a user's own setting is left alone)


def _point_hf_here(folder: Path) -> None:
    if os.environ.get(_HF_DIR) in (None, *_set_here):
        os.environ[_HF_DIR] = str(folder)
        _set_here.append(str(folder))


def _new_run_id() -> str:
    return secrets.token_hex(4)  # W&B ids are [a-z0-9]; 8 hex digits, like wandb.util.generate_id()


def _online_key(label: str) -> bool:
    """The W&B key for an online session: WANDB_API_KEY already set, or Kaggle's secret store (the secret
    attached to the notebook); kept in this process's environment only, never written."""
    if SessionEnvironment.read().wandb_api_key:
        return True
    try:
        from kaggle_secrets import UserSecretsClient  # only in Kaggle's image

        os.environ["WANDB_API_KEY"] = UserSecretsClient().get_secret(label)
        return True
    except Exception:  # noqa: BLE001 - not on Kaggle, or the secret is not attached
        return False
