"""A user recipe: the relay's own loop (OOM back-off, eval, best checkpoint, exact resume) on your model.

Name it in the spec as `recipe: mypkg.recipes:ClassifyRecipe` with `code: {folder: .}`; its Params validate
the spec's `params:` exactly as the built-in recipes' do.
"""
from __future__ import annotations

from typing import Iterable

import torch
from pydantic import Field
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from relay import Recipe, RecipeParams


class ClassifyParams(RecipeParams):
    n_train: int = Field(512, ge=32)
    n_eval: int = Field(128, ge=16)
    classes: int = Field(4, ge=2)
    hidden: int = Field(64, ge=4)


class ClassifyRecipe(Recipe):
    name = "classify"
    Params = ClassifyParams
    metric = "accuracy"
    metric_mode = "max"

    def prepare(self) -> None:
        p = self.params
        g = torch.Generator().manual_seed(self.seed)
        x = torch.randn(p.n_train + p.n_eval, 8, generator=g)
        y = (x @ torch.randn(8, p.classes, generator=g)).argmax(1)
        self._train = TensorDataset(x[: p.n_train], y[: p.n_train])
        self._eval = TensorDataset(x[p.n_train:], y[p.n_train:])

    def train_dataset(self) -> Dataset:
        return self._train

    def eval_dataset(self) -> Dataset:
        return self._eval

    def collate(self, items):
        xs, ys = zip(*items)
        return {"x": torch.stack(xs), "y": torch.stack(ys)}

    def build_model(self) -> nn.Module:
        p = self.params
        return nn.Sequential(nn.Linear(8, p.hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(p.hidden, p.classes))

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        return nn.functional.cross_entropy(model(batch["x"]).float(), batch["y"])

    def evaluate(self, model: nn.Module, batches: Iterable) -> dict[str, float]:
        loss, correct, n = 0.0, 0, 0
        for b in batches:
            logits = model(b["x"]).float()
            loss += nn.functional.cross_entropy(logits, b["y"], reduction="sum").item()
            correct += int((logits.argmax(1) == b["y"]).sum())
            n += len(b["y"])
        return {"loss": loss / n, "accuracy": correct / n}
