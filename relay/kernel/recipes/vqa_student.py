"""VQA student (seed 002): a ViT/BLIP-vision encoder and a BERT/RoBERTa question encoder (PhoBERT's shape),
projected and concatenated as the encoder states of a T5 decoder that generates the answer, distilled from a
teacher's answers (cross-entropy, plus soft targets where the teacher gave logits), trained in curriculum stages.

The stage is a pure function of the optimizer step (via its epoch), so a stage change can fall anywhere in a
session or exactly at its boundary and still resume bit-identically. A stage's data filter masks the loss of
the samples outside it: the data order stays the runtime's, and collate (which may run in worker processes)
never depends on the stage.
"""
from __future__ import annotations

import json
import logging
import re
from collections import Counter
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterable, Iterator, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from relay.kernel.recipes import vqa_data
from relay.kernel.recipes.base import MemoryRung, Recipe
from relay.kernel.recipes.vqa_model import VQAStudent, build_student, enable_decoder_checkpointing, train_tokenizer
from relay.shared import atomic
from relay.shared.errors import InputError
from relay.shared.params import Stage, VQAStudentParams

log = logging.getLogger(__name__)

FILTERS = ("all", "short_answer", "has_logits")  # which samples a stage trains on (the rest are masked)
NO_LOGIT = -1e4  # padding of the teacher's top-k logits (finite: -inf would make NaN in fp16)


class VQARows(Dataset):
    """Item i is a pure function of i: the image read from disk, ids tokenized in prepare()."""

    def __init__(self, recipe: "VQAStudentRecipe", rows: list[int]):
        self.recipe, self.rows = recipe, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        r, rec = self.rows[i], self.recipe
        s = rec.samples[r]
        return {"row": r, "pixel_values": vqa_data.pixel_values(s.image, rec.params.image_size, rec.image_mean,
                                                                   rec.image_std),
                "question_ids": rec.question_ids[r], "answer_ids": rec.answer_ids[r], "soft": rec.soft[r]}


def normalize(text: str) -> list[str]:
    return re.sub(r"[^\w\s]", " ", text.lower()).split()


def token_f1(pred: str, ref: str) -> float:
    p, r = normalize(pred), normalize(ref)
    common = sum((Counter(p) & Counter(r)).values())
    if not p or not r:
        return float(p == r)
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(r)
    return 2 * precision * recall / (precision + recall)


