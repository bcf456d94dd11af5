"""Readers for the TensorBoard logs the tracking tests check: what TensorBoard shows, and every raw step."""
from __future__ import annotations

from pathlib import Path


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] as TensorBoard shows them (EventAccumulator, purging on restarts)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def raw_steps(folder: Path, tag: str) -> list[int]:
    """Every step `tag` has in the event files, with no purging at all (the raw record reader)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    steps = []
    for path in sorted(p for p in folder.iterdir() if "tfevents" in p.name):  # not Lightning's hparams.yaml
        for event in EventFileLoader(str(path)).Load():
            steps += [event.step for v in event.summary.value if v.tag == tag]
    return steps
