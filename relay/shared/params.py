"""Every built-in recipe's `params:`, validated without torch.

The orchestrator (Prefect flows, the GitHub Actions tick) loads and checks specs but never trains, so it must not
pay for importing torch (~250 MB of RSS, seconds of start-up): the handoff's memory goal (bench_handoff) rests on
it. Each recipe module takes its Params class from here; a user recipe (`pkg.module:Class`) brings its own.
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class RecipeParams(BaseModel):
    """Base for each recipe's own validated parameters (the spec's `params:` section)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    # True for a recipe made only of fit stages (closed-form fits, ALS: every Stage has fit=True): a fit sees
    # the whole training set at once, so there is no batch to split over processes and it runs in one process
    # whatever `session.devices: auto` finds. Declared here, without torch, so the spec check and `relay plan`
    # know it; tests check it against the recipe's stages().
    fit_only: ClassVar[bool] = False

    def check_spec(self, spec: Any) -> None:
        """Cross-checks between these params and the rest of the spec (e.g. a curriculum covering optim.epochs).
        Raise ValueError("params.key: what is expected"); the spec loader reports it."""


# --------------------------------------------------------------------------------------------- price_model

class PriceModelParams(RecipeParams):
    """`params:` of a price_model spec. Defaults are the real size (deberta-v3-base shapes)."""

    data_dir: str | None = Field(None, description="folder with the CSVs; the runtime's --data overrides it")
    train_file: str = Field("train.csv", description="train CSV inside data_dir: sample_id, catalog_content, price")
    test_file: str = Field("test.csv", description="test CSV inside data_dir: sample_id, catalog_content (optional)")
    pretrained: str | None = Field(None, description="HF model name or local path, loaded offline when present; "
                                   "otherwise the encoder is built from the shape below with random weights")
    vocab_size: int = Field(128100, ge=16, description="vocabulary cap of the tokenizer trained on train.csv")
    max_len: int = Field(256, ge=8, le=4096, description="tokens per item, [CLS] and [SEP] included")
    hidden_size: int = Field(768, ge=8, description="encoder width")
    num_layers: int = Field(12, ge=1, description="encoder layers")
    num_heads: int = Field(12, ge=1, description="attention heads; must divide hidden_size")
    intermediate_size: int = Field(3072, ge=8, description="feed-forward width")
    dropout: float = Field(0.1, ge=0.0, lt=1.0, description="dropout in the encoder and the head")
    numeric_features: bool = Field(True, description="use parsed quantities and brand/category embeddings")
    side_dim: int = Field(64, ge=4, description="width of the numeric MLP and brand/category embeddings")
    max_brands: int = Field(5000, ge=2, description="brand vocabulary cap (id 0 = unknown)")
    max_categories: int = Field(2000, ge=2, description="category vocabulary cap (id 0 = unknown)")
    eval_fraction: float = Field(0.1, gt=0.0, lt=1.0, description="share of train.csv held out for evaluation")
    eval_seed: int = Field(0, description="seed of the held-out split (independent of the run seed)")
    objective: Literal["mse", "huber"] = Field("mse", description="loss on log1p(price)")
    predict_batch_size: int = Field(16, ge=1, description="batch size of predict()")

    @model_validator(mode="after")
    def _heads_divide_width(self) -> "PriceModelParams":
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        return self


# -------------------------------------------------------------------------------------------- legal_bert

class LegalBertParams(RecipeParams):
    """`params:` of a legal_bert spec. Defaults are the seed's real size (BERT-base shapes, max_length 256)."""

    data_dir: str | None = Field(None, description="folder with the files; the runtime's --data overrides it")
    train_file: str = Field("train.csv", description="CSV (text,label) or JSONL training file inside data_dir")
    val_file: str | None = Field("val.csv", description="validation file; when absent, eval_fraction of train")
    pretrained: str | None = Field(None, description="local folder (or cached HF name) of a BERT checkpoint, "
                                   "e.g. InLegalBERT, loaded offline; otherwise random init from the shape below")
    vocab_size: int = Field(30522, ge=16, description="vocabulary cap of the tokenizer trained on train_file")
    max_length: int = Field(256, ge=8, le=512, description="tokens per sentence, [CLS] and [SEP] included")
    overflow: Literal["error", "truncate"] = Field(
        "error", description="a sentence over max_length: a one-line error naming its line, or cut to fit")
    hidden_size: int = Field(768, ge=8)
    num_layers: int = Field(12, ge=1)
    num_heads: int = Field(12, ge=1)
    intermediate_size: int = Field(3072, ge=8)
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    use_subset: bool = Field(False, description="train on a seeded subset (the seed's quick-run mode)")
    subset_ratio: float = Field(0.2, gt=0.0, le=1.0, description="share of the training rows kept by use_subset")
    eval_fraction: float = Field(0.1, gt=0.0, lt=1.0, description="held out of train_file when val_file is absent")
    eval_seed: int = Field(0, description="seed of the held-out split and of the subset (not the run seed)")

    @model_validator(mode="after")
    def _heads_divide_width(self) -> "LegalBertParams":
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        return self


