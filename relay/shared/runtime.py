"""What a session ran on, as its record in progress.json's `sessions` keeps it, and what changed between two.

A relay of several weeks meets Kaggle's image updates (a new torch, a new CUDA) and accelerator swaps. Each
session records `gpus` ({"count", "names"}) and `runtime` ({"python", "torch", "cuda", "image", "image_built"};
the image is the git commit Kaggle's Docker image was built from, None outside Kaggle). The session compares
itself with the session before it (exactness of resume is unproven from the first step that ran elsewhere), and
the orchestrator's session table and notifications say the same, from these functions.
"""
from __future__ import annotations

from typing import Mapping, Optional

from relay.shared.accelerators import describe as describe_gpus

RUNTIME_KEYS = ("python", "torch", "cuda", "image")  # image_built goes with image: not compared on its own
_LABELS = {"python": "Python", "torch": "torch", "cuda": "CUDA", "image": "image"}


def _gpus(record: Mapping) -> Optional[str]:
    inventory = record.get("gpus")
    return describe_gpus(list(inventory.get("names") or [])) if isinstance(inventory, Mapping) else None


def changes(before: Mapping, after: Mapping) -> list[str]:
    """What differs between two session records: ["torch 2.4.0 -> 2.5.1", "GPUs 2 x Tesla T4 -> no GPU"]. Only
    what both recorded is compared (a record written before these keys existed claims no change)."""
    found = []
    old, new = before.get("runtime") or {}, after.get("runtime") or {}
    for key in RUNTIME_KEYS:
        if key in old and key in new and old[key] != new[key]:
            found.append(f"{_LABELS[key]} {old[key] or 'unknown'} -> {new[key] or 'unknown'}")
    gpus_old, gpus_new = _gpus(before), _gpus(after)
    if gpus_old is not None and gpus_new is not None and gpus_old != gpus_new:
        found.append(f"GPUs {gpus_old} -> {gpus_new}")
    return found


def describe(record: Mapping) -> Optional[str]:
    """One table cell: "py 3.11.9, torch 2.5.1, CUDA 12.4, image 1a2b3c4"; None when the session did not record it."""
    runtime = record.get("runtime")
    if not isinstance(runtime, Mapping):
        return None
    parts = [f"py {runtime.get('python')}", f"torch {runtime.get('torch')}"]
    if runtime.get("cuda"):
        parts.append(f"CUDA {runtime['cuda']}")
    if runtime.get("image"):
        parts.append(f"image {str(runtime['image'])[:7]}")
    return ", ".join(parts)
