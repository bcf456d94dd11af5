"""Atomic checkpoints: a folder counts only once its manifest (a checksum of every file) is in place.

save:  a host copy of the state (while the caller waits: host_copy.py) then, on a thread while training goes on:
       .tmp-<name>/state.pt (torch.save) -> crc32 of the file -> fsync -> manifest.json (fsync) -> rename to
       <name> -> retention (a synchronous save does it all in the caller, from the state itself)
load:  newest folder whose manifest and hashes check out; older ones when the newest is incomplete or corrupt
prune: only after a successful save; keeps the newest `keep_last` and the best; never the newest valid one
one step, one checkpoint: a save at a step that already has one (the final save right after a best save, a
       session that stops at the step it resumed from) commits as <name>.1 first, then retires the older one
       and renames itself to <name>; at every instant a valid checkpoint of that step exists

State is saved with plain types and tensors only, so `torch.load(weights_only=True)` reads it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from relay.shared import atomic
from relay.shared.environment import SessionEnvironment
from relay.shared.errors import InputError
from relay.shared.manifest import (DIGESTS, FORMAT, MANIFEST, NAME, STATE_FILE, Checkpoint, Checksum,  # noqa: F401 (re-exported)
                                     digest_of, file_digest, find_checkpoints, list_valid, read_manifest, seq_of,
                                     sha256_file, size_text, why_unusable)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    pass


class DiskBudgetError(CheckpointError, InputError):
    """The configured disk budget cannot hold the checkpoints a resumable run needs."""


class CorruptCheckpointError(CheckpointError, InputError):
    """A session told to resume found nothing valid to resume from. Its one-line message starts with
    CORRUPT_PREFIX, which the orchestrator reads in the kernel's log (relay.orchestrator.chain.mounted_checkpoint_corrupt)."""


CORRUPT_PREFIX = "the mounted checkpoint"


# -- save and retention (one writer per session) ---------------------------------------------------
def _next_name(root: Path, step: int) -> str:
    base = f"step-{step:08d}"
    if not (root / base).exists():
        return base
    seq = 1
    while (root / f"{base}.{seq}").exists():
        seq += 1
    return f"{base}.{seq}"


