"""`relay verify-resume SPEC --steps N`: prove a training script resumes exactly before quota is spent on it.

Run A trains N steps in one session. Run B trains the same N steps as several sessions, cut where loops
usually do something (the first epoch ends, log and eval steps: a script's work after step_done is where a
resume goes wrong) and at random steps, or at the steps `--cut-at` names; one of them SIGKILLed in the middle of a checkpoint save (after its state file is written, before the
manifest commits it: the kill is triggered by that event, not by a timer). Then the two final checkpoints are
compared tensor by tensor: model, optimizer, scheduler, scaler, RNG, everything the checkpoint holds except the
session bookkeeping (times, session records). Prints `identical` or the first tensor that differs and by how much,
and the machine it proved that on (CPU and its kernels, GPUs, torch, CUDA, cuDNN, as the straight run's session
recorded them: relay/shared/runtime.py): both runs are on this machine, so nothing here proves bit-identity
across sessions that land on other CPUs or GPUs, as a Kaggle relay's may.

Each session is a fresh interpreter (`python -c ...` in a session and process group of its own), or, with
RELAY_WARM_MODULES=torch,torch._dynamo,... set, forked from a zygote that imported those modules once
(relay/shared/warm_zygote.py: the same process otherwise, ~2.5 CPU s less a session). Off by default: forks
share the zygote's str hash seed where fresh interpreters each draw their own, so a script whose results
follow the order of a set of strings may differ between cold sessions and never between warm ones.
"""
from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import yaml

from relay.kernel.session import trace
from relay.shared import environment, runtime
from relay.shared.code_folder import accelerate_states
from relay.shared.environment import SessionEnvironment
from relay.shared.errors import InputError
from relay.shared.version import PACKAGE_DIR
from relay.shared.warm_start import WarmStarter
from relay.shared.warm_zygote import SOCKET_VARIABLE

KILL_MARKER_ENV = environment.KILL_MARKER
# per-session records (times, speeds); HF log_history: the loss it logs averages the steps since the last log
# in this process, so a resume inside a logging window logs a different mean (training state is unaffected)
_IGNORED_KEYS = {"sessions", "log_history"}
_IGNORED_FILES = {"training_args.bin"}  # HF's pickled arguments: output_dir differs between the two runs


@dataclass
class Verdict:
    identical: bool
    steps: int
    sessions: list = field(default_factory=list)  # (start, end, "ok" | "killed mid-save")
    first_difference: Optional[str] = None
    differing: int = 0
    seconds: float = 0.0
    diagnosis: Optional[str] = None  # the first step the runs part, and why (relay.kernel.session.trace)
    lost_files: list = field(default_factory=list)  # written by the script outside its workdir
    cuts: list = field(default_factory=list)  # (step, why it is cut there)
    machine: Optional[str] = None  # what both runs ran on (runtime.machine), as the straight run recorded it
    accelerate_states: list = field(default_factory=list)  # Accelerate's save_state folders the script wrote there

    def text(self) -> str:
        split = ", ".join(f"{a}->{b}{'' if how == 'ok' else ' (' + how + ')'}" for a, b, how in self.sessions)
        head = ("identical" if self.identical else f"differs: {self.first_difference}"
                + (f" (and {self.differing - 1} more)" if self.differing > 1 else ""))
        why = f"\n  why: {self.diagnosis}" if self.diagnosis else ""
        lost = (f"\n  warning: the script wrote {', '.join(self.lost_files[:5])}"
                f"{' ...' if len(self.lost_files) > 5 else ''} in its code folder: a Kaggle session keeps only"
                " what is written under session.workdir" if self.lost_files else "")
        if self.accelerate_states:
            lost += (f"\n  warning: {'/, '.join(self.accelerate_states)}/ in the code folder: Accelerate's save_state"
                     " output, never shipped (the relay's checkpoint carries that state)")
        cuts = ", ".join(f"{step} ({why})" for step, why in self.cuts)
        cuts = f"\n  cut at steps {cuts}" if cuts else ""
        machine = (f"\n  machine: {self.machine}; both runs ran on it: a relay whose sessions land on another CPU,"
                   " GPU, torch, CUDA or cuDNN is not promised bit-identity across them" if self.machine else "")
        runs = f"{self.steps} steps straight vs sessions {split}; {self.seconds:.1f} s"
        return f"{head}\n  {runs}{cuts}{why}{lost}{machine}"


