"""Tracking without a relay (docs/tracking.md): the spec's `tracking:` errors, TensorBoard's purge on restart in
a session workdir, a tracker failure as a warning, and the W&B run file reader/writer. The relay itself:
tests/e2e/test_tracking_relay.py and tests/e2e/test_tracking_trainers.py."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from relay.orchestrator import wandb_file
from relay.shared import spec as spec_mod

REPO = Path(__file__).resolve().parents[2]
BASE = {"name": "trk", "recipe": "toy", "optim": {"max_steps": 10}}


@pytest.mark.parametrize("tracking, error", [
    ({"wandb": {}}, "spec: tracking.wandb.project: required key is missing"),
    ({"wandb": {"project": "p", "mode": "online"}}, "spec: tracking.wandb.mode: online needs kaggle.enable_internet"),
    ({"tensorboard": "yes"}, "spec: tracking.tensorboard: Input should be a valid boolean"),
    ({"mlflow": True}, "spec: tracking.mlflow: unknown key"),
])
def test_bad_tracking_is_one_line_naming_the_field(tracking, error):
    with pytest.raises(spec_mod.SpecError) as err:
        spec_mod.validate({**BASE, "tracking": tracking})
    assert str(err.value).startswith(error) and "\n" not in str(err.value)


def test_tracking_is_off_unless_asked():
    spec = spec_mod.validate(BASE)
    assert not spec.tracking.enabled and spec.tracking.wandb is None


KILLED_AFTER_A_SAVE = """
import os, signal, sys, torch, relay
s = relay.open_session(total_steps=40, workdir=sys.argv[1], log_every=1, tracking={"tensorboard": True})
m = torch.nn.Linear(4, 1); o = torch.optim.SGD(m.parameters(), lr=0.1)
s.register(model=m, optimizer=o)
s.restore()
for idx in s.batches(64, 8):
    loss = m(torch.randn(8, 4)).pow(2).mean(); o.zero_grad(); loss.backward(); o.step()
    s.step_done(loss=loss.detach(), save=False)
    if s.step == 20 and sys.argv[2] == "kill":
        s.save("periodic")
    if s.step == 25 and sys.argv[2] == "kill":  # steps 21-24 logged after the checkpoint, then a SIGKILL
        s.trackers.flush()
        os.kill(os.getpid(), signal.SIGKILL)
s.close()
"""


def run_script(source: str, workdir: Path, mode: str) -> None:
    """A session script on `workdir` in its own process: "kill" must end in its SIGKILL, "go" must finish."""
    script = workdir.parent / "train.py"
    script.write_text(source)
    env = {**os.environ, "PYTHONPATH": str(REPO), "RELAY_DEVICE": "cpu"}
    env.pop("RELAY_SESSION", None)
    proc = subprocess.run([sys.executable, str(script), str(workdir), mode], env=env, capture_output=True)
    assert proc.returncode == (-signal.SIGKILL if mode == "kill" else 0), proc.stderr[-2000:]


def test_a_resumed_session_supersedes_the_steps_logged_after_its_checkpoint(tmp_path, spawns_processes):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    workdir = tmp_path / "w"
    run_script(KILLED_AFTER_A_SAVE, workdir, "kill")
    run_script(KILLED_AFTER_A_SAVE, workdir, "go")

    folder = workdir / "tensorboard"
    raw = [e.step for p in sorted(folder.iterdir()) for e in EventFileLoader(str(p)).Load()
           for v in e.summary.value if v.tag == "train/loss"]
    # on disk: 21-24 twice (step 25's line waits for step 26: a log step's window is logged at the next step)
    assert sorted(raw) == sorted(list(range(1, 41)) + list(range(21, 25)))
    acc = EventAccumulator(str(folder))
    acc.Reload()  # TensorBoard's reader applies the second session's purge_step (21)
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 41))
    metrics = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    resumed = {r["step"]: r["loss"] for r in metrics if r["session"] == 2}
    assert {e.step: e.value for e in acc.Scalars("train/loss") if e.step > 20} == pytest.approx(resumed)



LIGHTNING_KILLED_AFTER_A_SAVE = """
import os, signal, sys, torch, relay
import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger
from relay.lightning import RelayLightningCallback

class Net(pl.LightningModule):
    def __init__(self, session):
        super().__init__()
        self.session, self.lin = session, torch.nn.Linear(4, 1)
    def training_step(self, batch, idx):
        loss = torch.nn.functional.mse_loss(self.lin(batch[0]), batch[1])
        self.log("train_mse", loss)
        return loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
        return torch.utils.data.DataLoader(data, batch_sampler=self.session.batch_sampler(64, batch_size=8))

