"""Hugging Face `Trainer` under the relay: stop before the session deadline with a resumable checkpoint.

    session = relay.open_session()
    relay_cb = RelayCallback(session)
    resume = relay_cb.restore()              # the relay's newest valid checkpoint, unpacked for the Trainer
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[relay_cb])
    trainer.train(resume_from_checkpoint=resume)
    session.close()

At each step end the callback asks the session whether to stop (measured step and save times, SIGTERM flag,
step cap); when it must, it sets BOTH `should_save` and `should_training_stop` (stop alone does not save).
After the Trainer writes its checkpoint-N folder, the callback packs the folder's files into a relay
checkpoint (atomic, manifest-checked, relay retention within the disk budget) and removes the Trainer's copy,
so `save_total_limit` plays no part. The Trainer's logs go into metrics.jsonl. When the run is done the export
(and the relay's `<name>-model` dataset) holds the model as `save_pretrained` writes it, with the Trainer's
tokenizer or processor: `from_pretrained` loads it.

Exactness: see docs/your-code.md; the Trainer resumes its data order by skipping
batches (transformers #11284), which is exact for map-style datasets but O(steps).
"""
from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Optional

import torch
from transformers import TrainerCallback

from relay.kernel.session.api import Session
from relay.kernel.session.api_distributed import single_process
from relay.shared.errors import InputError


class CheckpointFolder:
    """A Trainer checkpoint folder as registered state: its files' bytes (uint8 tensors, weights_only safe)."""

    def __init__(self, restore_to: Path):
        self.source: Optional[Path] = None  # the folder the Trainer just wrote
        self.restore_to = restore_to
        self.restored: Optional[Path] = None

    def state_dict(self) -> dict:
        if self.source is None:
            return {}
        return {f.name: torch.frombuffer(bytearray(f.read_bytes()), dtype=torch.uint8)
                for f in sorted(self.source.iterdir()) if f.is_file()}

    def load_state_dict(self, files: dict) -> None:
        if self.restore_to.exists():
            shutil.rmtree(self.restore_to)
        self.restore_to.mkdir(parents=True)
        for name, data in files.items():
            (self.restore_to / name).write_bytes(data.numpy().tobytes())
        self.restored = self.restore_to


class RelayCallback(TrainerCallback):
    def __init__(self, session: Session):
        single_process(session, "RelayCallback")
        self.session = session
        self.folder = CheckpointFolder(session.workdir / "hf-resume" / "checkpoint")
        session.register(hf_checkpoint=self.folder)
        self._save_started: Optional[float] = None
        logging.getLogger("transformers.trainer").addFilter(self._paused_is_not_completed)

    def _paused_is_not_completed(self, record: logging.LogRecord) -> bool:
        """The Trainer says "Training completed" whenever train() returns: a paused session has not."""
        if "Training completed" in str(record.msg) and self.session.step < self.session.total_steps:
            print(f"relay: session paused at step {self.session.step}/{self.session.total_steps}"
                  f" ({self.session.stop_reason}); the next session resumes it", flush=True)
            return False
        return True

    def restore(self) -> Optional[str]:
        """Restore the session; the unpacked checkpoint for `trainer.train(resume_from_checkpoint=...)`."""
        self.session.restore()
        return str(self.folder.restored) if self.folder.restored else None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        # Refuse what cannot resume, in one line each.
        if args.save_only_model:
            raise InputError("TrainingArguments.save_only_model=True: a checkpoint without optimizer, scheduler"
                             " and RNG cannot resume; leave it False")
        if args.save_total_limit is not None:
            raise InputError("TrainingArguments.save_total_limit: the relay keeps checkpoints (checkpoints.keep_last"
                             " within disk_budget_gb); leave it None")
        if args.ignore_data_skip:
            raise InputError("TrainingArguments.ignore_data_skip=True: a resumed session would train on the first"
                             " batches again; leave it False")
        dataset = getattr(kwargs.get("train_dataloader"), "dataset", None)
        if isinstance(dataset, torch.utils.data.IterableDataset):  # HF datasets' streaming ones included
            raise InputError("train_dataset: an IterableDataset cannot resume exactly (the Trainer cannot skip a"
                             " stream to a step: transformers #26413); use a map-style Dataset")
        if self.session._trace is not None and dataset is not None:  # under verify-resume: each step's batch
            self.session._trace.watch_dataset(dataset, args.gradient_accumulation_steps)
        if args.max_steps != self.session.total_steps:
            raise InputError(f"TrainingArguments.max_steps={args.max_steps}: set it to session.total_steps"
                             f" ({self.session.total_steps}) so every session agrees on the schedule")
        self.session.weights_model = model
        processor = kwargs.get("processing_class") or kwargs.get("tokenizer")  # the name before transformers 4.46
        if callable(getattr(processor, "save_pretrained", None)):  # exported with the model: from_pretrained loads it
            self.session.export_extras = [processor]
        if state.global_step != self.session.step:
            raise InputError(f"the Trainer resumed at step {state.global_step} but the relay at {self.session.step}:"
                             " pass resume_from_checkpoint=callback.restore()")

    def on_step_end(self, args, state, control, **kwargs):
        self.session.step_done(save=False, samples=args.train_batch_size * args.gradient_accumulation_steps
                               * max(1, args.world_size))
        if self.session.should_stop() or self.session.insurance_due():
            control.should_save = True
            control.should_training_stop = self.session.stop_reason is not None
        # The Trainer writes checkpoint-N before on_save: the save the clock plans for starts here.
        self._save_started = time.perf_counter() if control.should_save else None
        return control

    def on_prediction_step(self, args, state, control, **kwargs):
        self.session.heartbeat()  # a long eval is not a stall (session.stall_after)
        return control

    def on_evaluate(self, args, state, control, **kwargs):
        if self._save_started is not None:  # an eval due at this step runs between step end and save
            self._save_started = time.perf_counter()
        return control

    def on_save(self, args, state, control, **kwargs):
        self.folder.source = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        reason = self.session.stop_reason or "periodic"
        self.session.save(reason, started=self._save_started)
        self._save_started = None
        shutil.rmtree(self.folder.source, ignore_errors=True)  # the relay's copy is the checkpoint now
        self.folder.source = None
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        values = {k: float(v) for k, v in (logs or {}).items() if isinstance(v, (int, float))}
        kind = "eval" if any(k.startswith("eval_") for k in values) else "train"
        # the trackers the Trainer reports to itself (report_to) get its logs once, from its own callback
        self.session.trackers.muted = {t for t in ("tensorboard", "wandb") if t in (args.report_to or [])}
        try:
            if kind == "train" and "loss" in values:
                self.session.log("train", **values)
            elif kind == "eval":
                self.session.log("eval", **{k.removeprefix("eval_"): v for k, v in values.items()})
        finally:
            self.session.trackers.muted = set()
        return control
