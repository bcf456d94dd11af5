"""Accelerate's examples/by_feature/checkpointing.py (huggingface/accelerate) relayed by kaggle-relay, offline
(offline.py stands in for the hub: data, tokenizer, metric, a tiny BERT). Its loop is kept as written: an
epoch loop, gradient accumulation done by hand (loss / gradient_accumulation_steps, an optimizer step when
`step % gradient_accumulation_steps == 0`; accelerator.accumulate() is never entered), an eval at each epoch's end,
and its own `accelerator.save_state` per epoch or every N steps. The lines marked `# relay` are what it adds or
changes; its own resume (--resume_from_checkpoint, skip_first_batches) is the relay's restore().
`--use_accumulate`: the same loop with accelerator.accumulate(model) instead (not in the original).
"""
import argparse
import os

import torch
from torch.optim import AdamW
from torch.utils.data import DataLoader
from transformers import get_linear_schedule_with_warmup

from accelerate import Accelerator, DistributedType
from accelerate.utils import set_seed

import offline  # relay: offline stand-ins for load_dataset, AutoTokenizer, evaluate, from_pretrained
import relay  # relay
from relay.accelerate import RelayAccelerate  # relay

MAX_GPU_BATCH_SIZE = 8  # relay: 16 in the original; 8 makes its default batch of 16 two accumulated micro-batches
EVAL_BATCH_SIZE = 32


def get_datasets(accelerator: Accelerator):
    """The original's get_dataloaders, less the train DataLoader: relay_acc.train_dataloader makes it (relay)."""
    tokenizer = offline.tokenizer()
    with accelerator.main_process_first():
        tokenized_datasets = offline.mrpc(tokenizer)

    def collate_fn(examples):
        max_length = 128 if accelerator.distributed_type == DistributedType.XLA else None
        if accelerator.mixed_precision == "fp8":
            pad_to_multiple_of = 16
        elif accelerator.mixed_precision != "no":
            pad_to_multiple_of = 8
        else:
            pad_to_multiple_of = None
        return tokenizer.pad(examples, padding="longest", max_length=max_length,
                             pad_to_multiple_of=pad_to_multiple_of, return_tensors="pt")

    # relay: the eval loader's iterator seed from its own generator (from the global RNG it moves dropout)
    eval_dataloader = DataLoader(tokenized_datasets["validation"], shuffle=False, collate_fn=collate_fn,
                                 batch_size=EVAL_BATCH_SIZE, generator=torch.Generator().manual_seed(0))
    return tokenizer, tokenized_datasets["train"], eval_dataloader, collate_fn