def parse_cuts(text: str) -> list[int]:
    """`--cut-at 32,64`: the steps after which a session of the split run ends."""
    try:
        cuts = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        cuts = []
    if not cuts or cuts[0] < 1:
        raise InputError(f"relay verify-resume: --cut-at {text}: give the steps to cut at as positive integers"
                         " separated by commas (--cut-at 32,64)")
    return cuts


def cut_points(steps: int, seed: int, steps_per_epoch: Optional[int], log_every: Optional[int],
               eval_every: Optional[int]) -> list[tuple[int, str]]:
    """(step, why) of the default cuts: the first two epoch ends, the first log and eval steps (where a loop
    evaluates, logs or builds a DataLoader after step_done), and three random steps; all inside (0, steps)."""
    found: dict[int, str] = {}
    for every, why, count in ((steps_per_epoch, "epoch end", 2), (eval_every, "eval step", 1),
                              (log_every, "log step", 1)):
        for step in [every * k for k in range(1, count + 1)] if every else []:
            if 0 < step < steps:
                found.setdefault(step, why)
    for step in random.Random(seed).sample(range(1, steps), 3):
        found.setdefault(step, "random")
    return sorted(found.items())


def verify_resume(spec_path: Path, steps: Optional[int] = None, *, seed: int = 0,
                  workdir: Optional[Path] = None, timeout: float = 1800,
                  cut_at: Optional[list[int]] = None) -> Verdict:
    from relay.kernel.session import checkpoint
    from relay.kernel.usercode import check_code
    from relay.shared import spec as spec_mod

    t0 = time.monotonic()
    spec = spec_mod.load(spec_path)  # a bad spec: one line, exit 2, nothing written
    check_code(spec, source=str(spec_path))
    warm = _warm_modules(SessionEnvironment.read().warm_modules)
    total = spec.optim.max_steps
    steps = steps or min(total or 60, 3 * (spec.session.max_steps or 20))
    if total is not None and steps > total:
        raise InputError(f"relay verify-resume: --steps {steps} is more than the run's optim.max_steps ({total})")
    if steps < 4:
        raise InputError("relay verify-resume: --steps must be at least 4 (three cuts and a kill need room)")
    if cut_at and max(cut_at) >= steps:
        raise InputError(f"relay verify-resume: --cut-at {max(cut_at)}: every cut must be a step before the"
                         f" last (--steps {steps})")
    root = (Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="relay-verify-"))).resolve()  # entries chdir
    root.mkdir(parents=True, exist_ok=True)
    spec_copy = _spec_copy(spec_path, root)

    a, b = root / "straight", root / "split"
    code = Path(spec.code.folder) if spec.code else None
    before = _files(code, root)
    _train(spec_copy, a, steps, timeout, warm)
    if cut_at:
        chosen = [(step, "--cut-at") for step in sorted(set(cut_at))]
    else:  # the straight run's progress.json knows its epoch's length (a schedule from session.batches)
        per_epoch = json.loads((a / "progress.json").read_text()).get("steps_per_epoch")
        chosen = cut_points(steps, seed, per_epoch, spec.optim.log_every_steps,
                            spec.optim.eval_every_steps)
    cuts = [step for step, _ in chosen] + [steps]
    sessions, step, killed = [], 0, False
    while step < steps:
        target = next(c for c in cuts if c > step)
        arm = len(sessions) == 1 and not killed  # the second session dies mid-save
        how = _train(spec_copy, b, target - step, timeout, warm, kill_marker=root / "killed" if arm else None)
        killed = killed or how != "ok"
        newest = checkpoint.list_valid(b / "checkpoints")
        sessions.append((step, target, how))
        step = newest[0].step if newest else 0
    if not killed:
        raise RuntimeError("relay verify-resume: the session meant to be killed made no save")
    left = checkpoint.load_latest(a / "checkpoints")[1]
    right = checkpoint.load_latest(b / "checkpoints")[1]
    diffs = list(compare(left, right))
    why = trace.diagnose(_trace_file(a), _trace_file(b)) if diffs else None
    lost = sorted(rel for rel, mtime in _files(code, root).items() if before.get(rel) != mtime)
    straight = json.loads((a / "progress.json").read_text()).get("sessions") or [{}]
    states = [d for d in accelerate_states(code) if any(rel.startswith(d + "/") for rel in lost)] if code else []
    lost = [rel for rel in lost if not any(rel.startswith(d + "/") for d in states)]
    return Verdict(not diffs, steps, sessions, diffs[0] if diffs else None, len(diffs), time.monotonic() - t0, why,
                   lost, chosen, runtime.machine(straight[0]), states)


