"""What a session ran on, as its record in progress.json's `sessions` keeps it, and what changed between two.

A relay of several weeks meets Kaggle's image updates (a new torch, a new CUDA), accelerator swaps and hosts
with other CPUs. Each session records `gpus` ({"count", "names"}) and `runtime` ({"python", "torch", "cuda",
"cudnn", "image", "image_built", "cpu", "cpu_capability", "gpu_capability"}; the image is the git commit
Kaggle's Docker image was built from, None outside Kaggle; cpu_capability is torch's CPU kernels' instruction set,
AVX512 or AVX2: relay/kernel/session/hardware.py reads them all). Any of these changes the float results of the
same math, so an exact resume is proven only between sessions that agree on all of them: the session compares
itself with the session before it (progress.json's `exactness_lost`), and `relay status`, the summary and the
notifications say which session changed what, from these functions.
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

from relay.shared.accelerators import describe as describe_gpus
from relay.shared.progress import Progress

# image_built goes with image: not compared on its own
RUNTIME_KEYS = ("python", "torch", "cuda", "cudnn", "image", "cpu", "cpu_capability", "gpu_capability")
_LABELS = {"python": "Python", "torch": "torch", "cuda": "CUDA", "cudnn": "cuDNN", "image": "image", "cpu": "CPU",
           "cpu_capability": "CPU kernels", "gpu_capability": "GPU compute capability"}
NOT_PROMISED = "bit-identity with an uninterrupted run is not promised across them"


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


def change_note(before: Mapping, after: Mapping) -> Optional[str]:
    """"session 3 ran on another environment than session 2: CPU kernels AVX512 -> AVX2; bit-identity with an
    uninterrupted run is not promised across them (from step 400)", or None when nothing changed."""
    changed = changes(before, after)
    if not changed:
        return None
    return (f"session {after.get('index')} ran on another environment than session {before.get('index')}:"
            f" {', '.join(changed)}; {NOT_PROMISED} (from step {after.get('step_start')})")


def change_notes(sessions: Sequence[Mapping]) -> list[str]:
    """change_note of each session against the one before it, for every session that changed."""
    return [note for before, after in zip(sessions, sessions[1:]) if (note := change_note(before, after))]


def exact_resume(progress: Progress | Mapping, reference: Progress | Mapping) -> tuple[bool, str]:
    """(ok, verdict) of a relay's final weights against an uninterrupted run's, from both progress.json: "identical
    (...)", or weights that differ where a session ran on another environment than the uninterrupted run (other
    CPU, GPU, torch, ...: other floats, not a resume bug, so ok), or "DIFFERENT" on the same machine."""
    progress, reference = Progress.read(progress), Progress.read(reference)
    relayed, straight = progress.weights_sha256, reference.weights_sha256
    sessions = progress.sessions
    first = reference.sessions[0].as_mapping() if reference.sessions else {}
    if relayed == straight:
        return True, f"identical ({len(sessions)} sessions vs 1 uninterrupted; weights sha256 {str(relayed)[:16]})"
    elsewhere = [f"session {s.index}: {', '.join(changed)}" for s in sessions
                 if (changed := changes(first, s.as_mapping()))]
    if elsewhere:
        return True, (f"not comparable: the weights differ (relay {str(relayed)[:16]} vs uninterrupted"
                      f" {str(straight)[:16]}) and sessions ran on another environment than the uninterrupted run"
                      f" ({'; '.join(elsewhere)}): {NOT_PROMISED}")
    return False, f"DIFFERENT: relay {relayed} vs uninterrupted {straight}"


def machine(record: Mapping) -> str:
    """Everything a session's record says decides its float results, in one line: "CPU AMD EPYC (AVX512), no GPU,
    torch 2.5.1, CUDA -, cuDNN -" (what `relay verify-resume` proved exactness on)."""
    r = record.get("runtime") or {}
    gpus = _gpus(record) or "GPUs unknown"
    if r.get("gpu_capability"):
        gpus += f" (compute capability {r['gpu_capability']})"
    return (f"CPU {r.get('cpu') or 'unknown'} ({r.get('cpu_capability') or 'kernels unknown'}), {gpus},"
            f" torch {r.get('torch') or '?'}, CUDA {r.get('cuda') or '-'}, cuDNN {r.get('cudnn') or '-'}")


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
