"""A Hugging Face Trainer script relayed by kaggle-relay: a tiny BERT built from a config (random weights,
nothing downloaded) and a word-level tokenizer made in memory. The lines marked `# relay` are all it adds.
"""
import argparse

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast, Trainer,
                          TrainingArguments)

import relay
from relay.hf import RelayCallback

WORDS = "the a good bad movie film plot actor great awful fine dull bright story ending music".split()


def make_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   cls_token="[CLS]", sep_token="[SEP]")


class Reviews(torch.utils.data.Dataset):
    """Generated sentences; label 1 when "good"/"great" outnumber "bad"/"awful". Item i is a function of i."""

    def __init__(self, tokenizer, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        words = torch.randint(len(WORDS), (n, 12), generator=g)
        self.texts = [" ".join(WORDS[j] for j in row) for row in words.tolist()]
        self.labels = [int(t.count("good") + t.count("great") > t.count("bad") + t.count("awful")) for t in self.texts]
        self.enc = tokenizer(self.texts, padding="max_length", max_length=16, truncation=True)

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        return {"input_ids": torch.tensor(self.enc["input_ids"][i]),
                "attention_mask": torch.tensor(self.enc["attention_mask"][i]), "labels": torch.tensor(self.labels[i])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--report-to", default="none", help="tensorboard, wandb or both (comma-separated); none")
    report_to = [t for t in ap.parse_args().report_to.split(",") if t != "none"]
    session = relay.open_session(total_steps=120)  # relay
    tokenizer = make_tokenizer()
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, num_labels=2)
    model = BertForSequenceClassification(config)
    args = TrainingArguments(
        output_dir=str(session.workdir / "hf"), max_steps=session.total_steps, per_device_train_batch_size=16,
        learning_rate=1e-3, logging_steps=10, save_strategy="no", report_to=report_to, seed=session.config.seed,
        dataloader_num_workers=0, disable_tqdm=True, use_cpu=not torch.cuda.is_available())
    callback = RelayCallback(session)  # relay
    resume = callback.restore()  # relay
    trainer = Trainer(model=model, args=args, train_dataset=Reviews(tokenizer, 512, seed=0), callbacks=[callback],
                      processing_class=tokenizer)  # exported with the final model
    trainer.train(resume_from_checkpoint=resume)  # relay: resume_from_checkpoint
    session.close()  # relay


if __name__ == "__main__":
    main()