def _files(folder: Optional[Path], skip: Path) -> dict:
    """{relative path: mtime} of the files under the code folder, but the verification's own folder."""
    if folder is None or not folder.is_dir():
        return {}
    skip = skip.resolve()
    return {str(f.relative_to(folder)): f.stat().st_mtime_ns for f in folder.rglob("*")
            if f.is_file() and "__pycache__" not in f.parts and not f.resolve().is_relative_to(skip)}


def _trace_file(workdir: Path) -> Path:
    return workdir.with_name(workdir.name + ".trace.jsonl")


def _spec_copy(spec_path: Path, root: Path) -> Path:
    """The spec with code.folder made absolute, so the copy resolves to the same code."""
    data = yaml.safe_load(Path(spec_path).read_text())
    if isinstance(data.get("code"), dict):
        from relay.shared.code_folder import resolve_folder

        data["code"]["folder"] = str(resolve_folder(Path(spec_path), data["code"].get("folder", ".")))
    copy = root / "spec.yaml"
    copy.write_text(yaml.safe_dump(data, sort_keys=False))
    return copy


def _warm_modules(names: tuple) -> tuple:
    """RELAY_WARM_MODULES checked before anything runs: a name that is none, or names no module here, is one line."""
    for name in names:
        try:
            found = all(part.isidentifier() for part in name.split(".")) and importlib.util.find_spec(name)
        except (ImportError, ValueError):  # a parent package that is not installed, or no spec
            found = None
        if not found:
            raise InputError(f"relay verify-resume: {environment.WARM_MODULES}={','.join(names)}: {name!r} is not"
                             " a module installed here; give module names separated by commas (torch,torch._dynamo)"
                             " or unset it")
    return names


