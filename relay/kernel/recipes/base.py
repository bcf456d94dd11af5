"""The contract between the session runtime and a workload.

A recipe knows its data, its model and its metric; the runtime knows time, state and hardware.
The runtime never looks inside a batch: it moves every tensor in the dict to the device and hands it
back to `loss` / `evaluate`. Datasets are map-style and deterministic (item i is a pure function of i
and the prepared features), so the data position is a pure function of the optimizer step.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, ContextManager, Iterable, Iterator, Optional

import torch
from torch import nn
from torch.utils.data import Dataset

from relay.shared.params import RecipeParams  # noqa: F401  (re-exported: user recipes import it here)
from relay.kernel.session.stages import Stage


@dataclass(frozen=True)
class MemoryRung:
    """One step down a recipe's OOM ladder: `apply()` lowers a setting for the rest of the run and returns a
    description for the log. `phases` says which out-of-memory errors it can help ("train", "eval")."""

    name: str
    phases: frozenset
    apply: Callable[[], str]


class Recipe(ABC):
    """One workload. Built once per session: `Recipe(params, data_dir=..., cache_dir=..., seed=...)`."""

    name: ClassVar[str]
    Params: ClassVar[type[RecipeParams]]
    # The metric `evaluate` returns that people watch, and whether lower is better.
    metric: ClassVar[str] = "loss"
    metric_mode: ClassVar[str] = "min"

    def __init__(self, params: RecipeParams, *, data_dir: Path, cache_dirs: list[Path], seed: int):
        self.params = params
        self.data_dir = Path(data_dir)
        # First entry is writable (the session's own cache); later ones are read-only mounts
        # (a features dataset published by the orchestrator) that are used when they hit.
        self.cache_dirs = [Path(p) for p in cache_dirs]
        self.seed = seed

    @abstractmethod
    def prepare(self) -> None:
        """Load raw data and build (or load from the feature cache) everything the datasets need."""

    @abstractmethod
    def train_dataset(self) -> Dataset: ...

    @abstractmethod
    def eval_dataset(self) -> Dataset: ...

    @abstractmethod
    def collate(self, items: list[Any]) -> dict[str, torch.Tensor]: ...

    @abstractmethod
    def build_model(self) -> nn.Module:
        """A model from config with random weights (the runtime seeds torch before calling)."""

    @abstractmethod
    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean loss of one micro-batch (the runtime divides by the accumulation count)."""

    @abstractmethod
    def evaluate(self, model: nn.Module, batches: Iterable[dict[str, torch.Tensor]]) -> dict[str, float]:
        """Metrics over the eval set; must include `loss` and `self.metric`. Called under no_grad/eval()."""

    # -- stages: several models one after another, or fits that are not gradient descent (relay.kernel.session.stages)
    def stages(self) -> list[Stage]:
        """The run's stages in order; the default is one gradient-trained stage over all of the model."""
        return [Stage("train")]

    def stage_module(self, model: nn.Module, stage: Stage) -> nn.Module:
        """The part of the model a gradient stage trains (its optimizer holds only these parameters)."""
        return model

    def begin_stage(self, model: nn.Module, stage: Stage) -> None:
        """Called when a stage starts or a session resumes inside it (e.g. to note which model `evaluate` scores)."""

    def fit_step(self, model: nn.Module, stage: Stage, step: int) -> float:
        """One step of a `fit` stage (step counts from 0 within the stage), under no_grad; returns a loss to log.
        All it changes must live in the model's parameters/buffers, so the checkpoint carries it."""
        raise NotImplementedError(f"recipe {self.name}: stage {stage.name} is a fit stage without fit_step")

    def enable_activation_checkpointing(self, model: nn.Module) -> bool:
        """Turn on activation checkpointing where the model supports it; return whether it did."""
        return False

    def on_step(self, step: int, epoch: int) -> Optional[dict[str, Any]]:
        """Called before every optimizer step (and the pre-flight) with the step about to be taken. Anything
        the recipe changes here must be a pure function of (step, epoch), so a resumed session lands on the
        same state. Returns what to show (e.g. {"stage": name}); the runtime logs every change."""
        return None

    # Whether the pre-flight also runs `evaluate` on one eval batch (evals that generate can outgrow training).
    preflight_eval: ClassVar[bool] = False

    @contextmanager
    def worst_case(self, items: list[Any]) -> Iterator[list[Any]]:
        """The pre-flight's inputs: `items` made as large as any step of the run will feed them (longest
        inputs, most demanding stage), with whatever recipe state makes loss/evaluate take that path,
        restored on exit. The default: the items as they are."""
        yield items

    def memory_rungs(self) -> list["MemoryRung"]:
        """Extra out-of-memory fallbacks, tried in order after the runtime's own micro-batch halving is
        exhausted. Taken rungs are recorded in the checkpoint and re-applied in every later session."""
        return []

    def export(self, model: nn.Module, out_dir: Path) -> None:
        """Write weights-only inference files (safetensors + config) into out_dir."""
        from safetensors.torch import save_model

        out_dir.mkdir(parents=True, exist_ok=True)
        save_model(model, str(out_dir / "model.safetensors"))

    def predict(self, model: nn.Module, out_dir: Path, *, batch_size: Optional[int] = None,
                autocast: Callable[[], ContextManager] = nullcontext) -> Path | None:
        """Run inference on the test split, write the recipe's submission file, return its path. The runtime
        passes the run's eval batch and its autocast (the precision the model was trained and evaluated in)."""
        return None
