"""The spec's `tracking:` section: TensorBoard and Weights & Biases across a relay (docs/tracking.md).

Torch-free and Prefect-free: read by the orchestrator (handoff, W&B sync) and by the session runtime.
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class WandbConfig(_Section):
    """One W&B run per relay: its id is kept in the relay's checkpoints, every session resumes it."""

    project: str = Field(min_length=1, description="The W&B project the relay's one run is logged to.")
    entity: Optional[str] = Field(None, description="The W&B entity (user or team); none: the key's default.")
    mode: Literal["auto", "offline", "online"] = Field("auto", description=(
        "`offline`: the session writes an offline run and the orchestrator uploads it with `wandb sync` after"
        " each handoff; `online`: the session logs live (needs `kaggle.enable_internet` and the key as a Kaggle"
        " secret); `auto`: online when `kaggle.enable_internet`, else offline."))
    api_key_block: str = Field("wandb-api-key", pattern=r"^[a-z0-9][a-z0-9-]*$", description=(
        "The Prefect Secret block holding the W&B API key, read by the orchestrator for `wandb sync`; the key"
        " never goes into a kernel, spec or dataset."))
    kaggle_secret: str = Field("WANDB_API_KEY", min_length=1, description=(
        "Online mode: the label of the Kaggle secret (Add-ons > Secrets, attached to the session notebook) the"
        " session reads the key from."))


class TrackingConfig(_Section):
    """Experiment trackers across the relay's sessions: one run each, every step logged once. Optional
    extras: `pip install kaggle-relay[tensorboard]` / `[wandb]`. A tracker error is a warning, never a
    failed session."""

    tensorboard: bool = Field(False, description=(
        "Scalars as TensorBoard event files in the workdir's `tensorboard/`, carried in the checkpoint dataset"
        " and assembled by the orchestrator into one log directory per relay (`<state_dir>/<name>/tensorboard`)."))
    wandb: Optional[WandbConfig] = Field(None, description="One Weights & Biases run for the whole relay.")

    @property
    def enabled(self) -> bool:
        return self.tensorboard or self.wandb is not None
