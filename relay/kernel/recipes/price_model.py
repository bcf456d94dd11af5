"""Price model (seed 004, Amazon ML Challenge): catalog text through a DeBERTa-v2 encoder, mean-pooled, plus
quantities parsed from the text and brand/category embeddings, regressing log1p(price); metric SMAPE.

Features (token ids, numeric columns, brand/category ids, the tokenizer) are built once into the parquet
feature cache; a later session, or one with a published features dataset mounted, skips extraction.
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd
import pyarrow as pa
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from relay.kernel.recipes import price_data
from relay.kernel.recipes.base import Recipe
from relay.kernel.session.features import FeatureCache, source_version
from relay.shared.errors import InputError
from relay.shared.params import PriceModelParams

log = logging.getLogger(__name__)

FEATURES_VERSION = "1"  # bump by hand for changes the source hash cannot see (e.g. a library behaviour)
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
NUMERIC_FEATURES = ["log_pack", "log_size", "log_total", "is_mass", "is_volume", "is_count", "has_size",
                    "log_chars", "n_bullets"]


# ------------------------------------------------------------------------------------ feature extraction
def train_tokenizer(texts: list[str], vocab_size: int):
    """A WordLevel tokenizer trained in memory (deterministic: ties are broken by the word itself)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                        show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def load_pretrained_tokenizer(name: str):
    """The backend `tokenizers.Tokenizer` of a pretrained fast tokenizer, or None when not available offline."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name).backend_tokenizer
    except (OSError, ValueError, AttributeError) as exc:
        log.warning("pretrained tokenizer %r not available offline (%s); training one on train.csv", name, exc)
        return None


def special_ids(tokenizer) -> dict[str, int]:
    """pad/cls/sep ids: ours ([PAD]...) or a DeBERTa/BERT-style pretrained vocabulary's."""
    vocab = tokenizer.get_vocab()
    pick = lambda *names: next((vocab[n] for n in names if n in vocab), 0)  # noqa: E731
    return {"pad": pick("[PAD]", "<pad>"), "cls": pick("[CLS]", "<s>"), "sep": pick("[SEP]", "</s>")}


def encode_texts(tokenizer, texts: list[str], max_len: int) -> list[list[int]]:
    ids = special_ids(tokenizer)
    encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
    return [[ids["cls"], *e.ids[: max_len - 2], ids["sep"]] for e in encodings]


def numeric_matrix(texts: list[str]) -> np.ndarray:
    """One row of NUMERIC_FEATURES per text, log-scaled so the MLP sees values of order 1-10."""
    rows = []
    for text in texts:
        q = price_data.parse_quantities(text)
        dim = q["total_dim"] or q["size_dim"]
        rows.append([math.log1p(q["pack"]), math.log1p(q["size_base"]), math.log1p(q["total_base"]),
                     dim == "mass", dim == "volume", dim == "count", q["size_dim"] is not None,
                     math.log1p(len(text)), math.log1p(text.count("Bullet Point"))])
    return np.asarray(rows, dtype=np.float32).reshape(len(texts), len(NUMERIC_FEATURES))


def vocabulary(values: list[str], cap: int) -> list[str]:
    """Values seen at least twice, most frequent first (ties by value); index + 1 is the id, 0 = unknown."""
    counts = pd.Series(values).value_counts()
    counts = counts[(counts >= 2) & (counts.index != "")]
    return sorted(counts.index, key=lambda v: (-counts[v], v))[: cap - 1]