# ---------------------------------------------------------------------------------------------- temporal

ModelName = Literal["lstm", "transformer", "mlp"]


class TemporalParams(RecipeParams):
    data_dir: str | None = Field(None, description="folder with the bar file; the runtime's --data overrides it")
    bars_file: str = Field("bars.csv", description="CSV: timestamp, close, volume, one row per bar in time order")
    models: list[ModelName] = Field(["lstm", "transformer", "mlp"], description="trained in this order")
    window: int = Field(32, ge=2, description="bars of features each prediction sees")
    horizon: int = Field(5, ge=1, description="the target is the log return over the next `horizon` bars (%)")
    hidden: int = Field(128, ge=4, description="LSTM/Transformer width, MLP hidden width")
    layers: int = Field(2, ge=1, description="LSTM layers, Transformer layers, MLP hidden layers")
    heads: int = Field(4, ge=1, description="Transformer attention heads (must divide hidden)")
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    mlp_batch_scale: int = Field(1, ge=1, description="the MLP stage's micro-batch multiplier (seed: 2, its 512 "
                                 "beside 256); its stage gets 1/k of the steps, so the same samples as the others")
    eval_fraction: float = Field(0.2, gt=0.0, lt=1.0, description="the last share of bars, held out in time order")

    @field_validator("models")
    @classmethod
    def _distinct(cls, value: list[str]) -> list[str]:
        if not value or len(set(value)) != len(value):
            raise ValueError("models: a non-empty list without repeats of lstm, transformer, mlp")
        return value

    @model_validator(mode="after")
    def _heads_divide_width(self) -> "TemporalParams":
        if "transformer" in self.models and self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        return self


# ------------------------------------------------------------------------------------------------ recsys

class RecsysParams(RecipeParams):
    fit_only: ClassVar[bool] = True  # SVD, item-KNN, ALS iterations

    data_dir: str | None = Field(None, description="folder with the ratings; the runtime's --data overrides it")
    ratings_file: str = Field("ratings.csv", description="CSV: userId, movieId, rating[, timestamp]")
    max_users: int | None = Field(5000, ge=1, description="user cap: users beyond it are sampled away (seeded)")
    svd_components: int = Field(30, ge=1)
    knn_neighbors: int = Field(15, ge=1)
    knn_shrinkage: float = Field(0.1, ge=0.0, description="added to the similarity sum of a KNN prediction: one "
                                 "weakly similar rated neighbour no longer sets the whole deviation from the user mean")
    knn_user_batch: int = Field(500, ge=1, description="users per batch of the similarity accumulation")
    gpu_max_elements: int = Field(10_000_000, ge=0, description="similarity on the GPU only below users x items")
    als_factors: int = Field(30, ge=1)
    als_reg: float = Field(0.1, gt=0.0, description="L2 regularisation of the ALS least squares")
    als_chunk_nnz: int = Field(50_000, ge=1000, description="ratings per chunk of the ALS normal equations")
    eval_fraction: float = Field(0.2, gt=0.0, lt=1.0, description="share of ratings held out for RMSE/precision")
    eval_users: int = Field(1000, ge=1, description="users sampled for precision@k")
    precision_k: int = Field(10, ge=1)
    relevant_rating: float = Field(4.0, description="held-out ratings at least this are relevant for precision@k")
    sample_seed: int = Field(0, description="seed of the user cap, the held-out split and the precision users")


# --------------------------------------------------------------------------------------------------- toy

class ToyParams(RecipeParams):
    n_train: int = Field(512, ge=16)
    n_eval: int = Field(128, ge=8)
    features: int = Field(16, ge=1)
    hidden: int = Field(64, ge=1)
    dropout: float = Field(0.1, ge=0.0, lt=1.0)


# ------------------------------------------------------------------------------------------- vqa_student

class LossWeights(RecipeParams):
    ce: float = Field(1.0, ge=0.0, description="cross-entropy on the teacher's answer")
    soft: float = Field(0.0, ge=0.0, description="KL to the teacher's soft targets, where it gave logits")


class Stage(RecipeParams):
    name: str = Field(min_length=1)
    epochs: list[int] = Field(description="[first, end): the epochs this stage trains, end exclusive")
    loss_weights: LossWeights = LossWeights()
    answer_max_len: int = Field(ge=2, description="answer tokens trained on (EOS included)")
    filter: Literal["all", "short_answer", "has_logits"] = "all"


