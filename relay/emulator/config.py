"""Emulator settings: Kaggle's limits as configuration (sources disagree), plus the time scale.

Durations named `*_s` in Kaggle time (session timeout, quota, quota period) are divided by `time_scale` to get
wall-clock seconds, so with time_scale=3600 a 12 h session lasts 12 s. Delays that are about the emulator's
own pacing (dataset processing, queueing, SIGTERM grace) are wall-clock seconds.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Dict, List, Optional

from relay.shared.errors import InputError


@dataclass
class EmulatorConfig:
    time_scale: float = 1.0
    session_timeout_s: float = 12 * 3600          # Kaggle time; a push may ask for less
    gpu_quota_s: float = 30 * 3600                # Kaggle time per quota period
    quota_period_s: float = 7 * 24 * 3600         # Kaggle time
    # the allowance of each quota period in turn (Kaggle time; past the list: gpu_quota_s): Kaggle's weekly GPU
    # allowance varies from week to week ("30 hours or sometimes higher", kaggle-benchmarks #79, kaggle.com/docs)
    gpu_quota_by_period: List[float] = field(default_factory=list)
    max_gpu_sessions: int = 2
    output_cap_bytes: int = 20 * 1000 ** 3
    dataset_processing_delay: float = 0.0         # wall seconds from CreateDataset(Version) to READY
    # and one GetDatasetStatus poll per this many bytes of the version (floor; 0: none): Kaggle's processing time
    # grows with a version's size (its states: kagglesdk datasets/types/dataset_enums.py DatabundleVersionStatus)
    dataset_processing_bytes_per_poll: int = 1 << 20
    # a user's private datasets, every version counted: past it a create or a new version is answered with success
    # and then not kept, the dataset 404s (kaggle-cli #284); the figure is configuration (0: unlimited)
    private_storage_bytes: int = 100 * 1000 ** 3
    queue_delay: float = 0.0                      # wall seconds a pushed kernel stays QUEUED
    sigterm_grace: float = 5.0                    # wall seconds between SIGTERM and SIGKILL
    # where mounts appear under KAGGLE_INPUT_DIR: "flat" = <slug>/ (older images); "nested" = datasets/<owner>/
    # <slug>/ and notebooks/<owner>/<slug>/ for kernel outputs (Kaggle since 2026-08)
    mount_layout: str = "flat"
    timeout_keeps_output: bool = True             # whether a run stopped at the limit keeps /kaggle/working (disputed)
    retry_after: str = "1"                        # Retry-After header sent with an injected 429
    kernel_env: Dict[str, str] = field(default_factory=dict)  # extra environment for kernel processes
    users: Dict[str, str] = field(default_factory=dict)       # username -> key (held only in memory)
    tokens: Dict[str, str] = field(default_factory=dict)      # access token -> username
    faults: Optional[dict] = None                 # see faults.py
    # modules imported once in a zygote that forks each session (warm_zygote.py); empty: a fresh interpreter each
    warm_modules: List[str] = field(default_factory=list)

    def allowance(self, period: int) -> float:
        """The GPU allowance (Kaggle seconds) of quota period `period` (0: the first)."""
        return self.gpu_quota_by_period[period] if period < len(self.gpu_quota_by_period) else self.gpu_quota_s

    def wall(self, kaggle_seconds: float) -> float:
        return kaggle_seconds / self.time_scale

    def validate(self) -> "EmulatorConfig":
        if self.time_scale <= 0:
            raise InputError(f"time_scale {self.time_scale}: must be > 0")
        if self.mount_layout not in ("flat", "nested"):
            raise InputError(f"mount_layout {self.mount_layout!r}: use flat or nested")
        if self.private_storage_bytes < 0:
            raise InputError("private_storage_bytes must be >= 0 (0: unlimited)")
        if self.dataset_processing_bytes_per_poll < 0:
            raise InputError("dataset_processing_bytes_per_poll must be >= 0 (0: no polls)")
        if self.max_gpu_sessions < 0 or self.output_cap_bytes <= 0:
            raise InputError("max_gpu_sessions must be >= 0 and output_cap_bytes > 0")
        for name in ("session_timeout_s", "gpu_quota_s", "quota_period_s"):
            if getattr(self, name) <= 0:
                raise InputError(f"{name}: must be > 0")
        if any(not isinstance(q, (int, float)) or q <= 0 for q in self.gpu_quota_by_period):
            raise InputError(f"gpu_quota_by_period: every allowance must be > 0 (got {self.gpu_quota_by_period!r})")
        return self

    @classmethod
    def from_file(cls, path: Path) -> "EmulatorConfig":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as err:
            raise InputError(f"emulator config {path}: {err}") from None
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise InputError(f"emulator config {path}: unknown settings {sorted(unknown)}")
        return cls(**data).validate()
