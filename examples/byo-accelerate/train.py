"""Accelerate's examples/nlp_example.py (BERT on sentence pairs, AdamW, linear warmup, gradient accumulation, an
eval at each epoch's end) relayed by kaggle-relay, offline: a tiny BERT built from a config (random weights),
synthetic sentence pairs and a word-level tokenizer made in memory; nothing is downloaded.
The lines marked `# relay` are what it adds or changes.
"""
import argparse

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast,
                          get_linear_schedule_with_warmup)

import relay
from relay.accelerate import RelayAccelerate

WORDS = "the a good bad movie film plot actor great awful fine dull bright story ending music".split()


def make_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   cls_token="[CLS]", sep_token="[SEP]")


def sentence_pairs(tokenizer, n: int, seed: int) -> list[dict]:
    """MRPC's shape: (sentence1, sentence2, label); label 1 when the pair says "good"/"great" more than
    "bad"/"awful"."""
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(len(WORDS), (n, 2, 8), generator=g).tolist()

    items = []
    for a, b in words:
        s1, s2 = " ".join(WORDS[j] for j in a), " ".join(WORDS[j] for j in b)
        enc = tokenizer(s1, s2, truncation=True, max_length=24)
        s = f"{s1} {s2}"
        items.append({**enc, "labels": int(s.count("good") + s.count("great") > s.count("bad") + s.count("awful"))})
    return items


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch-size", type=int, default=16, help="the effective batch of an optimizer step")
    ap.add_argument("--accumulation", type=int, default=2)
    ap.add_argument("--mixed-precision", default="no", help="no, fp16 (a GradScaler on a GPU) or bf16")
    args = ap.parse_args()

    session = relay.open_session(total_steps=96)  # relay: also seeds torch, numpy, random (set_seed not needed)
    # relay: split_batches, so the scheduler steps once per optimizer step whatever the number of processes
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=args.accumulation,
                              dataloader_config=DataLoaderConfiguration(split_batches=True))
    tokenizer = make_tokenizer()
    train_set, eval_set = sentence_pairs(tokenizer, 256, seed=0), sentence_pairs(tokenizer, 64, seed=1)

    def collate_fn(examples):
        return tokenizer.pad(examples, padding="longest", return_tensors="pt")

    # the eval loader's iterator seed from its own generator: from the global RNG it shifts dropout (relay)
    eval_dataloader = torch.utils.data.DataLoader(eval_set, shuffle=False, collate_fn=collate_fn, batch_size=32,
                                                  generator=torch.Generator().manual_seed(0))
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, num_labels=2)
    model = BertForSequenceClassification(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    lr_scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=10,
                                                   num_training_steps=session.total_steps)  # relay: the run's steps
    model, optimizer, eval_dataloader, lr_scheduler = accelerator.prepare(model, optimizer, eval_dataloader,
                                                                          lr_scheduler)
    relay_acc = RelayAccelerate(accelerator, session)  # relay: carries accelerator.save_state in the checkpoint
    train_dataloader = relay_acc.train_dataloader(train_set, batch_size=args.batch_size,  # relay: step-derived
                                                  collate_fn=collate_fn)
    relay_acc.restore()  # relay: accelerator.load_state of the newest valid checkpoint

    model.train()
    for batch in train_dataloader:  # relay: from the restored step until the session must stop
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        relay_acc.step_done(loss)  # relay: counts an optimizer step when accelerator.sync_gradients
        if relay_acc.epoch_end and accelerator.sync_gradients:  # relay: the epoch's end is a step count
            evaluate(model, eval_dataloader, accelerator, session)
            model.train()
    session.close()  # relay


def evaluate(model, eval_dataloader, accelerator, session) -> None:
    model.eval()
    predictions, references = [], []
    for batch in eval_dataloader:
        with torch.no_grad():
            logits = model(**batch).logits
        preds, refs = accelerator.gather_for_metrics((logits.argmax(dim=-1), batch["labels"]))
        predictions.append(preds)
        references.append(refs)
        session.heartbeat()  # relay: a long eval is not a stall
    p, r = torch.cat(predictions), torch.cat(references)
    tp = int(((p == 1) & (r == 1)).sum())
    f1 = 2 * tp / max(1, int((p == 1).sum()) + int((r == 1).sum()))
    accuracy = float((p == r).float().mean())
    accelerator.print(f"step {session.step} (epoch {session.epoch}): accuracy {accuracy:.3f} f1 {f1:.3f}")
    session.log("eval", accuracy=accuracy, f1=f1)  # relay: metrics.jsonl, progress.json's metrics


if __name__ == "__main__":
    main()
