"""The user's code folder as it ships: which files travel inside a session kernel, how much may, and where
the folder is on each side of the wire (beside the spec on the orchestrator, unpacked in the kernel).
Both sides read this; importing the code itself is the kernel side's job (relay.kernel.usercode)."""
from __future__ import annotations

import fnmatch
import os
import re
from pathlib import Path
from relay.shared import environment
from relay.shared.environment import SessionEnvironment

CODE_DIR_ENV = environment.CODE_DIR  # set by the session kernel: where it unpacked the user's folder
# The folder travels base64 inside the kernel source (one SaveKernel call ships code, spec and run id
# atomically; see relay/orchestrator/kaggle/kernel_source.py). Kaggle documents no limit on that text, so we keep it
# to what a script reasonably is: past 2 MB the folder holds data or weights, which belong in a dataset
# (kaggle.dataset_sources), versioned and mounted, not re-uploaded with every session.
MAX_CODE_BYTES = 2_000_000
_ALWAYS_EXCLUDED = ("__pycache__", "*.pyc", ".*", "relay-run", "relay-runs", "*.egg-info")
# The relay's own outputs are never code. By name: the Session API's default workdir (relay-run/, anywhere),
# `relay run`'s default --out (relay-runs/) and the flows' default state_dir (runs/, at the folder's top).
# Whatever they are named: a folder the orchestrator marked as its outputs (mark_outputs) is skipped, so a
# spec beside train.py does not ship its earlier sessions' outputs with every later one.
_TOP_LEVEL_EXCLUDED = ("runs",)
OUTPUTS_MARKER = ".relay-outputs"
# Accelerate's own `save_state` output (a script's epoch_0/, step_100/, checkpoint_3/: Accelerate's
# by_feature/checkpointing.py writes them into the current directory, the code folder): its RNG file beside
# weights or an optimizer. Never code: left out, with one line (spec.check_code_folder), as the relay's outputs are;
# under the relay its state travels in the relay's checkpoint (relay.accelerate.RelayAccelerate).
_ACCELERATE_RNG = re.compile(r"random_states_\d+\.pkl")
_ACCELERATE_STATE = re.compile(r"(optimizer(_\d+)?\.bin|model(_\d+)?\.safetensors|pytorch_model(_\d+)?\.bin)")


def resolve_folder(spec_path: Path, folder: str) -> Path:
    """code.folder, relative to the spec file; inside a kernel, where the kernel unpacked it."""
    unpacked = SessionEnvironment.read().code_dir
    if unpacked is not None:
        return unpacked
    return (Path(spec_path).resolve().parent / folder).resolve()


def code_files(folder: Path, exclude: list[str] = ()) -> list[tuple[str, Path]]:
    """(relative posix path, file) of everything that ships, sorted; hidden files, caches, the relay's
    own outputs (relay-run/, relay-runs/, a top-level runs/, a folder marked by mark_outputs) and Accelerate's
    save_state folders (accelerate_states) never do."""
    patterns = [*_ALWAYS_EXCLUDED, *exclude]
    out = []
    for root, dirs, files in os.walk(folder):
        rel_root = Path(root).relative_to(folder)
        dirs[:] = sorted(d for d in dirs if not _excluded((rel_root / d).as_posix(), d, patterns)
                         and not (rel_root == Path(".") and d in _TOP_LEVEL_EXCLUDED)
                         and not (Path(root) / d / OUTPUTS_MARKER).is_file()
                         and not is_accelerate_state(Path(root) / d))
        for name in sorted(files):
            rel = (rel_root / name).as_posix()
            if not _excluded(rel, name, patterns):
                out.append((rel, Path(root) / name))
    return out


def is_accelerate_state(folder: Path) -> bool:
    """`folder` holds what Accelerate's save_state writes: its RNG file beside weights or an optimizer."""
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    return (any(_ACCELERATE_RNG.fullmatch(n) for n in names)
            and any(_ACCELERATE_STATE.fullmatch(n) for n in names))


def accelerate_states(folder: Path, exclude: list[str] = ()) -> list[str]:
    """The folders under `folder` (relative, posix) that code_files leaves out as Accelerate's save_state output."""
    patterns = [*_ALWAYS_EXCLUDED, *exclude]
    found = []
    for root, dirs, _ in os.walk(folder):
        rel_root = Path(root).relative_to(folder)
        for d in list(dirs):
            if _excluded((rel_root / d).as_posix(), d, patterns) or (Path(root) / d / OUTPUTS_MARKER).is_file():
                dirs.remove(d)
            elif is_accelerate_state(Path(root) / d):
                found.append((rel_root / d).as_posix())
                dirs.remove(d)
    return sorted(found)


def mark_outputs(folder: Path) -> None:
    """Mark `folder` as the relay's outputs (where `relay run` and the flows keep each spec's runs/NAME)."""
    marker = Path(folder) / OUTPUTS_MARKER
    if not marker.is_file():
        marker.write_text("kaggle-relay's outputs: never shipped as code\n")


def outputs_holding(folder: Path) -> Path | None:
    """The relay's output folder that `folder` is (or lies inside), else None."""
    folder = Path(folder).resolve()
    for place in (folder, *folder.parents):
        if (place / OUTPUTS_MARKER).is_file() or place.name in ("relay-runs", "relay-run"):
            return place
    return None


def _excluded(rel: str, name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(name, p) or fnmatch.fnmatch(rel, p) for p in patterns)