def build_feature_table(train: pd.DataFrame, test: pd.DataFrame, p: PriceModelParams, tokenizer=None) -> pa.Table:
    """Everything prepare() needs, train rows first then test rows; vocabularies live in the schema metadata.
    Without a (pretrained) tokenizer, one is trained on the train texts."""
    texts = train["catalog_content"].tolist() + test["catalog_content"].tolist()
    source = "pretrained" if tokenizer is not None else "trained"
    tokenizer = tokenizer or train_tokenizer(train["catalog_content"].tolist(), p.vocab_size)
    brands_categories = [price_data.brand_and_category(t) for t in texts]
    brands = vocabulary([b for b, _ in brands_categories[: len(train)]], p.max_brands)
    categories = vocabulary([c for _, c in brands_categories[: len(train)]], p.max_categories)
    brand_id, category_id = {b: i + 1 for i, b in enumerate(brands)}, {c: i + 1 for i, c in enumerate(categories)}
    numeric = numeric_matrix(texts)
    columns = {
        "sample_id": pa.array(np.concatenate([train["sample_id"].to_numpy(), test["sample_id"].to_numpy()]),
                              type=pa.int64()),
        "split": pa.array([0] * len(train) + [1] * len(test), type=pa.int8()),
        "price": pa.array(train["price"].astype(float).tolist() + [None] * len(test), type=pa.float64()),
        "input_ids": pa.array(encode_texts(tokenizer, texts, p.max_len), type=pa.list_(pa.int32())),
        "brand_id": pa.array([brand_id.get(b, 0) for b, _ in brands_categories], type=pa.int32()),
        "category_id": pa.array([category_id.get(c, 0) for _, c in brands_categories], type=pa.int32()),
    }
    columns.update({name: pa.array(numeric[:, i]) for i, name in enumerate(NUMERIC_FEATURES)})
    metadata = {"tokenizer.json": tokenizer.to_str(), "tokenizer_source": source, "brands": json.dumps(brands),
                "categories": json.dumps(categories)}
    return pa.table(columns).replace_schema_metadata(metadata)


def feature_version() -> str:
    return f"{FEATURES_VERSION}-" + source_version(price_data, train_tokenizer, load_pretrained_tokenizer,
                                                   special_ids, encode_texts, numeric_matrix, vocabulary,
                                                   build_feature_table)


# ------------------------------------------------------------------------------------------------- data
class PriceRows(Dataset):
    """Rows of the feature table; item i is a pure function of i (no RNG)."""

    def __init__(self, recipe: "PriceModelRecipe", rows: np.ndarray):
        self.recipe, self.rows = recipe, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        r, f = int(self.rows[i]), self.recipe
        item = {"input_ids": f.ids_values[f.ids_offsets[r]: f.ids_offsets[r + 1]], "numeric": f.numeric[r],
                "brand": f.brand[r], "category": f.category[r]}
        if not math.isnan(f.log_price[r]):
            item["target"] = f.log_price[r]
        return item


# ------------------------------------------------------------------------------------------------ model
class PriceRegressor(nn.Module):
    """Mean-pooled text encoder + numeric MLP + brand/category embeddings -> log1p(price)."""

    def __init__(self, text_encoder: nn.Module, n_numeric: int, n_brands: int, n_categories: int,
                 side_dim: int, dropout: float, use_side_features: bool, log_price_mean: float = 0.0):
        super().__init__()
        self.text_encoder = text_encoder
        self.use_side_features = use_side_features
        width = text_encoder.config.hidden_size
        if use_side_features:
            self.numeric_mlp = nn.Sequential(nn.Linear(n_numeric, side_dim), nn.GELU(), nn.Linear(side_dim, side_dim))
            self.brand_embedding = nn.Embedding(n_brands, side_dim)
            self.category_embedding = nn.Embedding(n_categories, side_dim)
            width += 3 * side_dim
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(width, side_dim * 2), nn.GELU(),
                                  nn.Dropout(dropout), nn.Linear(side_dim * 2, 1))
        # Start at the mean log price: the first steps learn the signal, not the offset.
        nn.init.constant_(self.head[-1].bias, log_price_mean)

    def forward(self, input_ids, attention_mask, numeric, brand, category) -> torch.Tensor:
        hidden = self.text_encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        hidden = hidden.float()  # pool in fp32: an fp16 sum over 256+ tokens can overflow under AMP
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        parts = [(hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)]
        if self.use_side_features:
            parts += [self.numeric_mlp(numeric), self.brand_embedding(brand), self.category_embedding(category)]
        return self.head(torch.cat([x.float() for x in parts], dim=-1)).squeeze(-1).float()


