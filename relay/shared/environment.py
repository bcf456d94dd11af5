"""The environment a session process runs in, read in one place (submitit's JobEnvironment is the model): each
variable the relay, torchrun or Kaggle sets for it, with its name, parsing and default. `read()` snapshots
os.environ when a value is needed: the Session API's config is set just before a user's script runs, so
nothing here is read at import. Setting variables (for a child process, a rank, a library) stays with
whoever starts that child."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

SESSION = "RELAY_SESSION"  # the session config a user's open_session() reads (relay.kernel.entry sets it)
CODE_DIR = "RELAY_CODE_DIR"  # where the session kernel unpacked the user's code folder
DEVICE = "RELAY_DEVICE"  # cpu or cuda, instead of "cuda when there is one" (tests, the emulator)
TRACE = "RELAY_TRACE"  # verify-resume: the file each step's fingerprint is appended to
KILL_MARKER = "RELAY_VERIFY_KILL_MARKER"  # verify-resume: the session to SIGKILL mid-save announces itself here
PROGRESS_EVERY = "RELAY_PROGRESS_EVERY"  # seconds between `relay-progress` lines (default 30)
STOP_MID_SAVE = "RELAY_TEST_STOP_MID_SAVE"  # tests: a save at or past this step stops itself mid-commit
# tests and the emulator: what the session is told it runs on, JSON over what it sees ({"gpus": [names],
# "torch", "cuda", "python", "image"}): CUDA and Kaggle's images cannot run here
HARDWARE = "RELAY_TEST_HARDWARE"
EMULATE_GPU = "RELAY_EMULATE_GPU"  # t4: the session runs as if on that GPU (over the spec's session.emulate); none: not
# verify-resume: modules (comma-separated) imported once in a zygote its sessions are forked from, not each
# session a fresh interpreter (relay/shared/warm_zygote.py); unset: fresh interpreters
WARM_MODULES = "RELAY_WARM_MODULES"


@dataclass(frozen=True)
class SessionEnvironment:
    session: Optional[dict]
    code_dir: Optional[Path]
    device: Optional[str]
    world_size: int  # torchrun's WORLD_SIZE (1 outside a multi-process world)
    local_rank: int  # torchrun's LOCAL_RANK: this process's GPU
    trace: Optional[Path]
    kill_marker: Optional[str]
    progress_every_s: float
    stop_mid_save_at: Optional[int]
    wandb_api_key: bool  # a W&B key is set (its value is never read here)
    hardware: Optional[dict]  # HARDWARE's override of what the session sees
    kaggle_kernel: bool  # Kaggle's KAGGLE_KERNEL_RUN_TYPE is set: this runs inside a Kaggle kernel
    emulator: bool  # ... of the local emulator, which runs kernels on this machine's CPU
    image: dict  # what Kaggle's Docker image says of itself: its GIT_COMMIT and BUILD_DATE
    emulate_gpu: Optional[str] = None  # EMULATE_GPU as set ("none" included); None: unset, the spec decides
    warm_modules: tuple = ()  # WARM_MODULES' names, as written (verify-resume checks them)

    @classmethod
    def read(cls, environ: Optional[Mapping[str, str]] = None) -> "SessionEnvironment":
        env = os.environ if environ is None else environ
        return cls(
            session=json.loads(env[SESSION]) if env.get(SESSION) else None,
            code_dir=Path(env[CODE_DIR]) if env.get(CODE_DIR) else None,
            device=env.get(DEVICE) or None,
            world_size=int(env.get("WORLD_SIZE") or 1),
            local_rank=int(env.get("LOCAL_RANK") or 0),
            trace=Path(env[TRACE]) if env.get(TRACE) else None,
            kill_marker=env.get(KILL_MARKER) or None,
            progress_every_s=float(env.get(PROGRESS_EVERY, 30)),
            stop_mid_save_at=int(env[STOP_MID_SAVE]) if env.get(STOP_MID_SAVE) else None,
            wandb_api_key=bool(env.get("WANDB_API_KEY")),
            hardware=json.loads(env[HARDWARE]) if env.get(HARDWARE) else None,
            kaggle_kernel=bool(env.get("KAGGLE_KERNEL_RUN_TYPE")),
            emulator=bool(env.get("KAGGLE_EMULATOR")),
            image={"commit": env.get("GIT_COMMIT") or None, "built": env.get("BUILD_DATE") or None},
            emulate_gpu=env.get(EMULATE_GPU) or None,
            warm_modules=tuple(name.strip() for name in env.get(WARM_MODULES, "").split(",") if name.strip()),
        )