class KillAfterASave(pl.Callback):  # a save at step 20; steps 21-24 logged after it, then a SIGKILL
    def __init__(self, relay_cb):
        self.relay_cb = relay_cb
    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == 20:
            self.relay_cb._save(trainer, "periodic")
        if trainer.global_step == 25:
            [logger.save() for logger in trainer.loggers]
            os.kill(os.getpid(), signal.SIGKILL)

session = relay.open_session(total_steps=40, workdir=sys.argv[1], log_every=1, tracking={"tensorboard": True})
relay_cb = RelayLightningCallback(session)
ckpt_path = relay_cb.restore()
callbacks = [relay_cb] + ([KillAfterASave(relay_cb)] if sys.argv[2] == "kill" else [])
trainer = pl.Trainer(max_steps=40, callbacks=callbacks, enable_checkpointing=False, log_every_n_steps=1,
                     logger=TensorBoardLogger(save_dir=str(session.tensorboard_dir), name="", version=""),
                     enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1)
trainer.fit(Net(session), ckpt_path=ckpt_path)
session.close()
"""


def test_lightnings_logger_records_the_relays_step_so_the_handoff_cut_supersedes_its_tail(tmp_path,
                                                                                               spawns_processes):
    """Lightning alone logs a training step at the steps done before it; at the relay's step, the handoff's cut
    at the checkpoint (20) drops exactly the steps the next session trains again (21-24), none twice."""
    pytest.importorskip("lightning")
    from relay.orchestrator.tracking_handoff import cut_event_file, is_event_file
    from tracking_fixtures import raw_steps

    workdir = tmp_path / "w"
    run_script(LIGHTNING_KILLED_AFTER_A_SAVE, workdir, "kill")
    folder = workdir / "tensorboard"
    assert sorted(raw_steps(folder, "train_mse")) == list(range(1, 25))  # the relay's steps, 21-24 past the save
    for path in [p for p in folder.iterdir() if is_event_file(p.name)]:  # the handoff's cut at the checkpoint
        cut_event_file(path, tmp_path / "cut", max_step=20)
        (tmp_path / "cut").replace(path)
    run_script(LIGHTNING_KILLED_AFTER_A_SAVE, workdir, "go")
    assert sorted(raw_steps(folder, "train_mse")) == list(range(1, 41))  # each step once
    assert sorted(raw_steps(folder, "train/loss")) == list(range(1, 41))  # at the same steps as the relay's own

def test_a_failing_tracker_is_a_warning_and_the_session_goes_on(tmp_path, monkeypatch, caplog):
    import torch
    import wandb
    from torch.utils.tensorboard.writer import FileWriter

    import relay

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(FileWriter, "add_summary", broken)
    monkeypatch.setattr(wandb, "init", broken)
    monkeypatch.delenv("RELAY_SESSION", raising=False)
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "hf"))  # a user's own: left alone
    s = relay.open_session(total_steps=12, workdir=str(tmp_path / "w"), log_every=2,
                           tracking={"tensorboard": True, "wandb": {"project": "p", "mode": "offline"}})
    m = torch.nn.Linear(2, 1)
    s.register(model=m)
    with caplog.at_level(logging.WARNING):
        s.restore()
        for _ in s.batches(16, 4):
            s.step_done(loss=m(torch.ones(4, 2)).sum().detach())
        progress = s.close()
    assert progress["status"] == "done" and os.environ["TENSORBOARD_LOGGING_DIR"] == str(tmp_path / "hf")
    warned = [r.getMessage() for r in caplog.records if "tracking failed" in r.getMessage()]
    assert len(warned) == 2 and all("disk full" in w for w in warned), warned  # once each, then off


def test_wandb_file_round_trip_across_blocks_and_a_torn_tail(tmp_path):
    from wandb.proto import wandb_internal_pb2 as pb

    path = tmp_path / "run-x.wandb"
    run = pb.Record()
    run.run.run_id, run.run.project = "x1", "p"
    wandb_file.write_records(path, [run.SerializeToString()])
    rows = [(s, {"train/loss": s / 10, "blob": "y" * (70_000 if s == 30 else 10)}) for s in range(10, 60, 10)]
    assert wandb_file.append_rows(path, rows) == 5  # one row spans three 32 KiB blocks
    assert wandb_file.run_id(path) == "x1"
    assert [(s, r["train/loss"]) for s, r in wandb_file.history(path)] == [(s, s / 10) for s in range(10, 60, 10)]
    assert wandb_file.cut(path, 30) == 2
    assert [s for s, _ in wandb_file.history(path)] == [10, 20, 30]
    path.write_bytes(path.read_bytes()[:-5])  # a SIGKILLed writer: the last record is torn
    assert [s for s, _ in wandb_file.history(path)] == [10, 20]