class CheckpointWriter:
    """What one session's saves share, owned here rather than by the module (as torchtitan's CheckpointManager
    owns its async save): the one save in flight (a new save, an export or the end of the session waits for
    it), the retired folders still being deleted on their threads, and the step of the last save (the test
    seam below). A session (SessionCore) holds one; a save through another writer does not wait for it."""

    def __init__(self) -> None:
        self._pending: Optional[PendingSave] = None
        self._deleting: list[threading.Thread] = []
        self._last_saved_step: Optional[int] = None
        self._host_copy = None  # a background save's copy of the state (host_copy.HostCopy), made at the first

    def save(self, root: Path, state: dict, **kwargs: Any) -> Checkpoint:
        """Write `state` as a new checkpoint under `root`, commit it, then apply retention; returns it committed.
        Arguments as `start_save`."""
        return self.start_save(root, state, background=False, **kwargs).result()

    def start_save(self, root: Path, state: dict, *, step: int, meta: dict, disk_budget_bytes: Optional[int] = None,
                   keep_last: int = 2, keep_best_mode: Optional[str] = None, digest: str = "crc32",
                   besides_bytes: int = 0, background: bool = True,
                   on_commit: Optional[Callable[["Checkpoint"], Any]] = None) -> "PendingSave":
        """Copy `state` into host buffers now (when this returns, training may change the tensors), then write it
        into a temporary folder and commit it (checksum, fsync, manifest, rename, retention, then
        `on_commit(checkpoint)`) on a thread; when `background` is False, all of it here, from `state` itself.
        Until the commit, the previous checkpoint stays the newest valid one, so a kill at any instant loses at
        most this save. One save is in flight at a time: this first waits for the last one.

        Why a thread: only the copy needs the state as it is now. torch.save of the copy (serialization into
        the page cache, ~2 GB/s here), the crc32 re-read of the file (1-2.6 GB/s) and the fsync (the disk's
        speed) need nothing from training, so the training loop no longer waits for them
        (bench/bench_checkpoint.py).

        `meta` goes into the manifest (run_id, code_version, epoch, best={"metric","value","step"}).
        `keep_best_mode` ("min"/"max") keeps the checkpoint with the best `best.value` as well.
        `besides_bytes`: the rest of the session's output (feature cache, export), which shares the disk budget
        (Kaggle's 20 GB output cap counts everything under /kaggle/working).
        """
        self.wait_pending()
        t0 = time.perf_counter()
        root.mkdir(parents=True, exist_ok=True)
        self._remove_stale_tmp(root)
        if disk_budget_bytes is not None:
            _make_room(root, disk_budget_bytes - besides_bytes, keep_best_mode, besides_bytes)
        name = _next_name(root, step)
        tmp = root / f".tmp-{name}-{os.getpid()}"
        if background:
            if self._host_copy is None:
                from relay.kernel.session.host_copy import HostCopy  # torch: the orchestrator never saves

                self._host_copy = HostCopy()
            state = self._host_copy.take(state)
        tmp.mkdir()
        meta = json.loads(json.dumps(meta))  # the caller's dicts may change while the commit runs

        def commit() -> Checkpoint:
            try:
                import torch  # here, not at the top: the orchestrator reads and verifies manifests without torch

                torch.save(state, tmp / STATE_FILE)  # torch's own C++ writer: the fastest path into the page cache
                state_file = tmp / STATE_FILE
                files = {STATE_FILE: {"bytes": state_file.stat().st_size, digest: file_digest(state_file, digest)}}
                atomic.fsync(state_file)
                manifest = {"format": FORMAT, "step": step, "created": time.time(), **meta, "files": files}
                # The manifest is the commit marker: written last, then the folder appears under its name.
                atomic.write_json(tmp / MANIFEST, manifest)
                self._test_stop_mid_save(step)
                os.rename(tmp, root / name)
                atomic.fsync(root)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            saved = self._supersede(root, Checkpoint(root / name, step, seq_of(name), manifest))
            self.prune(root, keep_last=keep_last, keep_best_mode=keep_best_mode)
            if on_commit is not None:
                on_commit(saved)
            return saved

        pending = PendingSave(commit, t0, background, on_result=self._forget)
        if background:
            self._pending = pending
            pending.start()
        return pending

    def wait_pending(self) -> Optional[Checkpoint]:
        """Wait for the save in flight, if any (before the next save, an export, or the end of a session); raises
        what its commit raised."""
        return self._pending.result() if self._pending is not None else None

    def _forget(self, done: "PendingSave") -> None:
        if self._pending is done:
            self._pending = None

    def _supersede(self, root: Path, saved: Checkpoint) -> Checkpoint:
        """The newest save at a step replaces the older ones at that step (same step, same weights: no optimizer
        step ran between them; the newer holds the later bookkeeping and the same best record). Crash-safe: the
        new folder is committed before the old ones are retired, and its rename to the plain name is atomic, so
        a kill anywhere leaves a valid checkpoint of this step (at worst still named <name>.1, loaded as usual).
        An older one that scored a metric the new one does not carry is kept (keep_best still needs it)."""
        if saved.seq == 0:
            return saved
        for old in list_valid(root):
            if old.step == saved.step and old.path != saved.path and old.metric in (None, saved.metric):
                self._retire(old.path)
        plain = root / f"step-{saved.step:08d}"
        if plain.exists():
            return saved
        os.rename(saved.path, plain)
        atomic.fsync(root)
        return Checkpoint(plain, saved.step, 0, saved.manifest)

    def prune(self, root: Path, keep_last: int, keep_best_mode: Optional[str] = None) -> list[Path]:
        """Delete all but the newest `keep_last` valid checkpoints (and the best). Returns what was removed.
        Incomplete folders are left alone here: a concurrent reader may still be validating them."""
        valid = list_valid(root)
        keep = {c.path for c in valid[:keep_last]}
        best = _best(valid, keep_best_mode)
        if best is not None:
            keep.add(best.path)
        removed = []
        for ckpt in valid[keep_last:]:
            if ckpt.path not in keep:
                self._retire(ckpt.path)
                removed.append(ckpt.path)
        return removed

    # TEST SEAM (tests/e2e/test_relay_faults.py): with RELAY_TEST_STOP_MID_SAVE=<step> set, a writer that has already
    # saved below that step stops its process (SIGSTOP) in its first save at or past it, with every file written
    # but the folder not yet renamed, so a test can SIGKILL a provably torn save on a machine of any speed (or
    # SIGCONT it). Unset in production: one environment lookup per save.
    def _test_stop_mid_save(self, step: int) -> None:
        at = SessionEnvironment.read().stop_mid_save_at
        previous, self._last_saved_step = self._last_saved_step, step
        if at is not None and previous is not None and previous < at <= step:
            # Directed at this thread (the commit may run on one): it stops before its next instruction. A
            # SIGSTOP sent to the process is taken by the main thread, and this one could still rename meanwhile.
            signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)

    def _remove_stale_tmp(self, root: Path) -> None:
        """Half-written folders from a save that was killed, and retired ones a killed process left: never
        valid, only taking disk. Retired folders this writer is still deleting are left to their thread (a
        save need not wait for the previous one's deletion: they no longer count as checkpoints)."""
        self._deleting[:] = [t for t in self._deleting if t.is_alive()]
        deleting = {t.name for t in self._deleting}
        for p in [*root.glob(".tmp-step-*"), *root.glob(".trash-step-*")]:
            if str(p) not in deleting:
                shutil.rmtree(p, ignore_errors=True)

    def _retire(self, path: Path) -> None:
        """Drop a checkpoint: renamed away at once (it stops counting as a checkpoint), its files deleted in
        the background, because unlinking GBs is slow (0.3 s per 300 MB here) and training need not wait."""
        trash = path.with_name(f".trash-{path.name}-{os.getpid()}")
        n = 0
        while trash.exists():  # the same name retired twice (a step's checkpoint superseded again) while deleting
            n += 1
            trash = path.with_name(f".trash-{path.name}-{os.getpid()}-{n}")
        os.rename(path, trash)
        thread = threading.Thread(target=shutil.rmtree, args=(trash,), kwargs={"ignore_errors": True}, daemon=True,
                                  name=str(trash))
        thread.start()
        self._deleting.append(thread)

    def wait_for_deletions(self) -> None:
        """Block until retired checkpoints are gone (before a disk-budget check, and before a session ends so
        no half-deleted folder becomes kernel output)."""
        while self._deleting:
            self._deleting.pop().join()