def _sessions_env() -> dict:
    """What every session's environment starts from: this process's, with the relay it runs first on the path."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(PACKAGE_DIR.parent),
                                                                     os.environ.get("PYTHONPATH")])))
    for name in (KILL_MARKER_ENV, trace.ENV, SOCKET_VARIABLE):  # one session's, or another zygote's
        env.pop(name, None)
    return env


def _start(args: list, env: dict, out, warm: tuple):
    """`python ARGS` in a session and process group of its own, stdout and stderr into `out`: a fresh
    interpreter, or forked from the zygote that imported `warm` (its import is outside any session's clock)."""
    if not warm:
        return subprocess.Popen([sys.executable, *args], env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    starter = WarmStarter.shared(warm, _sessions_env())
    ended = starter.exit_code()
    if ended is not None:  # an import failed, or did what a fork cannot inherit (its message above)
        raise InputError(f"relay verify-resume: {environment.WARM_MODULES}={','.join(warm)}: the process importing"
                         f" them ended (exit {ended}; its message above): leave out the module that fails, or"
                         " unset it")
    return starter.start(args, Path.cwd(), env, output=out.fileno())


def _train(spec: Path, workdir: Path, max_steps: int, timeout: float, warm: tuple = (),
           kill_marker: Optional[Path] = None) -> str:
    """One `relay train` session in a child process; with `kill_marker`, SIGKILLed mid-save. Returns how it ended."""
    env = _sessions_env()
    env[trace.ENV] = str(_trace_file(workdir))
    if kill_marker is not None:
        env[KILL_MARKER_ENV] = str(kill_marker)
    log = workdir.with_name(workdir.name + ".log")
    args = ["-c", "from relay.kernel.verify import _child; _child()", "train", str(spec),
            "--workdir", str(workdir), "--budget", "none", "--max-steps", str(max_steps)]
    with open(log, "a") as out:
        proc = _start(args, env, out, warm)
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            if kill_marker is not None and kill_marker.exists():
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return "killed mid-save"
            if time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                raise RuntimeError(f"relay verify-resume: a session ran past {timeout:.0f} s (log: {log})")
            time.sleep(0.01)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise InputError(f"relay verify-resume: the session exited with status {proc.returncode}; log {log}:\n{tail}")
    return "ok"


def _child() -> None:
    """Entry of verify-resume's sessions: `relay` itself, with a hook that, when armed, stops the first save
    right after its state file is written (before the manifest) and waits there for the SIGKILL."""
    marker = SessionEnvironment.read().kill_marker
    if marker:
        from relay.kernel.session import distributed

        _arm_kill_hook(marker)
        real_launch = distributed.launch  # with session.devices: N, rank 0 of the launched ranks saves

        def launch(worker, world_size, args):
            return real_launch(_armed_rank, world_size, (worker, *args))

        distributed.launch = launch
    import runpy

    # then the `relay` program itself, as `python -m relay` runs it (a program, not a library this module uses)
    sys.argv[0] = "relay"
    runpy.run_module("relay", run_name="__main__", alter_sys=True)


def _arm_kill_hook(marker: str) -> None:
    from relay.kernel.session import checkpoint
    from relay.shared import atomic

    real_fsync = atomic.fsync

    def fsync(path: Path) -> None:
        real_fsync(path)
        p = Path(path)
        if p.name == checkpoint.STATE_FILE and p.parent.name.startswith(".tmp-step-"):
            Path(marker).write_text(str(p))
            while True:  # the parent kills us here
                time.sleep(1)

    checkpoint.atomic.fsync = fsync


def _armed_rank(rank: int, world_size: int, port: int, errors, worker, *args) -> None:
    """A rank of an armed session: the kill hook in this process too, then the rank's own work."""
    _arm_kill_hook(SessionEnvironment.read().kill_marker)
    worker(rank, world_size, port, errors, *args)


def compare(a: Any, b: Any, path: str = "") -> Iterator[str]:
    """Each difference between two checkpoint states, as 'key.path: what differs'."""
    import numpy as np
    import torch

    a, b = (torch.from_numpy(x) if isinstance(x, np.ndarray) else x for x in (a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if key in _IGNORED_KEYS:
                continue
            where = f"{path}.{key}" if path else str(key)
            if key not in a or key not in b:
                yield f"{where}: only in the {'split' if key in b else 'straight'} run"
            elif trace.is_packed_file(key, a[key]) and trace.is_packed_file(key, b[key]):  # a trainer's file
                if key not in _IGNORED_FILES:
                    yield from compare(trace.decode_packed(key, a[key]), trace.decode_packed(key, b[key]), where)
            else:
                yield from compare(a[key], b[key], where)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            yield from compare(x, y, f"{path}[{i}]")
    elif torch.is_tensor(a) and torch.is_tensor(b):
        if a.shape != b.shape or a.dtype != b.dtype:
            yield f"{path}: shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
        elif not torch.equal(a, b):
            if a.is_floating_point():
                diff = (a.double() - b.double()).abs()
                yield (f"{path}: max |diff| {diff.max().item():.3g}, mean {diff.mean().item():.3g}"
                       f" ({int((diff > 0).sum())} of {a.numel()} values)")
            else:
                yield f"{path}: {int((a != b).sum())} of {a.numel()} values differ"
    elif a != b and not (isinstance(a, float) and isinstance(b, float) and a != a and b != b):
        yield f"{path}: {json.dumps(a, default=str)[:60]} vs {json.dumps(b, default=str)[:60]}"
