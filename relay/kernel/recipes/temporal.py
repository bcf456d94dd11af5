"""Temporal regressors (seed 003): LSTM, Transformer and MLP on windows of multi-timeframe features, trained
one after another in one relay, each predicting the forward return over `horizon` bars.

The models are the run's stages (relay.kernel.session.stages): the spec's steps are shared equally between them, each
gets its own AdamW and schedule, and the previous one's optimizer state is dropped and the CUDA cache emptied
when the next begins, so a model never trains beside the memory the last one held. A session may end between two
models or in the middle of one: the stage is a function of the step. Features are computed once into the parquet
feature cache; AMP (fp16 on a T4) falls back to fp32 after non-finite losses (the runtime's guard: fp16's narrow
range can overflow where fp32 does not).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Iterable

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from relay.kernel.recipes import temporal_data
from relay.kernel.recipes.base import Recipe
from relay.kernel.session.features import FeatureCache, source_version
from relay.kernel.session.stages import Stage
from relay.shared.errors import InputError
from relay.shared.params import TemporalParams

FEATURES_VERSION = "1"


# ---------------------------------------------------------------------------------------------------- models
class LSTMRegressor(nn.Module):
    def __init__(self, n_features: int, p: TemporalParams):
        super().__init__()
        self.lstm = nn.LSTM(n_features, p.hidden, p.layers, batch_first=True, dropout=p.dropout if p.layers > 1 else 0)
        self.head = nn.Linear(p.hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1]).squeeze(-1)


class TransformerRegressor(nn.Module):
    def __init__(self, n_features: int, p: TemporalParams):
        super().__init__()
        self.embed = nn.Linear(n_features, p.hidden)
        self.position = nn.Parameter(torch.zeros(1, p.window, p.hidden))
        layer = nn.TransformerEncoderLayer(p.hidden, p.heads, 2 * p.hidden, p.dropout, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, p.layers, enable_nested_tensor=False)
        self.head = nn.Linear(p.hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(x) + self.position[:, : x.shape[1]])
        return self.head(h.mean(1)).squeeze(-1)


class MLPRegressor(nn.Module):
    def __init__(self, n_features: int, p: TemporalParams):
        super().__init__()
        widths = [n_features * p.window] + [p.hidden] * p.layers
        blocks = []
        for a, b in zip(widths, widths[1:]):
            blocks += [nn.Linear(a, b), nn.GELU(), nn.Dropout(p.dropout)]
        self.net = nn.Sequential(nn.Flatten(), *blocks, nn.Linear(widths[-1], 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


MODELS = {"lstm": LSTMRegressor, "transformer": TransformerRegressor, "mlp": MLPRegressor}


# ------------------------------------------------------------------------------------------------------ data
class Windows(Dataset):
    """Item i: the `window` feature rows ending at bar ends[i], and that bar's target (a pure function of i)."""

    def __init__(self, x: np.ndarray, y: np.ndarray, ends: np.ndarray, window: int):
        self.x, self.y, self.ends, self.window = x, y, ends, window

    def __len__(self) -> int:
        return len(self.ends)

    def __getitem__(self, i: int):
        end = int(self.ends[i])
        return self.x[end - self.window + 1: end + 1], self.y[end]


def build_feature_table(path: Path, horizon: int) -> pa.Table:
    feats, target = temporal_data.features(temporal_data.read_bars(path), horizon)
    columns = {name: pa.array(feats[name].to_numpy()) for name in feats.columns}
    columns["target"] = pa.array(target)
    return pa.table(columns)


def feature_version() -> str:
    return f"{FEATURES_VERSION}-" + source_version(temporal_data.read_bars, temporal_data.features, build_feature_table)