class PendingSave:
    """A save whose state is copied and whose write and commit run on a (non-daemon) thread once started: a crash
    of the training code still lets it finish; `result()` waits for it and re-raises its error. Unstarted, it
    commits here and now (a synchronous save)."""

    def __init__(self, commit: Callable[[], Checkpoint], started: float, background: bool,
                 on_result: Callable[["PendingSave"], None]):
        self.started, self.seconds = started, None  # seconds: call to commit, what a synchronous save costs
        self._checkpoint: Optional[Checkpoint] = None
        self._error: Optional[BaseException] = None
        self._on_result = on_result
        self._thread = threading.Thread(target=self._run, args=(commit,), name="checkpoint-commit")
        if not background:
            self._run(commit)

    def start(self) -> None:
        self._thread.start()

    def _run(self, commit: Callable[[], Checkpoint]) -> None:
        try:
            self._checkpoint = commit()
        except BaseException as exc:  # noqa: BLE001 - re-raised by result()
            self._error = exc
        self.seconds = time.perf_counter() - self.started

    def result(self) -> Checkpoint:
        if self._thread.ident is not None:
            self._thread.join()
        self._on_result(self)
        if self._error is not None:
            raise self._error
        return self._checkpoint


def bytes_besides(workdir: Path, checkpoints: Path) -> int:
    """Bytes of a session's output that are not checkpoints (feature cache, export, logs)."""
    total = 0
    for dirpath, dirnames, files in os.walk(workdir):
        if Path(dirpath) == Path(workdir):
            dirnames[:] = [d for d in dirnames if Path(dirpath, d) != Path(checkpoints)]
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def disk_besides(workdir: Path, ckpt_root: Path, model, reason: str, exports: int = 1) -> int:
    """What shares the output's disk budget with the checkpoints: everything else in the workdir (the cache,
    an export, the integrations' hf-resume/ and lightning-resume/ copies, a Trainer's output folder), and at
    the final save of a finished run the export about to be written (about the weights' size)."""
    used = bytes_besides(workdir, ckpt_root)
    if reason == "done" and model is not None:  # twice with export/best/ beside the final export
        used += exports * sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return used


def _best(valid: list[Checkpoint], mode: Optional[str]) -> Optional[Checkpoint]:
    scored = [c for c in valid if c.metric is not None]
    if not mode or not scored:
        return None
    pick = min if mode == "min" else max
    return pick(scored, key=lambda c: c.metric)