def encoder_config(p: PriceModelParams, vocab_size: int, pad_id: int):
    """DeBERTa-v3 style config (relative attention, p2c/c2p, no absolute positions) of the given shape."""
    from transformers import DebertaV2Config

    return DebertaV2Config(
        vocab_size=vocab_size, hidden_size=p.hidden_size, num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_heads, intermediate_size=p.intermediate_size, hidden_dropout_prob=p.dropout,
        attention_probs_dropout_prob=p.dropout, max_position_embeddings=max(512, p.max_len), type_vocab_size=0,
        relative_attention=True, position_buckets=256, max_relative_positions=-1, pos_att_type=["p2c", "c2p"],
        norm_rel_ebd="layer_norm", share_att_key=True, position_biased_input=False, layer_norm_eps=1e-7,
        pad_token_id=pad_id)


def smape(pred: np.ndarray, true: np.ndarray) -> float:
    """Symmetric MAPE in percent (0/0 counts as 0), the challenge metric."""
    denominator = (np.abs(pred) + np.abs(true)) / 2.0
    ratio = np.divide(np.abs(pred - true), denominator, out=np.zeros_like(denominator), where=denominator > 0)
    return float(100.0 * ratio.mean()) if len(ratio) else float("nan")


def _model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: batch[k] for k in ("input_ids", "attention_mask", "numeric", "brand", "category")}