def training_function(config, args):
    lr = config["lr"]
    num_epochs = int(config["num_epochs"])
    seed = int(config["seed"])
    batch_size = int(config["batch_size"])
    # If the batch size is too big we use gradient accumulation (relay: decided before the Accelerator)
    gradient_accumulation_steps = 1
    if batch_size > MAX_GPU_BATCH_SIZE:
        gradient_accumulation_steps = batch_size // MAX_GPU_BATCH_SIZE
        batch_size = MAX_GPU_BATCH_SIZE
    # relay: by hand a relay step is a micro-batch (every backward); with accumulate() an optimizer step
    relay_batch = batch_size * gradient_accumulation_steps if args.use_accumulate else batch_size
    session = relay.open_session(total_steps=num_epochs * (offline_train_size() // relay_batch))  # relay
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=gradient_accumulation_steps if args.use_accumulate else 1)

    if hasattr(args.checkpointing_steps, "isdigit"):
        if args.checkpointing_steps == "epoch":
            checkpointing_steps = args.checkpointing_steps
        elif args.checkpointing_steps.isdigit():
            checkpointing_steps = int(args.checkpointing_steps)
        else:
            raise ValueError(
                f"Argument `checkpointing_steps` must be either a number or `epoch`. `{args.checkpointing_steps}` passed."
            )
    else:
        checkpointing_steps = None

    set_seed(seed)  # before restore(): a resumed session's restore() puts the saved RNGs back over it

    tokenizer, train_set, eval_dataloader, collate_fn = get_datasets(accelerator)  # relay
    metric = offline.Mrpc()
    model = offline.model(tokenizer)
    model = model.to(accelerator.device)
    optimizer = AdamW(params=model.parameters(), lr=lr)
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer=optimizer,
        num_warmup_steps=10,  # relay: 100 in the original, a run of a few dozen steps here
        # relay: the run's micro-batches over gradient_accumulation_steps (was len(train_dataloader) * num_epochs)
        num_training_steps=(session.total_steps * accelerator.gradient_accumulation_steps
                            // gradient_accumulation_steps),
    )
    model, optimizer, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, eval_dataloader, lr_scheduler
    )
    relay_acc = RelayAccelerate(accelerator, session)  # relay: carries accelerator.save_state in its checkpoint
    # relay: each step's samples a function of the step; an iteration ends at its epoch's end (per_epoch)
    train_dataloader = relay_acc.train_dataloader(train_set, batch_size=relay_batch, collate_fn=collate_fn,
                                                  per_epoch=True)
    relay_acc.restore()  # relay: replaces --resume_from_checkpoint, load_state and skip_first_batches
    overall_step = session.step  # relay

    for epoch in range(session.epoch, num_epochs):  # relay: from the restored step's epoch
        if session.should_stop():  # relay: the session ends at an epoch's end
            break
        model.train()
        # relay: the batches left in the epoch; `step` counts from where the epoch stands (by hand, a relay step
        # is a micro-batch)
        for step, batch in enumerate(train_dataloader, start=session.step_in_epoch):
            batch.to(accelerator.device)
            if args.use_accumulate:
                with accelerator.accumulate(model):
                    loss = model(**batch).loss
                    accelerator.backward(loss)
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
            else:
                outputs = model(**batch)
                loss = outputs.loss
                loss = loss / gradient_accumulation_steps
                accelerator.backward(loss)
                if step % gradient_accumulation_steps == 0:
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
            relay_acc.step_done(loss)  # relay
            overall_step = session.step  # relay: the relay's count, right across sessions

            if isinstance(checkpointing_steps, int):
                output_dir = f"step_{overall_step}"
                if overall_step % checkpointing_steps == 0:
                    if args.output_dir is not None:
                        output_dir = os.path.join(args.output_dir, output_dir)
                    accelerator.save_state(output_dir)
        if not relay_acc.epoch_end:  # relay: the session stops inside the epoch
            break
        model.eval()
        for step, batch in enumerate(eval_dataloader):
            batch.to(accelerator.device)
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            metric.add_batch(predictions=predictions, references=references)
            session.heartbeat()  # relay: a long eval is not a stall
        eval_metric = metric.compute()
        accelerator.print(f"epoch {epoch}:", eval_metric)
        session.log("eval", **eval_metric)  # relay: metrics.jsonl, progress.json's metrics

        if checkpointing_steps == "epoch":
            output_dir = f"epoch_{epoch}"
            if args.output_dir is not None:
                output_dir = os.path.join(args.output_dir, output_dir)
            accelerator.save_state(output_dir)
    session.close()  # relay
    accelerator.end_training()


def offline_train_size() -> int:
    return 100  # relay: offline.mrpc's train split (MRPC's is 3668)


def main():
    parser = argparse.ArgumentParser(description="Simple example of training script.")
    parser.add_argument("--mixed_precision", type=str, default=None, choices=["no", "fp16", "bf16", "fp8"])
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    parser.add_argument("--checkpointing_steps", type=str, default=None,
                        help="Whether the various states should be saved at the end of every n steps, or 'epoch'.")
    parser.add_argument("--output_dir", type=str, default=".",
                        help="Where its own checkpoint folders go (the relay's checkpoint needs none of them).")
    parser.add_argument("--use_accumulate", action="store_true",
                        help="relay: accelerator.accumulate(model) instead of accumulating by hand")
    args = parser.parse_args()
    config = {"lr": 2e-3, "num_epochs": 3, "seed": 42, "batch_size": 16}  # relay: lr 2e-5 for a pretrained BERT
    training_function(config, args)


if __name__ == "__main__":
    main()