def _make_room(root: Path, budget: int, keep_best_mode: Optional[str], besides: int = 0) -> None:
    """Prune oldest-first (sparing the newest valid and the best) until a new checkpoint fits."""
    note = f" (besides {size_text(besides)} of cache/export in the same output)" if besides else ""
    valid = list_valid(root)
    if not valid:
        return
    expected = valid[0].nbytes()
    if valid[0].nbytes() + expected > budget:  # hopeless: refuse before deleting any fallback
        raise DiskBudgetError(
            f"checkpoints.disk_budget_gb: a new checkpoint (~{size_text(expected)}) does not fit beside the"
            f" newest one ({size_text(valid[0].nbytes())}) in {size_text(budget)}{note}; raise the budget"
        )
    used = sum(c.nbytes() for c in valid)
    spare = {valid[0].path}
    best = _best(valid, keep_best_mode)
    if best is not None:
        spare.add(best.path)
    for ckpt in reversed(valid):  # oldest first
        if used + expected <= budget:
            return
        if ckpt.path not in spare:
            shutil.rmtree(ckpt.path)
            used -= ckpt.nbytes()
    if used + expected > budget and best is not None and best.path != valid[0].path:
        shutil.rmtree(best.path)  # the best is worth less than a resumable run
        used -= best.nbytes()
    if used + expected > budget:
        raise DiskBudgetError(
            f"checkpoints.disk_budget_gb: a new checkpoint (~{size_text(expected)}) does not fit beside the"
            f" newest one ({size_text(used)}) in {size_text(budget)}{note}; raise the budget"
        )


# -- find and load ----------------------------------------------------------------------------------

def load_latest(*roots: Path, map_location: str = "cpu") -> Optional[tuple[Checkpoint, dict]]:
    """The newest checkpoint that verifies and loads, falling back to older ones; None if there is none."""
    for ckpt in list_valid(*roots):
        try:
            return ckpt, load(ckpt, map_location=map_location)
        except CheckpointError as err:
            log.warning("skipping checkpoint %s: %s", ckpt.path, err)
    return None


def load_resume(own: Path, resume_from: Sequence[Path], map_location: str = "cpu"
                ) -> Optional[tuple[Checkpoint, dict]]:
    """load_latest over a session's own checkpoints and the folders it was told to resume from. Given such
    folders and nothing valid anywhere, it raises rather than start over at step 0: a fresh run would spend
    the session, and with time-bounded sessions could even pass the published step and be handed over."""
    restored = load_latest(own, *resume_from, map_location=map_location)
    if restored is None and resume_from:
        source = Path(resume_from[0])
        raise CorruptCheckpointError(f"{CORRUPT_PREFIX} {source} is corrupt: {why_unusable(source)}")
    return restored


def load(ckpt: Checkpoint, map_location: str = "cpu") -> dict:
    """Load the state file safely (weights_only) while a second thread verifies its checksum; the result
    is used only if the checksum matches. zlib and hashlib release the GIL, so on two cores the check
    costs almost nothing next to the load."""
    import torch

    path = ckpt.path / STATE_FILE
    algo, expected = digest_of(ckpt.manifest["files"][STATE_FILE])
    with ThreadPoolExecutor(max_workers=1) as pool:
        actual = pool.submit(file_digest, path, algo)
        try:
            state, error = torch.load(path, map_location=map_location, weights_only=True, mmap=True), None
        except Exception as err:  # torch raises several types for a damaged zip
            state, error = None, err
        if actual.result() != expected:
            raise CheckpointError(f"{path}: {algo} does not match its manifest (corrupt or truncated)")
    if error is not None:
        raise CheckpointError(f"{path}: cannot be loaded ({type(error).__name__}: {error})")
    return state


def weights_sha256(state_dict: dict[str, torch.Tensor]) -> str:
    """sha256 over the tensors' raw bytes, names sorted: equal iff the weights are bit-identical."""
    import torch

    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name].detach().cpu().contiguous().reshape(-1)
        h.update(name.encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def export_atomic(out_dir: Path, write: Callable[[Path], Any]) -> None:
    """Run `write(tmp_dir)` and move the result to `out_dir` in one rename (replacing an older export)."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        for f in tmp.iterdir():
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # the previous export stays as it was
        raise
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    if out_dir.exists():
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    atomic.fsync(out_dir.parent)
