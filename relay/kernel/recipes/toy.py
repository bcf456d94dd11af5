"""A small MLP regression with dropout on generated data: fast enough to start a hundred processes in a test.

It exercises everything the runtime promises (dropout RNG, AdamW, schedule, accumulation, eval, best
metric) without transformers, so exact-resume tests can kill and restart sessions many times.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from relay.kernel.recipes.base import Recipe
from relay.shared.params import ToyParams


class ToyRecipe(Recipe):
    name = "toy"
    Params = ToyParams
    metric = "mse"
    metric_mode = "min"

    def prepare(self) -> None:
        p = self.params
        g = torch.Generator().manual_seed(self.seed)
        x = torch.randn(p.n_train + p.n_eval, p.features, generator=g)
        w = torch.randn(p.features, 1, generator=g)
        y = torch.sin(x @ w) + 0.1 * torch.randn(len(x), 1, generator=g)
        self._train = TensorDataset(x[: p.n_train], y[: p.n_train])
        self._eval = TensorDataset(x[p.n_train :], y[p.n_train :])

    def train_dataset(self) -> Dataset:
        return self._train

    def eval_dataset(self) -> Dataset:
        return self._eval

    def collate(self, items):
        xs, ys = zip(*items)
        return {"x": torch.stack(xs), "y": torch.stack(ys)}

    def build_model(self) -> nn.Module:
        p = self.params
        return nn.Sequential(nn.Linear(p.features, p.hidden), nn.GELU(), nn.Dropout(p.dropout),
                             nn.Linear(p.hidden, p.hidden), nn.GELU(), nn.Dropout(p.dropout),
                             nn.Linear(p.hidden, 1))

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        return nn.functional.mse_loss(model(batch["x"]).float(), batch["y"])

    def evaluate(self, model: nn.Module, batches: Iterable) -> dict[str, float]:
        total, n = 0.0, 0
        for b in batches:
            total += nn.functional.mse_loss(model(b["x"]).float(), b["y"], reduction="sum").item()
            n += len(b["y"])
        return {"loss": total / n, "mse": total / n}
