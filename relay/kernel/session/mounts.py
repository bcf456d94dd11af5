"""Where Kaggle mounted the datasets a session's plan names (relay/shared/session_plan.py: `resume`, `data`,
`features`, a canary's `canary`), as folders: searched, not assumed. The kernel's input folder is
KAGGLE_INPUT_DIR (/kaggle/input on Kaggle; the emulator sets its own)."""
from __future__ import annotations

import os
from typing import Optional

from relay.shared.session_plan import SessionPlan


def input_dir() -> str:
    return os.environ.get("KAGGLE_INPUT_DIR", "/kaggle/input")


def mounted(ref: str, root: Optional[str] = None) -> Optional[str]:
    """Where Kaggle mounted dataset or kernel output `ref` (owner/slug); None when absent. datasets/<owner>/<slug>
    and notebooks/<owner>/<slug> since 2026-08, <slug> on older images (docs/kaggle.md, mount layouts)."""
    root = input_dir() if root is None else root
    owner, slug = ref.split("/", 1)
    for path in (os.path.join(root, "datasets", owner, slug), os.path.join(root, "notebooks", owner, slug),
                 os.path.join(root, slug)):
        if os.path.isdir(path):
            return path
    return None


def folders(plan: SessionPlan) -> tuple[list[str], Optional[str], list[str]]:
    """The plan's (checkpoint folders, data folder, feature folders): the ones given as they are, then its mounted
    datasets'. A checkpoint dataset not mounted starts the session without it (said in the log); the data dataset
    not found is its <input>/<slug> (the recipe then says what is missing)."""
    root = input_dir()
    resume = list(plan.resume_from)
    for ref in plan.resume:
        path = mounted(ref, root)
        if path:
            resume.append(path)
        else:
            print(f"relay: checkpoint dataset {ref} is not mounted; starting without it", flush=True)
    data = plan.data_dir
    if data is None and plan.data:
        data = mounted(plan.data, root) or os.path.join(root, plan.data.split("/", 1)[1])
    features = list(plan.feature_dirs) + [p for p in (mounted(ref, root) for ref in plan.features) if p]
    return resume, data, features
