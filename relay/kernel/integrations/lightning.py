"""Lightning under the relay: a per-session budget, the save at a batch end, RNG in the callback's state.

    session = relay.open_session()
    relay_cb = RelayLightningCallback(session)
    ckpt_path = relay_cb.restore()            # the relay's newest valid checkpoint, unpacked; None when fresh
    trainer = L.Trainer(max_steps=session.total_steps, callbacks=[relay_cb], enable_checkpointing=False)
    trainer.fit(module, ckpt_path=ckpt_path)
    session.close()

Unlike Lightning's `Timer` (which adds the elapsed time of earlier runs back on resume, #10226), the budget is
this session's own: the relay's clock, from measured step and save times. At a train batch end where the
session must stop (or an insurance save is due), the callback writes the Trainer's checkpoint and packs it
into a relay checkpoint (atomic, manifest-checked, relay retention); never inside a signal handler (#21406).
Resuming uses the path the relay gives, not "last" chosen by mtime. The RNG states travel in this callback's
state and are put back at train start, after Lightning has restored everything else.
Lightning's loggers record the relay's step (optimizer steps done, as HF and the relay's own log do): Lightning
alone logs a training step at the steps done before it, one less, so its record of the checkpoint's step `c`
would land past the handoff's cut at `c` and be logged again by the next session.
For an exact data order use `session.batch_sampler(...)` in train_dataloader (a position derived from the step).
"""
from __future__ import annotations

import time
from typing import Optional

import lightning.pytorch as pl
import torch

from relay.kernel.integrations.hf import CheckpointFolder
from relay.kernel.session.api import Session
from relay.kernel.session.api_distributed import single_process
from relay.kernel.session.rng import rng_state, set_rng_state
from relay.shared.errors import InputError

CKPT_NAME = "lightning.ckpt"


class RelayLightningCallback(pl.Callback):
    def __init__(self, session: Session):
        single_process(session, "RelayLightningCallback")
        self.session = session
        self.folder = CheckpointFolder(session.workdir / "lightning-resume")
        session.register(lightning_checkpoint=self.folder)
        self._rng: Optional[dict] = None
        self._flush_loggers = False  # set by a save: Lightning logs the saved step's records after it

    def restore(self) -> Optional[str]:
        """Restore the session; the unpacked checkpoint for `trainer.fit(..., ckpt_path=...)`."""
        self.session.restore()
        return str(self.folder.restored / CKPT_NAME) if self.folder.restored else None

    # RNG in the callback's own state (Lightning saves none: resumed runs replay the first shuffle otherwise)
    def state_dict(self) -> dict:
        return {"rng": rng_state(self._device)}

    def load_state_dict(self, state: dict) -> None:
        self._rng = state.get("rng")

    def on_fit_start(self, trainer, pl_module) -> None:
        self._device = pl_module.device
        if trainer.max_steps != self.session.total_steps:
            raise InputError(f"Trainer(max_steps={trainer.max_steps}): set it to session.total_steps"
                             f" ({self.session.total_steps}) so every session agrees on the schedule")
        self.session.weights_model = pl_module
        for logger in trainer.loggers:
            _log_at_relay_step(logger, trainer)

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.global_step != self.session.step:
            raise InputError(f"Lightning resumed at step {trainer.global_step} but the relay at {self.session.step}:"
                             " pass ckpt_path=callback.restore() to trainer.fit")
        if self._rng is not None:
            set_rng_state(self._rng, pl_module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._flush_loggers:
            self._flush_loggers = False
            for logger in trainer.loggers:
                logger.save()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.session.step:
            return  # gradient accumulation: not an optimizer step yet
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self.session.step_done(loss=loss.detach() if torch.is_tensor(loss) else loss, save=False)
        stop = self.session.should_stop()
        if stop or self.session.insurance_due():
            self._save(trainer, self.session.stop_reason or "periodic")
        if stop:
            trainer.should_stop = True

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.session.heartbeat()  # a long validation is not a stall (session.stall_after)

    def _save(self, trainer, reason: str) -> None:
        path = self.session.workdir / "lightning-save"
        path.mkdir(exist_ok=True)
        started = time.perf_counter()  # the clock plans the final save with the Trainer's write included
        for logger in getattr(trainer, "loggers", ()):  # a TensorBoardLogger's events up to this step on disk before the commit
            logger.save()
        trainer.save_checkpoint(path / CKPT_NAME)
        self.folder.source = path
        try:
            self.session.save(reason, started=started)
        finally:
            (path / CKPT_NAME).unlink(missing_ok=True)
            self.folder.source = None
            self._flush_loggers = True

    _device = torch.device("cpu")


def _log_at_relay_step(logger, trainer) -> None:
    """Make `logger` record every call at the optimizer steps done (the relay's step), whatever step Lightning
    passes (its batches stepped before this one during training)."""
    log_metrics = logger.log_metrics

    def at_relay_step(metrics, step=None):
        return log_metrics(metrics, step=trainer.global_step)

    logger.log_metrics = at_relay_step