# ----------------------------------------------------------------------------------------------- recipe
class PriceModelRecipe(Recipe):
    name = "price_model"
    Params = PriceModelParams
    metric = "smape"
    metric_mode = "min"
    params: PriceModelParams

    def prepare(self) -> None:
        p = self.params
        train_path, test_path = self.data_dir / p.train_file, self.data_dir / p.test_file
        if not train_path.is_file():
            raise InputError(f"{train_path}: file not found (expected a CSV with columns "
                                    f"{', '.join(price_data.TRAIN_COLUMNS)})")
        has_test = test_path.is_file()
        # Resolved before the cache lookup and part of the key: features tokenized by a fallback tokenizer
        # must never be mistaken for ones that match the pretrained model's vocabulary.
        tokenizer = load_pretrained_tokenizer(p.pretrained) if p.pretrained else None

        def build() -> pa.Table:  # only on a cache miss: a hit never parses the CSVs
            train = price_data.read_split(train_path, price_data.TRAIN_COLUMNS)
            self._eval_rows(len(train), train_path)  # refuse before anything is built or cached
            test = price_data.read_split(test_path, price_data.TEST_COLUMNS) if has_test else train.iloc[:0, :2]
            return build_feature_table(train, test, p, tokenizer)

        if not has_test:
            log.warning("%s not found: training without a test split (predict() will write nothing)", test_path)
        if self.cache_dirs:
            key_params = p.model_dump(include={"pretrained", "vocab_size", "max_len", "max_brands", "max_categories"})
            key_params["tokenizer"] = "pretrained" if tokenizer is not None else "trained"
            inputs = [train_path, test_path] if has_test else [train_path]
            self.feature_cache = FeatureCache(self.cache_dirs)
            table = self.feature_cache.get_or_build("price_features", inputs, key_params, feature_version(), build)
        else:
            table = build()
        self._load_table(table)

    def _load_table(self, table: pa.Table) -> None:
        meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_str(meta["tokenizer.json"])
        self.special_ids = special_ids(self.tokenizer)
        self.tokenizer_source = meta.get("tokenizer_source", "trained")
        self.brands, self.categories = json.loads(meta["brands"]), json.loads(meta["categories"])
        input_ids = table.column("input_ids").combine_chunks()
        self.ids_values = input_ids.values.to_numpy(zero_copy_only=False)  # int32: half the memory of int64
        self.ids_offsets = input_ids.offsets.to_numpy()
        self.numeric = np.stack([table.column(n).to_numpy() for n in NUMERIC_FEATURES], axis=1).astype(np.float32)
        self.brand = table.column("brand_id").to_numpy().astype(np.int64)
        self.category = table.column("category_id").to_numpy().astype(np.int64)
        self.sample_id = table.column("sample_id").to_numpy()
        price = table.column("price").to_numpy(zero_copy_only=False).astype(np.float64)
        self.log_price = np.log1p(price).astype(np.float32)  # NaN for test rows
        split = table.column("split").to_numpy()
        labelled = np.flatnonzero(split == 0)
        order = np.random.default_rng(self.params.eval_seed).permutation(len(labelled))
        n_eval = self._eval_rows(len(labelled), self.data_dir / self.params.train_file)
        self.eval_rows, self.train_rows = np.sort(labelled[order[:n_eval]]), np.sort(labelled[order[n_eval:]])
        self.test_rows = np.flatnonzero(split == 1)
        self.log_price_mean = float(self.log_price[self.train_rows].mean())

    def _eval_rows(self, n_labelled: int, train_path: Path) -> int:
        n_eval = max(1, int(round(self.params.eval_fraction * n_labelled)))
        if n_eval >= n_labelled:
            raise InputError(f"{train_path}: {n_labelled} data rows leave nothing to train on with"
                             f" params.eval_fraction={self.params.eval_fraction}; expected at least {n_eval + 1}")
        return n_eval

    def train_dataset(self) -> Dataset:
        return PriceRows(self, self.train_rows)

    def eval_dataset(self) -> Dataset:
        return PriceRows(self, self.eval_rows)

    def test_dataset(self) -> Dataset:
        return PriceRows(self, self.test_rows)

    def collate(self, items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        longest = max(len(item["input_ids"]) for item in items)
        width = min(self.params.max_len, -(-longest // 8) * 8)  # multiples of 8 suit fp16 tensor cores
        input_ids = np.full((len(items), width), self.special_ids["pad"], dtype=np.int64)
        attention_mask = np.zeros((len(items), width), dtype=np.int64)
        for row, item in enumerate(items):
            input_ids[row, : len(item["input_ids"])] = item["input_ids"]
            attention_mask[row, : len(item["input_ids"])] = 1
        batch = {
            "input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(attention_mask),
            "numeric": torch.from_numpy(np.stack([item["numeric"] for item in items])),
            "brand": torch.tensor([int(item["brand"]) for item in items], dtype=torch.long),
            "category": torch.tensor([int(item["category"]) for item in items], dtype=torch.long),
        }
        if "target" in items[0]:
            batch["target"] = torch.tensor([float(item["target"]) for item in items], dtype=torch.float32)
        return batch

    # ---------------------------------------------------------------------------------------------- model
    def _text_encoder(self) -> nn.Module:
        from transformers import AutoModel, DebertaV2Model

        p = self.params
        if p.pretrained and self.tokenizer_source != "pretrained":
            log.warning("pretrained model %r skipped: the features were tokenized with a tokenizer trained on "
                        "train.csv, whose ids do not match its vocabulary", p.pretrained)
        elif p.pretrained:
            try:
                return AutoModel.from_pretrained(p.pretrained)
            except (OSError, ValueError) as exc:
                log.warning("pretrained model %r not available offline (%s): random init from the shape "
                            "params instead", p.pretrained, exc)
        return DebertaV2Model(encoder_config(p, self.tokenizer.get_vocab_size(), self.special_ids["pad"]))

    def build_model(self) -> nn.Module:
        p = self.params
        return PriceRegressor(self._text_encoder(), len(NUMERIC_FEATURES), len(self.brands) + 1,
                              len(self.categories) + 1, p.side_dim, p.dropout, p.numeric_features,
                              self.log_price_mean)

    def _objective(self, prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.params.objective == "huber":
            return F.huber_loss(prediction, target, delta=1.0)
        return F.mse_loss(prediction, target)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._objective(model(**_model_inputs(batch)), batch["target"])

    def evaluate(self, model: nn.Module, batches: Iterable[dict[str, torch.Tensor]]) -> dict[str, float]:
        predictions, targets, loss_sum = [], [], 0.0
        for batch in batches:
            prediction = model(**_model_inputs(batch))
            loss_sum += float(self._objective(prediction, batch["target"])) * len(batch["target"])
            predictions.append(prediction.cpu())
            targets.append(batch["target"].cpu())
        pred, true = torch.cat(predictions).double().numpy(), torch.cat(targets).double().numpy()
        price_pred, price_true = np.clip(np.expm1(pred), 0.0, None), np.expm1(true)
        return {"loss": loss_sum / len(true), "smape": smape(price_pred, price_true)}

    def enable_activation_checkpointing(self, model: nn.Module) -> bool:
        encoder = model.text_encoder
        if not getattr(encoder, "supports_gradient_checkpointing", False):
            return False
        kwargs = {"use_reentrant": False}
        if hasattr(encoder, "activation_checkpointing_enable"):  # transformers >= 5: the non-deprecated name
            encoder.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            encoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return True

    # --------------------------------------------------------------------------------- export and predict
    def export(self, model: nn.Module, out_dir: Path) -> None:
        from safetensors.torch import save_model

        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        save_model(model, str(out_dir / "model.safetensors"))
        config = {"recipe": self.name, "params": self.params.model_dump(), "encoder": model.text_encoder.config.to_dict(),
                  "numeric_features": NUMERIC_FEATURES, "brands": self.brands, "categories": self.categories,
                  "special_ids": self.special_ids, "log_price_mean": self.log_price_mean}
        (out_dir / "config.json").write_text(json.dumps(config, indent=1, default=str))
        (out_dir / "tokenizer.json").write_text(self.tokenizer.to_str())

    def predict(self, model: nn.Module, out_dir: Path, **_: Any) -> Path | None:  # its own predict_batch_size, fp32
        if len(self.test_rows) == 0:
            return None
        out_path = Path(out_dir) / "test_out.csv"
        out_path.parent.mkdir(parents=True, exist_ok=True)
        prices = predict_prices(model, self.test_dataset(), self.collate, self.params.predict_batch_size)
        pd.DataFrame({"sample_id": self.sample_id[self.test_rows], "price": prices}).to_csv(out_path, index=False)
        return out_path


@torch.inference_mode()
def predict_prices(model: nn.Module, dataset: Dataset, collate, batch_size: int) -> np.ndarray:
    """Prices (original scale, >= 0) for every item of dataset, in order."""
    was_training, device = model.training, next(model.parameters()).device
    model.eval()
    try:
        outputs = []
        for start in range(0, len(dataset), batch_size):
            batch = collate([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
            inputs = {k: v.to(device, non_blocking=True) for k, v in _model_inputs(batch).items()}
            outputs.append(model(**inputs).cpu())
        return np.clip(np.expm1(torch.cat(outputs).double().numpy()), 0.0, None)
    finally:
        model.train(was_training)


def load_exported(out_dir: Path) -> PriceRegressor:
    """Rebuild the model written by `PriceModelRecipe.export` (no training state, no data needed)."""
    from safetensors.torch import load_model
    from transformers import AutoConfig, AutoModel

    config = json.loads((Path(out_dir) / "config.json").read_text())
    p = PriceModelParams(**config["params"])
    encoder_dict = dict(config["encoder"])
    encoder = AutoModel.from_config(AutoConfig.for_model(encoder_dict.pop("model_type"), **encoder_dict))
    model = PriceRegressor(encoder, len(config["numeric_features"]), len(config["brands"]) + 1,
                           len(config["categories"]) + 1, p.side_dim, p.dropout, p.numeric_features,
                           config["log_price_mean"])
    load_model(model, str(Path(out_dir) / "model.safetensors"))
    return model.eval()