class VQAStudentParams(RecipeParams):
    data_dir: Optional[str] = None
    images_dir: str = "images"
    questions_file: str = "questions.jsonl"
    teacher_file: str = "teacher_outputs.jsonl"
    # Mounted pretrained folders (save_pretrained layout); each replaces the random-init model built below.
    vision_pretrained: Optional[str] = None
    question_pretrained: Optional[str] = None  # model + tokenizer (e.g. PhoBERT)
    decoder_pretrained: Optional[str] = None  # T5 model + tokenizer (e.g. VietT5)
    vision_model: Literal["vit", "blip"] = "vit"
    image_size: int = Field(384, ge=8)
    patch_size: int = Field(16, ge=2)
    vision_hidden: int = Field(768, ge=8)
    vision_layers: int = Field(12, ge=1)
    vision_heads: int = Field(12, ge=1)
    question_model: Literal["bert", "roberta"] = "roberta"
    text_hidden: int = Field(768, ge=8)
    text_layers: int = Field(12, ge=1)
    text_heads: int = Field(12, ge=1)
    question_max_len: int = Field(64, ge=4, description="question tokens incl. specials; longer is an error")
    d_model: int = Field(768, ge=8)
    d_kv: int = Field(64, ge=4)
    d_ff: int = Field(3072, ge=8)
    decoder_layers: int = Field(12, ge=1)
    decoder_heads: int = Field(12, ge=1)
    fusion_layers: int = Field(0, ge=0, description="Transformer encoder layers (d_model wide, d_ff feed-forward) "
                               "over the concatenated image + question states; 0: concatenation only")
    fusion_heads: int = Field(8, ge=1)
    vocab_size: int = Field(32000, ge=16, description="cap of the tokenizer trained on the data")
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    answer_max_len: int = Field(160, ge=2, description="longest answer trained on or generated (EOS included)")
    num_beams: int = Field(4, ge=1)
    soft_top_k: int = Field(4, ge=1)
    soft_temperature: float = Field(2.0, gt=0.0)
    curriculum: list[Stage] = Field(min_length=1)
    # The VQA student's OOM ladder after the micro-batch rung (docs/recipes.md): answer length, beams, eval chunk.
    oom_answer_max_len: int = Field(128, ge=2)
    oom_num_beams: int = Field(3, ge=1)
    oom_eval_batch: int = Field(2, ge=1)

    @field_validator("curriculum")
    @classmethod
    def _contiguous(cls, stages: list[Stage]) -> list[Stage]:
        end = 0
        for i, s in enumerate(stages):
            if len(s.epochs) != 2 or s.epochs[0] >= s.epochs[1]:
                raise ValueError(f"stage {i} ({s.name}): epochs must be [first, end) with first < end (got {s.epochs})")
            if s.epochs[0] != end:
                kind = "a gap" if s.epochs[0] > end else "an overlap"
                raise ValueError(f"stage {i} ({s.name}) starts at epoch {s.epochs[0]} but the stages before end at "
                                 f"{end}: {kind}; stages must be contiguous from epoch 0")
            end = s.epochs[1]
        return stages

    @model_validator(mode="after")
    def _stage_lengths(self) -> "VQAStudentParams":
        for i, s in enumerate(self.curriculum):
            if s.answer_max_len > self.answer_max_len:
                raise ValueError(f"params.curriculum.{i}.answer_max_len: {s.answer_max_len} is longer than "
                                 f"params.answer_max_len ({self.answer_max_len})")
        if self.fusion_layers and self.d_model % self.fusion_heads:
            raise ValueError(f"params.fusion_heads: {self.fusion_heads} does not divide params.d_model ({self.d_model})")
        return self

    def check_spec(self, spec: Any) -> None:
        if spec.optim.epochs is None:
            raise ValueError("optim.epochs: the vqa_student curriculum is in epochs: set optim.epochs, not max_steps")
        end = self.curriculum[-1].epochs[1]
        if end != spec.optim.epochs:
            raise ValueError(f"params.curriculum: the stages end at epoch {end} but optim.epochs is "
                             f"{spec.optim.epochs}: they must cover the run exactly")


# The spec's `recipe:` name -> its Params: all a spec needs to validate a built-in recipe without importing it
# (the recipes themselves, with torch, are relay.kernel.recipes)
BUILT_IN: dict[str, type[RecipeParams]] = {
    "legal_bert": LegalBertParams, "price_model": PriceModelParams, "recsys": RecsysParams,
    "temporal": TemporalParams, "toy": ToyParams, "vqa_student": VQAStudentParams,
}