# ---------------------------------------------------------------------------------------------------- recipe
class TemporalRecipe(Recipe):
    name = "temporal"
    Params = TemporalParams
    metric = "mse"
    metric_mode = "min"
    params: TemporalParams

    def prepare(self) -> None:
        p = self.params
        path = self.data_dir / p.bars_file
        if not path.is_file():
            raise InputError(f"{path}: file not found (expected a CSV with columns {', '.join(temporal_data.COLUMNS)})")
        self.feature_cache = FeatureCache(self.cache_dirs)
        table = self.feature_cache.get_or_build("temporal_features", [path], {"horizon": p.horizon},
                                                feature_version(), lambda: build_feature_table(path, p.horizon))
        names = [c for c in table.column_names if c != "target"]
        x = np.stack([table.column(c).to_numpy() for c in names], axis=1).astype(np.float32)
        y = table.column("target").to_numpy().astype(np.float32)
        # A window needs full feature history at its first bar; a target needs `horizon` bars after its last.
        first, last = temporal_data.lookback() + p.window - 1, len(y) - p.horizon
        n = last - first
        n_eval = int(round(p.eval_fraction * n))
        # the train targets end `horizon` bars before the first eval window ends: no shared future returns
        train_ends = np.arange(first, first + n - n_eval - p.horizon)
        eval_ends = np.arange(first + n - n_eval, last)
        if len(train_ends) < 1 or len(eval_ends) < 1:
            raise InputError(f"{path}: {len(y)} bars leave {max(0, len(train_ends))} training and "
                             f"{max(0, len(eval_ends))} evaluation windows (window {p.window}, horizon {p.horizon},"
                             f" {temporal_data.lookback()} bars of history); both splits need at least one")
        # Standardise with the training bars only (no look at the evaluation period).
        seen = x[first - p.window + 1: train_ends[-1] + 1]
        mean, std = seen.mean(0), seen.std(0) + 1e-6
        self.x = np.nan_to_num((x - mean) / std).astype(np.float32)
        self.y, self.feature_names, self.norm = y, names, {"mean": mean.tolist(), "std": std.tolist()}
        self._train = Windows(self.x, y, train_ends, p.window)
        self._eval = Windows(self.x, y, eval_ends, p.window)
        self.active = p.models[0]

    def train_dataset(self) -> Dataset:
        return self._train

    def eval_dataset(self) -> Dataset:
        return self._eval

    def collate(self, items):
        xs, ys = zip(*items)
        return {"x": torch.from_numpy(np.stack(xs)), "y": torch.tensor(np.array(ys), dtype=torch.float32)}

    def build_model(self) -> nn.Module:
        return nn.ModuleDict({name: MODELS[name](len(self.feature_names), self.params) for name in self.params.models})

    # -- one stage per model: the contract extension of relay.kernel.session.stages
    def stages(self) -> list[Stage]:
        return [Stage(name, batch_scale=self.params.mlp_batch_scale if name == "mlp" else 1)
                for name in self.params.models]

    def stage_module(self, model: nn.Module, stage: Stage) -> nn.Module:
        return model[stage.name]

    def begin_stage(self, model: nn.Module, stage: Stage) -> None:
        self.active = stage.name

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        return F.mse_loss(model[self.active](batch["x"]).float(), batch["y"])

    def evaluate(self, model: nn.Module, batches: Iterable) -> dict[str, float]:
        """The model being trained: mse, and r2 against predicting the evaluation mean."""
        se, n, ys = 0.0, 0, []
        for b in batches:
            se += float(F.mse_loss(model[self.active](b["x"]).float(), b["y"], reduction="sum"))
            n += len(b["y"])
            ys.append(b["y"].cpu())
        y = torch.cat(ys).double()
        mse = se / n
        return {"loss": mse, "mse": mse, f"mse_{self.active}": mse,
                "r2": 1.0 - mse / max(float(y.var(unbiased=False)), 1e-12)}

    def export(self, model: nn.Module, out_dir: Path) -> None:
        from safetensors.torch import save_model

        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        # On CUDA, cuDNN packs the LSTM's weights into one buffer that safetensors refuses to split; a CPU copy
        # holds each tensor alone (the models are small).
        save_model(copy.deepcopy(model).cpu(), str(out_dir / "model.safetensors"))
        config = {"recipe": self.name, "params": self.params.model_dump(), "features": self.feature_names,
                  "normalisation": self.norm}
        (out_dir / "config.json").write_text(json.dumps(config, indent=1))


def load_exported(out_dir: Path) -> nn.Module:
    from safetensors.torch import load_model

    config = json.loads((Path(out_dir) / "config.json").read_text())
    p = TemporalParams(**config["params"])
    model = nn.ModuleDict({name: MODELS[name](len(config["features"]), p) for name in p.models})
    load_model(model, str(Path(out_dir) / "model.safetensors"))
    return model.eval()

