"""Running the user's code.entry in a session: in this process, or once per rank in N processes with the
torchrun environment (session.devices > 1 on a T4 x2). The entry reads its session from RELAY_SESSION
(relay.kernel.session.settings.SessionSettings), opens it with relay.open_session(), and is classified when it fails: a code error stops
the relay (UserCodeError), an out-of-memory or a broken collective is a transient fault a new session may not hit.
"""
from __future__ import annotations

import importlib
import json
import logging
import os
import runpy
import shutil
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from relay.kernel import notebook
from relay.kernel.session import api, api_distributed, distributed
from relay.kernel.session.device import pick_device
from relay.kernel.session.settings import SessionSettings
from relay.kernel.usercode import UserCodeError, parse_entry
from relay.shared.errors import InputError

if TYPE_CHECKING:
    from relay.shared.spec import RunSpec


# -- running an entry ---------------------------------------------------------------------------------------
def run_entry(spec: "RunSpec", config: SessionSettings) -> dict:
    """Run code.entry in this process with the session config in the environment; return its progress.

    A script that never opens a session, or that raises (other than out-of-memory and CUDA faults, which a
    new session may not hit), is a UserCodeError: `relay train` prints one line and exits 2, and the relay
    stops instead of pushing the same failure again. With session.devices resolving to N > 1 it runs once per
    rank in N processes (launch_entry); a process already in a world (torchrun) runs here."""
    world_size = distributed.world_size_for(spec.session.devices, pick_device().type)
    if world_size > 1 and api_distributed.env_world_size() == 1:
        return launch_entry(spec, config, world_size)

    kind, target, args = parse_entry(spec.code.entry, Path(spec.code.folder))
    os.environ[api.ENV] = json.dumps(config.to_json())
    opened_before = api.sessions_opened()
    argv, cwd, path = sys.argv, os.getcwd(), list(sys.path)
    # The entry runs as `python train.py ...` runs from its own folder: relative reads work in a session too.
    # What a session must keep goes under session.workdir (the code folder is not a session's output).
    os.chdir(Path(target).parent if kind in ("script", "notebook") else spec.code.folder)
    try:
        if kind in ("script", "notebook"):
            sys.argv = [str(target), *args]
            sys.path.insert(0, str(Path(target).parent))
            if kind == "script":
                runpy.run_path(str(target), run_name="__main__")
            else:  # its code cells in order, in one __main__ namespace
                notebook.run(target)
        else:
            module, func = target.split(":")
            getattr(importlib.import_module(module), func)()
    except SystemExit as exit_:
        if exit_.code not in (None, 0):
            raise UserCodeError(f"code.entry {spec.code.entry}:{_cell(kind, exit_)} exited with status"
                                f" {exit_.code}") from None
    except InputError:  # the relay's own refusal (e.g. a batch the processes cannot split): its one line
        raise
    except Exception as err:  # noqa: BLE001 - classified: transient faults re-raise, the rest stop the relay
        if _transient(err):
            raise
        traceback.print_exc()
        where = _cell(kind, err)
        raise UserCodeError(f"code.entry {spec.code.entry}{':' + where if where else ''} raised"
                            f" {type(err).__name__}: {err}") from None
    finally:
        sys.argv, sys.path[:] = argv, path
        os.chdir(cwd)
        os.environ.pop(api.ENV, None)
    if api.sessions_opened() == opened_before:
        raise UserCodeError(f"code.entry {spec.code.entry}: ended without opening a relay session"
                            " (call relay.open_session() and session.close(); see docs/your-code.md)")
    api.close_open_sessions()  # a script that forgot close(): save and report for it
    progress = Path(config.workdir) / "progress.json"
    return json.loads(progress.read_text())


def _cell(kind: str, err: BaseException) -> str:
    """" code cell 3, line 5" where a notebook's cell raised or exited (its traceback has the whole story)."""
    where = notebook.where(err.__traceback__) if kind == "notebook" else ""
    return f" {where}" if where else ""


def _transient(err: BaseException) -> bool:
    text = f"{type(err).__name__}: {err}"
    # gloo/NCCL: a collective broken because another rank failed or died, whose own error is the one to report
    return "out of memory" in text.lower() or "CUDA" in text or "NCCL" in text or "gloo" in text


# -- launching the user's entry, one process per rank -----------------------------------------------------
def launch_entry(spec, config: SessionSettings, world_size: int) -> dict:
    """Run code.entry in `world_size` processes; return rank 0's progress. A refused input on any rank is one
    InputError here (the CLI's one line, exit 2), and a fresh workdir that got no file is removed."""
    workdir = Path(config.workdir)
    created = next((p for p in reversed([workdir, *workdir.parents]) if not p.exists()), None)
    try:
        distributed.launch(_entry_rank, world_size, (spec, config))
    except InputError:
        if created is not None and not any(p.is_file() for p in created.rglob("*")):
            shutil.rmtree(created, ignore_errors=True)
        raise
    return json.loads((workdir / "progress.json").read_text())


def _entry_rank(rank: int, world_size: int, port: int, errors, spec, config: SessionSettings) -> None:
    """One rank (a process of its own): the torchrun environment, then the single-process entry runner."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), **distributed.rank_environment(port))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s", datefmt="%H:%M:%S",
                        force=True)  # a forked rank inherits the launcher's handlers
    try:
        run_entry(spec, config)
    except InputError as err:
        errors.put(str(err))  # the launcher raises it once, as one line
        sys.exit(2)  # a non-zero exit makes the launcher stop ranks left waiting in a collective
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
