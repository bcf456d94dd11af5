"""What a background save writes: a copy of the state in host buffers kept from one save to the next.

A periodic save used to make training wait for torch.save itself (serializing every tensor into the page cache,
~2 GB/s here); the commit after it already ran on a thread. Now training waits only for this copy (a memcpy into
buffers that stay resident, or a device-to-host copy), and torch.save of the copy runs on the commit's thread
too, as torchtitan's async checkpointing stages to CPU first. The buffers are reused because one save is in flight
at a time (CheckpointWriter waits for the last one first), and because freshly allocated pages cost more than the
copy on a VM (bench/bench_checkpoint.py). Cost: host memory for one more copy of the saved state.

Bit for bit the same state: tensors are copied exactly (views of one tensor, e.g. tied weights, stay one buffer,
as torch.save keeps them one storage); everything else (numbers, strings, numpy RNG states) is deep-copied.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, Tuple

import torch


class HostCopy:
    """One session's reusable copy of what it saves (CheckpointWriter holds it)."""

    def __init__(self) -> None:
        self._buffers: Dict[Tuple, torch.Tensor] = {}

    def take(self, state: Any) -> Any:
        """`state` with every tensor copied into its buffer (the same key path, shape and dtype as last time: the
        same buffer); training may change the originals as soon as this returns."""
        seen: Dict[Tuple, torch.Tensor] = {}
        return self._copy(state, (), seen)

    def _copy(self, value: Any, path: Tuple, seen: Dict[Tuple, torch.Tensor]) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path, seen)
        if isinstance(value, dict):
            items = ((k, self._copy(v, path + (k,), seen)) for k, v in value.items())
            return type(value)(items) if type(value) is not dict else dict(items)
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(self._copy(v, path + (i,), seen) for i, v in enumerate(value))
        return copy.deepcopy(value)

    def _tensor(self, value: torch.Tensor, path: Tuple, seen: Dict[Tuple, torch.Tensor]) -> torch.Tensor:
        value = value.detach()
        if value.layout is not torch.strided or value.is_quantized:
            return value.clone().cpu()  # rare layouts: a fresh copy
        same = (value.device.type, value.data_ptr(), value.dtype, tuple(value.shape), value.stride())
        if same in seen:  # another name for the same tensor (tied weights): one copy, as torch.save keeps one
            return seen[same]
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
            buffer = torch.empty(value.shape, dtype=value.dtype, device="cpu")
            self._buffers[path] = buffer
        buffer.copy_(value)
        seen[same] = buffer
        return buffer
