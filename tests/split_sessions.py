"""Shared by the recipe tests: a spec run as one session vs split into sessions at random step counts.

Every session is a new `python -m relay train` process bounded by `--max-steps` (a step count: the same
split on any machine), resuming from the checkpoint the previous one left in the workdir.
"""
from __future__ import annotations

import json
import random
from pathlib import Path


def progress(workdir: Path) -> dict:
    return json.loads((Path(workdir) / "progress.json").read_text())


def random_splits(total: int, sessions: int, seed: int) -> list[int]:
    """Steps per session: `sessions` positive counts summing to `total`, cut at seeded random points."""
    cuts = sorted(random.Random(seed).sample(range(1, total), sessions - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, total])]


def run_split(relay_cli, spec: Path, workdir: Path, steps: list[int], *extra: str) -> dict:
    for i, n in enumerate(steps):
        relay_cli.train(spec, workdir, None, "--max-steps", str(n), *extra)
        p = progress(workdir)
        assert len(p["sessions"]) == i + 1 and p["global_step"] == sum(steps[: i + 1]), p["sessions"][-1]
    final = progress(workdir)
    assert final["status"] == "done"
    return final
