"""What Accelerate's examples download, made here: MRPC-shaped sentence pairs (sentence1, sentence2, label), a
word-level tokenizer built in memory, the GLUE MRPC metric (accuracy, f1) and a tiny BERT from a config (random
weights). Each stands in for one call of the original, named beside it; nothing is downloaded."""
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

WORDS = "the a good bad movie film plot actor great awful fine dull bright story ending music".split()


def tokenizer() -> PreTrainedTokenizerFast:
    """AutoTokenizer.from_pretrained("bert-base-cased")"""
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   cls_token="[CLS]", sep_token="[SEP]")


def mrpc(tok, train_size: int = 100, validation_size: int = 32) -> dict:
    """load_dataset("nyu-mll/glue", "mrpc"), tokenized, "label" renamed "labels": {split: list of examples}, a
    map-style dataset (a list has __getitem__ and __len__). Label 1 when the pair says "good"/"great" more than
    "bad"/"awful"."""
    def split(n: int, seed: int) -> list[dict]:
        g = torch.Generator().manual_seed(seed)
        out = []
        for a, b in torch.randint(len(WORDS), (n, 2, 8), generator=g).tolist():
            s1, s2 = " ".join(WORDS[j] for j in a), " ".join(WORDS[j] for j in b)
            s = f"{s1} {s2}"
            out.append({**tok(s1, s2, truncation=True, max_length=24),
                        "labels": int(s.count("good") + s.count("great") > s.count("bad") + s.count("awful"))})
        return out

    return {"train": split(train_size, 0), "validation": split(validation_size, 1)}


class Mrpc:
    """evaluate.load("glue", "mrpc"): add_batch(predictions=, references=), compute() -> accuracy, f1."""

    def __init__(self):
        self.p, self.r = [], []

    def add_batch(self, predictions, references) -> None:
        self.p.append(predictions.cpu())
        self.r.append(references.cpu())

    def compute(self) -> dict:
        p, r = torch.cat(self.p), torch.cat(self.r)
        self.p, self.r = [], []
        tp = int(((p == 1) & (r == 1)).sum())
        return {"accuracy": float((p == r).float().mean()),
                "f1": 2 * tp / max(1, int((p == 1).sum()) + int((r == 1).sum()))}


def model(tok) -> BertForSequenceClassification:
    """AutoModelForSequenceClassification.from_pretrained("bert-base-cased", return_dict=True)"""
    config = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, num_labels=2)
    return BertForSequenceClassification(config)
