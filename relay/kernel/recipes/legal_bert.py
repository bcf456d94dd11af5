"""Legal-BERT sentence classifier (seed 001): a BERT-base-shaped encoder (InLegalBERT stand-in) with a
classification head, max_length 256, macro-F1 on the validation split.

The seed's memory settings map onto the runtime: micro-batch 8 x accumulation 2 and fp16 autocast on a T4 live
in the spec (`optim.precision: auto`); its "ultra-low-memory" 4 x 4 is what the runtime's OOM back-off reaches
from 8 x 2 (same effective batch 16); "keep only the best" is `checkpoints.keep_best` by macro-F1 beside the
latest resume state; its "lightweight checkpoint" (weights only) is the final export, never the resume state.
Token ids are built once into the parquet feature cache with an in-memory tokenizer (or the pretrained one).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from relay.kernel.recipes import legal_data
from relay.kernel.recipes.base import Recipe
from relay.kernel.recipes.price_model import load_pretrained_tokenizer, special_ids, train_tokenizer
from relay.kernel.session.features import FeatureCache, source_version
from relay.shared.errors import InputError
from relay.shared.params import LegalBertParams

log = logging.getLogger(__name__)
FEATURES_VERSION = "1"


# ------------------------------------------------------------------------------------------------- features
def encode(tokenizer, frame, path: Path, max_length: int, overflow: str) -> list[list[int]]:
    """[CLS] ids [SEP] per text; a text over max_length is an InputError naming its line unless truncating."""
    ids = special_ids(tokenizer)
    out = []
    for row, encoding in enumerate(tokenizer.encode_batch(frame["text"].tolist(), add_special_tokens=False)):
        tokens = encoding.ids
        if len(tokens) + 2 > max_length and overflow == "error":
            raise InputError(f"{path}: line {legal_data.line_of(frame, row)}: text is {len(tokens) + 2} tokens, over "
                             f"params.max_length {max_length} (set params.overflow: truncate to cut such texts)")
        out.append([ids["cls"], *tokens[: max_length - 2], ids["sep"]])
    return out


def build_feature_table(train, val, train_path: Path, val_path: Path | None, p: LegalBertParams,
                        tokenizer=None) -> pa.Table:
    """Train rows (split 0) then validation rows (split 1); labels and the tokenizer in the schema metadata."""
    labels = sorted(set(train["label"]))
    if len(labels) < 2:
        raise InputError(f"{train_path}: {len(labels)} distinct label(s); a classifier needs at least 2")
    label_id = {label: i for i, label in enumerate(labels)}
    unknown = ~val["label"].isin(label_id) if val is not None else None
    if unknown is not None and unknown.any():
        row = int(unknown.to_numpy().argmax())
        raise InputError(f"{val_path}: line {legal_data.line_of(val, row)}: label {val['label'].iloc[row]!r} "
                         f"does not occur in {train_path.name}")
    source = "pretrained" if tokenizer is not None else "trained"
    tokenizer = tokenizer or train_tokenizer(train["text"].tolist(), p.vocab_size)
    input_ids = encode(tokenizer, train, train_path, p.max_length, p.overflow)
    labels_col = [label_id[v] for v in train["label"]]
    if val is not None:
        input_ids += encode(tokenizer, val, val_path, p.max_length, p.overflow)
        labels_col += [label_id[v] for v in val["label"]]
    n_val = 0 if val is None else len(val)
    table = pa.table({"split": pa.array([0] * len(train) + [1] * n_val, type=pa.int8()),
                      "label": pa.array(labels_col, type=pa.int32()),
                      "input_ids": pa.array(input_ids, type=pa.list_(pa.int32()))})
    return table.replace_schema_metadata({"tokenizer.json": tokenizer.to_str(), "tokenizer_source": source,
                                          "labels": json.dumps(labels)})


def feature_version() -> str:
    return f"{FEATURES_VERSION}-" + source_version(legal_data, encode, build_feature_table, train_tokenizer)


class Sentences(Dataset):
    """Rows of the feature table; item i is a pure function of i."""

    def __init__(self, recipe: "LegalBertRecipe", rows: np.ndarray):
        self.recipe, self.rows = recipe, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        r, f = int(self.rows[i]), self.recipe
        return {"input_ids": f.ids_values[f.ids_offsets[r]: f.ids_offsets[r + 1]], "label": int(f.label[r])}


def macro_f1(pred: np.ndarray, true: np.ndarray, n_classes: int) -> float:
    """Unweighted mean of per-class F1 over the classes present in either array (sklearn's 'macro')."""
    scores = []
    for c in range(n_classes):
        tp = int(((pred == c) & (true == c)).sum())
        fp, fn = int(((pred == c) & (true != c)).sum()), int(((pred != c) & (true == c)).sum())
        if tp + fp + fn:
            scores.append(2 * tp / (2 * tp + fp + fn))
    return float(np.mean(scores)) if scores else float("nan")


# -------------------------------------------------------------------------------------------------- recipe
class LegalBertRecipe(Recipe):
    name = "legal_bert"
    Params = LegalBertParams
    metric = "macro_f1"
    metric_mode = "max"
    params: LegalBertParams

    def prepare(self) -> None:
        p = self.params
        train_path = self.data_dir / p.train_file
        val_path = self.data_dir / p.val_file if p.val_file else None
        has_val = val_path is not None and val_path.is_file()
        if not train_path.is_file():
            raise InputError(f"{train_path}: file not found (expected a CSV or JSONL file with fields text, label)")
        tokenizer = load_pretrained_tokenizer(p.pretrained) if p.pretrained else None

        def build() -> pa.Table:  # only on a cache miss
            train = legal_data.read_labelled(train_path)
            val = legal_data.read_labelled(val_path) if has_val else None
            return build_feature_table(train, val, train_path, val_path if has_val else None, p, tokenizer)

        key_params = p.model_dump(include={"pretrained", "vocab_size", "max_length", "overflow"})
        key_params["tokenizer"] = "pretrained" if tokenizer is not None else "trained"
        self.feature_cache = FeatureCache(self.cache_dirs)
        table = self.feature_cache.get_or_build("legal_features", [train_path, val_path] if has_val else [train_path],
                                                key_params, feature_version(), build)
        self._load_table(table, has_val, train_path)

    def _load_table(self, table: pa.Table, has_val: bool, train_path: Path) -> None:
        from tokenizers import Tokenizer

        p = self.params
        meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
        self.tokenizer = Tokenizer.from_str(meta["tokenizer.json"])
        self.tokenizer_source, self.labels = meta["tokenizer_source"], json.loads(meta["labels"])
        self.special_ids = special_ids(self.tokenizer)
        ids = table.column("input_ids").combine_chunks()
        self.ids_values, self.ids_offsets = ids.values.to_numpy(zero_copy_only=False), ids.offsets.to_numpy()
        self.label = table.column("label").to_numpy()
        split = table.column("split").to_numpy()
        train_rows, eval_rows = np.flatnonzero(split == 0), np.flatnonzero(split == 1)
        rng = np.random.default_rng(p.eval_seed)
        if not has_val:
            order = rng.permutation(len(train_rows))
            n_eval = max(1, int(round(p.eval_fraction * len(train_rows))))
            eval_rows, train_rows = np.sort(train_rows[order[:n_eval]]), np.sort(train_rows[order[n_eval:]])
        if p.use_subset:  # the seed's quick-run mode: a seeded share of the training rows
            keep = max(1, int(round(p.subset_ratio * len(train_rows))))
            train_rows = np.sort(rng.permutation(train_rows)[:keep])
        if len(train_rows) == 0 or len(eval_rows) == 0:
            raise InputError(f"{train_path}: {len(train_rows)} training and {len(eval_rows)} validation rows; "
                             "both splits need at least one")
        self.train_rows, self.eval_rows = train_rows, eval_rows

    def train_dataset(self) -> Dataset:
        return Sentences(self, self.train_rows)

    def eval_dataset(self) -> Dataset:
        return Sentences(self, self.eval_rows)

    def collate(self, items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        longest = max(len(item["input_ids"]) for item in items)
        width = min(self.params.max_length, -(-longest // 8) * 8)  # multiples of 8 suit fp16 tensor cores
        input_ids = np.full((len(items), width), self.special_ids["pad"], dtype=np.int64)
        attention_mask = np.zeros((len(items), width), dtype=np.int64)
        for row, item in enumerate(items):
            input_ids[row, : len(item["input_ids"])] = item["input_ids"]
            attention_mask[row, : len(item["input_ids"])] = 1
        return {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(attention_mask),
                "label": torch.tensor([item["label"] for item in items], dtype=torch.long)}

    # ------------------------------------------------------------------------------------------------ model
    def encoder_config(self):
        from transformers import BertConfig

        p = self.params
        return BertConfig(vocab_size=self.tokenizer.get_vocab_size(), hidden_size=p.hidden_size,
                          num_hidden_layers=p.num_layers, num_attention_heads=p.num_heads,
                          intermediate_size=p.intermediate_size, hidden_dropout_prob=p.dropout,
                          attention_probs_dropout_prob=p.dropout, max_position_embeddings=512,
                          pad_token_id=self.special_ids["pad"], num_labels=len(self.labels),
                          id2label=dict(enumerate(self.labels)), label2id={v: i for i, v in enumerate(self.labels)})

    def build_model(self) -> nn.Module:
        from transformers import AutoModelForSequenceClassification, BertForSequenceClassification

        p = self.params
        if p.pretrained and self.tokenizer_source == "pretrained":
            try:  # the pretrained folder path (InLegalBERT on Kaggle as a mounted dataset)
                return AutoModelForSequenceClassification.from_pretrained(
                    p.pretrained, num_labels=len(self.labels), ignore_mismatched_sizes=True)
            except (OSError, ValueError) as exc:
                log.warning("pretrained model %r not available offline (%s): random init instead", p.pretrained, exc)
        elif p.pretrained:
            log.warning("pretrained model %r skipped: features were tokenized by a tokenizer trained on %s",
                        p.pretrained, p.train_file)
        return BertForSequenceClassification(self.encoder_config())

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return F.cross_entropy(logits.float(), batch["label"])  # fp32 softmax under fp16 autocast

    def evaluate(self, model: nn.Module, batches: Iterable[dict[str, torch.Tensor]]) -> dict[str, float]:
        preds, trues, loss_sum = [], [], 0.0
        for batch in batches:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
            loss_sum += float(F.cross_entropy(logits, batch["label"], reduction="sum"))
            preds.append(logits.argmax(-1).cpu())
            trues.append(batch["label"].cpu())
        pred, true = torch.cat(preds).numpy(), torch.cat(trues).numpy()
        return {"loss": loss_sum / len(true), "accuracy": float((pred == true).mean()),
                "macro_f1": macro_f1(pred, true, len(self.labels))}

    def enable_activation_checkpointing(self, model: nn.Module) -> bool:
        if not getattr(model, "supports_gradient_checkpointing", False):
            return False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return True

    def export(self, model: nn.Module, out_dir: Path) -> None:
        """The seed's "lightweight checkpoint": weights, config, tokenizer and labels; no optimizer state."""
        from safetensors.torch import save_model

        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        save_model(model, str(out_dir / "model.safetensors"))
        config = {"recipe": self.name, "params": self.params.model_dump(), "labels": self.labels,
                  "model": model.config.to_dict(), "special_ids": self.special_ids}
        (out_dir / "config.json").write_text(json.dumps(config, indent=1, default=str))
        (out_dir / "tokenizer.json").write_text(self.tokenizer.to_str())


def load_exported(out_dir: Path) -> nn.Module:
    """The classifier written by export (weights only): for inference, no data or training state needed."""
    from safetensors.torch import load_model
    from transformers import BertConfig, BertForSequenceClassification

    config = json.loads((Path(out_dir) / "config.json").read_text())
    model = BertForSequenceClassification(BertConfig.from_dict(config["model"]))
    load_model(model, str(Path(out_dir) / "model.safetensors"))
    return model.eval()