class VQAStudentRecipe(Recipe):
    name = "vqa_student"
    Params = VQAStudentParams
    metric = "f1"
    metric_mode = "max"
    params: VQAStudentParams
    preflight_eval = True  # eval generates with beams at answer length: it can outgrow a training step

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stage: Stage = self.params.curriculum[0]
        # OOM rungs taken (set by memory_rungs' apply, re-applied by the runtime in later sessions)
        self.answer_cap = self.params.answer_max_len
        self.beams = self.params.num_beams
        self.eval_chunk: Optional[int] = None
        self._full_generate = False  # the pre-flight generates to the full length (no early EOS)
        self.image_mean, self.image_std = vqa_data.IMAGE_MEAN, vqa_data.IMAGE_STD  # prepare() reads a folder's


    # ------------------------------------------------------------------------------------------- data
    def prepare(self) -> None:
        p = self.params
        for key in ("vision_pretrained", "question_pretrained", "decoder_pretrained"):
            _mounted(getattr(p, key), key)  # a missing mount fails before any data is read
        if p.vision_pretrained:  # its own normalization; image/patch size checked here, not in the pre-flight
            self.image_mean, self.image_std = vqa_data.vision_preprocessing(p.vision_pretrained, p.image_size,
                                                                            p.patch_size)
        self.samples = vqa_data.load(self.data_dir, p.images_dir, p.questions_file, p.teacher_file)
        q_tok, a_tok = self._tokenizers()
        self.q_tokenizer, self.a_tokenizer = q_tok, a_tok
        q_path = self.data_dir / p.questions_file
        self.question_ids, self.answer_ids, self.soft = [], [], []
        self._word_tokens: dict[str, list[int]] = {}  # teacher candidate word -> student token ids
        cls_id, sep_id = q_tok.cls_token_id, q_tok.sep_token_id
        eos = a_tok.eos_token_id
        for s in self.samples:
            ids = [cls_id, *q_tok(s.question, add_special_tokens=False)["input_ids"], sep_id]
            if len(ids) > p.question_max_len:
                raise InputError(f"{q_path}:{s.line}: question is {len(ids)} tokens, longer than "
                                 f"params.question_max_len ({p.question_max_len})")
            self.question_ids.append(np.asarray(ids, dtype=np.int64))
            target = s.teacher if s.split == "train" else (s.answer or s.teacher or "")
            a_ids = a_tok(target, add_special_tokens=False)["input_ids"][: p.answer_max_len - 1] + [eos]
            self.answer_ids.append(np.asarray(a_ids, dtype=np.int64))
            self.soft.append(self._soft_targets(s.teacher_logits, a_tok, first_tokens(target, a_tok), len(a_ids))
                             if s.split == "train" else None)
        by_split = {k: [i for i, s in enumerate(self.samples) if s.split == k] for k in vqa_data.SPLITS}
        if not by_split["train"] or not by_split["val"]:
            raise InputError(f"{q_path}: needs train and val questions (got {len(by_split['train'])} train, "
                             f"{len(by_split['val'])} val)")
        self.train_rows, self.val_rows, self.test_rows = by_split["train"], by_split["val"], by_split["test"]

    def _tokenizers(self):
        from transformers import AutoTokenizer

        p = self.params
        pretrained = {k: _mounted(getattr(p, k), k) for k in ("question_pretrained", "decoder_pretrained")}
        q = AutoTokenizer.from_pretrained(pretrained["question_pretrained"]) if pretrained["question_pretrained"] else None
        a = AutoTokenizer.from_pretrained(pretrained["decoder_pretrained"]) if pretrained["decoder_pretrained"] else None
        if q is None or a is None:
            texts = [s.question for s in self.samples] + [t for s in self.samples for t in (s.teacher, s.answer) if t]
            trained = train_tokenizer(texts, p.vocab_size)
            q, a = q or trained, a or trained
        return q, a

    def _soft_targets(self, logits: Optional[list], tok, firsts: list[Optional[int]],
                      n_tokens: int) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """The teacher's top-k as (ids, logits) arrays of shape (answer tokens, k): each word's candidates at
        the word's first token (a word of several tokens, "red." or a sub-word split, would otherwise shift
        every later word), no target on the other tokens; candidates that are not one student token are
        left out."""
        if not logits:
            return None
        k, token_of = self.params.soft_top_k, self._word_tokens
        ids = np.zeros((n_tokens, k), dtype=np.int64)
        values = np.full((n_tokens, k), NO_LOGIT, dtype=np.float32)
        for w, candidates in enumerate(logits):
            pos = firsts[w] if w < len(firsts) else None
            if pos is None or pos >= n_tokens - 1:  # a word truncated away (the last token is EOS)
                continue
            best = sorted(candidates.items(), key=lambda kv: (-kv[1], kv[0]))
            j = 0
            for word, logit in best:
                if word not in token_of:
                    token_of[word] = tok(word, add_special_tokens=False)["input_ids"]
                token = token_of[word]
                if len(token) == 1 and j < k:
                    ids[pos, j], values[pos, j], j = token[0], logit, j + 1
        return ids, values

    def train_dataset(self) -> Dataset:
        return VQARows(self, self.train_rows)

    def eval_dataset(self) -> Dataset:
        return VQARows(self, self.val_rows)

    def collate(self, items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        n, k = len(items), self.params.soft_top_k
        q_len = max(len(it["question_ids"]) for it in items)
        a_len = max(len(it["answer_ids"]) for it in items)
        question = np.full((n, q_len), self.q_tokenizer.pad_token_id, dtype=np.int64)
        labels = np.full((n, a_len), -100, dtype=np.int64)
        soft_ids = np.zeros((n, a_len, k), dtype=np.int64)
        soft_logits = np.full((n, a_len, k), NO_LOGIT, dtype=np.float32)
        for row, it in enumerate(items):
            question[row, : len(it["question_ids"])] = it["question_ids"]
            labels[row, : len(it["answer_ids"])] = it["answer_ids"]
            if it["soft"] is not None:
                ids, values = it["soft"]
                m = min(len(ids), a_len)
                soft_ids[row, :m], soft_logits[row, :m] = ids[:m], values[:m]
        return {
            "row": torch.tensor([it["row"] for it in items]),
            "pixel_values": torch.from_numpy(np.stack([it["pixel_values"] for it in items])),
            "question_ids": torch.from_numpy(question),
            "question_mask": torch.from_numpy((question != self.q_tokenizer.pad_token_id).astype(np.int64)),
            "labels": torch.from_numpy(labels),
            "answer_len": torch.tensor([len(it["answer_ids"]) for it in items]),
            "has_soft": torch.tensor([it["soft"] is not None for it in items]),
            "soft_ids": torch.from_numpy(soft_ids),
            "soft_logits": torch.from_numpy(soft_logits),
        }

    # ------------------------------------------------------------------------------------------ model
    def build_model(self) -> nn.Module:
        p = self.params
        return build_student(p, self.q_tokenizer, self.a_tokenizer,
                             {k: _mounted(getattr(p, k), k) for k in
                              ("vision_pretrained", "question_pretrained", "decoder_pretrained")})

    def enable_activation_checkpointing(self, model: nn.Module) -> bool:
        return enable_decoder_checkpointing(model)

    # ----------------------------------------------------------------------------- curriculum and OOM
    def stage_at(self, epoch: int) -> Stage:
        for stage in self.params.curriculum:
            if stage.epochs[0] <= epoch < stage.epochs[1]:
                return stage
        return self.params.curriculum[-1]  # the dropped tail of a max_steps run cannot reach here (epochs only)

    def on_step(self, step: int, epoch: int) -> dict[str, Any]:
        self.stage = self.stage_at(epoch)
        return {"stage": self.stage.name}

    def memory_rungs(self) -> list[MemoryRung]:
        p = self.params

        def shorter_answers() -> str:
            self.answer_cap = min(self.answer_cap, p.oom_answer_max_len)
            return f"answer length capped at {self.answer_cap} tokens"

        def fewer_beams() -> str:
            self.beams = min(self.beams, p.oom_num_beams)
            return f"{self.beams} beams for evaluation"

        def smaller_eval_batch() -> str:
            self.eval_chunk = p.oom_eval_batch
            return f"evaluation in chunks of {self.eval_chunk}"

        return [MemoryRung("answer_len", frozenset({"train", "eval"}), shorter_answers),
                MemoryRung("num_beams", frozenset({"eval"}), fewer_beams),
                MemoryRung("eval_batch", frozenset({"eval"}), smaller_eval_batch)]

    @contextmanager
    def worst_case(self, items: list[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
        """Questions at question_max_len, answers at the longest stage's length (capped by an OOM rung taken),
        that stage's loss, and generation to the full length: the seed checked memory with the LONGEST answers."""
        p, stage = self.params, self.stage
        longest = max(p.curriculum, key=lambda s: (s.answer_max_len, s.loss_weights.soft > 0))
        length = min(longest.answer_max_len, self.answer_cap)

        def stretch(ids: np.ndarray, n: int, head: int, tail: int) -> np.ndarray:  # keeps the special tokens
            body = ids[head: len(ids) - tail] if len(ids) > head + tail else ids[:1]
            return np.concatenate([ids[:head], np.resize(body, n - head - tail), ids[len(ids) - tail:]])

        self.stage, self._full_generate = longest, True
        try:
            yield [{**it, "question_ids": stretch(it["question_ids"], p.question_max_len, 1, 1),
                    "answer_ids": stretch(it["answer_ids"], length, 0, 1)} for it in items]
        finally:
            self.stage, self._full_generate = stage, False

    # ------------------------------------------------------------------------------------------- loss
    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        stage = self.stage
        length = min(stage.answer_max_len, self.answer_cap)
        labels = batch["labels"][:, :length]
        logits = model(batch["pixel_values"], batch["question_ids"], batch["question_mask"], labels).float()
        valid = labels != -100
        ce = F.cross_entropy(logits.transpose(1, 2), labels.clamp(min=0), reduction="none")
        per_sample = stage.loss_weights.ce * (ce * valid).sum(1) / valid.sum(1).clamp(min=1)
        if stage.loss_weights.soft:
            per_sample = per_sample + stage.loss_weights.soft * self._soft_loss(logits, batch, valid, length)
        keep = self._filter(batch, length).float()
        return (per_sample * keep).sum() / keep.sum().clamp(min=1.0)

    def _soft_loss(self, logits: torch.Tensor, batch: dict, valid: torch.Tensor, length: int) -> torch.Tensor:
        """Cross-entropy to the teacher's temperature-softened top-k distribution (x T^2, as Hinton et al.)."""
        t = self.params.soft_temperature
        ids, teacher = batch["soft_ids"][:, :length], batch["soft_logits"][:, :length].float()
        student = F.log_softmax(logits / t, dim=-1).gather(-1, ids)
        per_pos = -(F.softmax(teacher / t, dim=-1) * student).sum(-1) * t * t
        pos = valid & (teacher[..., 0] > NO_LOGIT / 2) & batch["has_soft"][:, None]
        return (per_pos * pos).sum(1) / pos.sum(1).clamp(min=1)

    def _filter(self, batch: dict, length: int) -> torch.Tensor:
        f = self.stage.filter
        if f == "short_answer":
            return batch["answer_len"] <= length
        if f == "has_logits":
            return batch["has_soft"]
        return torch.ones_like(batch["has_soft"])

    # ------------------------------------------------------------------------------------------- eval
    def generate(self, model: VQAStudent, batch: dict[str, torch.Tensor]) -> list[str]:
        max_len = min(self.stage.answer_max_len, self.answer_cap)
        out = model.generate(batch["pixel_values"], batch["question_ids"], batch["question_mask"],
                             num_beams=self.beams, max_new_tokens=max_len,
                             min_new_tokens=max_len if self._full_generate else 0)
        return self.a_tokenizer.batch_decode(out, skip_special_tokens=True)

    def _chunks(self, batches: Iterable[dict[str, torch.Tensor]]):
        for batch in batches:
            n, step = len(batch["row"]), self.eval_chunk or len(batch["row"])
            for i in range(0, n, step):
                yield {k: v[i: i + step] for k, v in batch.items()}

    def evaluate(self, model: nn.Module, batches: Iterable[dict[str, torch.Tensor]]) -> dict[str, float]:
        """Teacher-forced loss on the full reference answer, and exact match / token F1 of generated answers."""
        loss_sum, em, f1, n = 0.0, 0.0, 0.0, 0
        for batch in self._chunks(batches):
            labels = batch["labels"][:, : self.answer_cap]
            logits = model(batch["pixel_values"], batch["question_ids"], batch["question_mask"], labels).float()
            # the mean by hand: cross_entropy's own over a (batch, vocab, length) input adds across CUDA blocks with
            # atomics, so the same eval came out 1 ulp apart in two processes (an exact resume compares it too)
            ce = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
            loss_sum += float(ce.sum() / (labels != -100).sum()) * len(labels)
            for row, pred in zip(batch["row"].tolist(), self.generate(model, batch)):
                ref = self.reference(row)
                em += float(normalize(pred) == normalize(ref))
                f1 += token_f1(pred, ref)
            n += len(labels)
        return {"loss": loss_sum / n, "exact_match": em / n, "f1": f1 / n}

    def reference(self, row: int) -> str:
        s = self.samples[row]
        return s.answer or s.teacher or ""

    # ------------------------------------------------------------------------------- export, predict
    def export(self, model: nn.Module, out_dir: Path) -> None:
        from safetensors.torch import save_model

        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        save_model(model, str(out_dir / "model.safetensors"))  # save_model: T5 ties its embeddings
        for part in ("vision", "question", "decoder"):
            getattr(model, part).config.save_pretrained(out_dir / part)
        self.q_tokenizer.save_pretrained(out_dir / "question_tokenizer")
        self.a_tokenizer.save_pretrained(out_dir / "answer_tokenizer")
        (out_dir / "config.json").write_text(json.dumps(
            {"recipe": self.name, "params": self.params.model_dump(), "answer_cap": self.answer_cap,
             "num_beams": self.beams, "image_mean": list(self.image_mean), "image_std": list(self.image_std)}, indent=1, default=str))

    @torch.inference_mode()
    def predict(self, model: nn.Module, out_dir: Path, *, batch_size: Optional[int] = None,
                autocast: Callable[[], ContextManager] = nullcontext) -> Path:
        """predictions.jsonl: generated answers for the val and test questions, at the eval batch (or the OOM
        rung's smaller chunk) and precision that evaluation ran at; written atomically (a crash leaves none)."""
        was_training, device = model.training, next(model.parameters()).device
        model.eval()
        self.stage = self.params.curriculum[-1]
        rows = self.val_rows + self.test_rows
        dataset, step = VQARows(self, rows), min(filter(None, (self.eval_chunk, batch_size, 8)))
        lines = []
        try:
            for start in range(0, len(rows), step):
                batch = self.collate([dataset[i] for i in range(start, min(start + step, len(rows)))])
                batch = {k: v.to(device) for k, v in batch.items()}
                with autocast():
                    preds = self.generate(model, batch)
                for row, pred in zip(batch["row"].tolist(), preds):
                    s = self.samples[row]
                    lines.append(json.dumps({"id": s.id, "split": s.split, "question": s.question,
                                             "prediction": pred, "reference": s.answer}) + "\n")
        finally:
            model.train(was_training)
        out_path = Path(out_dir) / "predictions.jsonl"
        atomic.write_bytes(out_path, "".join(lines).encode())
        return out_path


def first_tokens(text: str, tok) -> list[Optional[int]]:
    """The index of each whitespace-separated word's first token in tok(text) (None for a word that made no
    token): the teacher's logits are per word, the student's positions per token."""
    spans = [m.span() for m in re.finditer(r"\S+", text)]
    if tok.is_fast:
        offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        # the first token overlapping the word (a bare "▁" token has an empty span and is skipped)
        return [next((i for i, (a, b) in enumerate(offsets) if a < end and b > start), None) for start, end in spans]
    firsts, n = [], 0  # slow tokenizers have no offsets: count each word's tokens
    for start, end in spans:
        count = len(tok(text[start:end], add_special_tokens=False)["input_ids"])
        firsts.append(n if count else None)
        n += count
    return firsts


def _mounted(path: Optional[str], key: str) -> Optional[str]:
    if path is None:
        return None
    if not Path(path).is_dir():
        raise InputError(f"params.{key}: {path} is not a folder (expected a save_pretrained folder, e.g. a "
                         f"mounted Kaggle dataset)")
    return path
