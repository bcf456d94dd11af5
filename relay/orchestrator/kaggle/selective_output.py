"""The hand-over download: only what the next session needs, streamed to disk and verified as it arrives.

A session's output holds every kept checkpoint, the feature cache and the export (several times the
checkpoint's size). The handoff needs the newest valid checkpoint's files (named by its manifest), progress.json
and metrics.jsonl; the cache only while the features dataset is unpublished, the export only when the work is
done. Each file is read in 1 MiB chunks (constant memory) into `<name>.part`, its size and crc32/sha256
checked against the checkpoint manifest while it arrives, and renamed into place only when it matches; a
sha256 is computed on the way too, so publishing need not read the bytes again.

Free disk is checked before the first large byte: a short disk fails with one line naming the need and the
space left, and nothing is written (the next tick retries).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import re
import shutil
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from relay.orchestrator.kaggle.client import KaggleClient
from relay.orchestrator.kaggle.kernel_source import MARKER_FILE
from relay.orchestrator.kaggle.output import list_output, safe_relative
from relay.orchestrator.kaggle.retry import call, request_timeout
from relay.orchestrator.kaggle.types import KaggleError
from relay.shared import atomic
from relay.shared.manifest import MANIFEST, digest_of, read_manifest, seq_of, size_text
from relay.shared.progress import Progress

log = logging.getLogger(__name__)
CHUNK = 1 << 20
RESERVE_ENV = "RELAY_HANDOFF_DISK_RESERVE_MB"  # head room left free on the orchestrator's disk
DEFAULT_RESERVE = 256 << 20
disk_usage = shutil.disk_usage  # module-level, so a test can simulate a short disk
_CKPT = re.compile(r"^checkpoints/(step-\d{8}(?:\.\d+)?)/(.+)$")


class DiskSpaceError(KaggleError):
    """Not enough free disk on the orchestrator for the handoff; nothing was written."""


class ChecksumMismatch(KaggleError):
    """A file's bytes do not match its manifest (size or digest)."""


@dataclass
class Candidate:
    name: str                 # step-00000150
    step: int
    seq: int
    manifest: dict
    urls: Dict[str, str]      # file name -> url (every file the manifest lists)

    @property
    def nbytes(self) -> int:
        return sum(int(info["bytes"]) for info in self.manifest["files"].values())


@dataclass
class HandoffDownload:
    """What the kernel left, seen through its small files; the large ones are fetched on demand."""

    client: KaggleClient
    root: Path                         # this handoff's scratch folder (deleted when the handoff ends)
    urls: Dict[str, str]               # output file (relative to the workdir) -> url
    log_text: str
    progress: Optional[Progress]
    found_run_id: Optional[str]
    candidates: List[Candidate] = field(default_factory=list)  # newest first, all files listed
    reserve: int = DEFAULT_RESERVE
    downloaded: int = 0                # bytes written, for the bench
    sha256: Dict[str, str] = field(default_factory=dict)  # staged file name -> sha256 computed on arrival

    def size_of(self, prefix: str) -> int:
        """Bytes under `prefix/` of the workdir (HEAD per file: the listing has no sizes)."""
        return sum(head_size(self.client, url) for name, url in self.urls.items() if name.startswith(prefix + "/"))

    def ensure_space(self, need: int, what: str) -> None:
        ensure_space(self.root, need, self.reserve, what)

    def fetch_checkpoint(self, cand: Candidate, stage: Path) -> None:
        """The candidate's files into the flat `stage` folder, each verified against the manifest."""
        for name, info in sorted(cand.manifest["files"].items()):
            algo, expected = digest_of(info)
            self.sha256[name] = stream_verified(self.client, cand.urls[name], stage / name, int(info["bytes"]),
                                                algo, expected)
            self.downloaded += int(info["bytes"])
        atomic.write_json(stage / MANIFEST, cand.manifest)

    def fetch_file(self, rel: str, target: Path) -> bool:
        """One workdir file (e.g. metrics.jsonl) if the output has it."""
        if rel not in self.urls:
            return False
        self.sha256[target.name] = stream_verified(self.client, self.urls[rel], target)
        self.downloaded += target.stat().st_size
        return True

    def fetch_tree(self, prefix: str, dest: Path) -> Optional[Path]:
        """Every workdir file under `prefix/` into `dest`, keeping subfolders; None when there is none."""
        names = [n for n in self.urls if n.startswith(prefix + "/")]
        for name in names:
            target = dest.joinpath(*safe_relative(name[len(prefix) + 1:]).parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            stream_verified(self.client, self.urls[name], target)
            self.downloaded += target.stat().st_size
        return dest if names else None


def open_output(client: KaggleClient, owner: str, slug: str, root: Path, workdir_name: str = "relay",
                reserve: Optional[int] = None, version: Optional[int] = None) -> HandoffDownload:
    """List the kernel's output and fetch only its small files: progress.json, the run marker, and every
    checkpoint's manifest. `root` is emptied first (a crashed attempt's leftovers are rebuildable)."""
    listed, log_text = list_output(client, owner, slug, version)
    if root.exists():
        shutil.rmtree(root)
    meta = root / "meta"
    meta.mkdir(parents=True)
    prefix = workdir_name + "/"
    urls = {name[len(prefix):]: url for name, url in listed if name.startswith(prefix)}
    top = dict(listed)
    progress = Progress.from_output(_small_json(client, urls.get("progress.json"), meta / "progress.json"),
                                    f"{owner}/{slug} progress.json")
    marker = _small_json(client, top.get(MARKER_FILE), meta / MARKER_FILE)
    found = (progress.run_id if progress else None) or (marker or {}).get("run_id")
    if reserve is None:
        reserve = int(float(os.environ.get(RESERVE_ENV, DEFAULT_RESERVE / (1 << 20))) * (1 << 20))
    out = HandoffDownload(client, root, urls, log_text, progress, found, reserve=reserve)
    out.candidates = _candidates(client, urls, meta)
    return out


def _candidates(client: KaggleClient, urls: Dict[str, str], meta: Path) -> List[Candidate]:
    """Checkpoints whose manifest is valid and whose every file is in the output, newest first."""
    folders: Dict[str, Dict[str, str]] = {}
    for name, url in urls.items():
        m = _CKPT.match(name)
        if m:
            folders.setdefault(m.group(1), {})[m.group(2)] = url
    found = []
    for folder, files in folders.items():
        if MANIFEST not in files:
            continue  # a save still in progress (or killed): never valid
        local = meta / folder
        local.mkdir()
        try:
            stream_verified(client, files[MANIFEST], local / MANIFEST)
        except ChecksumMismatch:
            continue
        manifest = read_manifest(local)
        if manifest is None or not all(f in files for f in manifest["files"]):
            continue
        found.append(Candidate(folder, int(manifest["step"]), seq_of(folder), manifest,
                               {f: files[f] for f in manifest["files"]}))
    return sorted(found, key=lambda c: (c.step, c.manifest.get("created", 0), c.seq), reverse=True)


def _small_json(client: KaggleClient, url: Optional[str], target: Path) -> Optional[dict]:
    if url is None:
        return None
    stream_verified(client, url, target)
    try:
        return json.loads(target.read_text())
    except ValueError:
        return None


# -- disk -------------------------------------------------------------------------------------------
def free_bytes(path: Path) -> int:
    path = Path(path).resolve()
    while not path.exists():
        path = path.parent
    return disk_usage(path).free


def ensure_space(where: Path, need: int, reserve: int, what: str) -> None:
    free = free_bytes(where)
    if need + reserve > free:
        raise DiskSpaceError(
            f"handoff: {what} needs {size_text(need)} (+{size_text(reserve)} reserve, {RESERVE_ENV})"
            f" on {Path(where).resolve()} but only {size_text(free)} is free; free some space, the next tick retries")


# -- streaming --------------------------------------------------------------------------------------
def head_size(client: KaggleClient, url: str) -> int:
    import requests

    def head() -> int:
        with requests.head(url, timeout=request_timeout(), allow_redirects=True) as response:
            response.raise_for_status()
            return int(response.headers.get("Content-Length") or 0)

    return call(head, client.policy, "size of an output file")


def stream_verified(client: KaggleClient, url: str, target: Path, expected_bytes: Optional[int] = None,
                    algo: Optional[str] = None, expected: Optional[str] = None) -> str:
    """GET `url` into `target` in chunks, checking size (and `algo` digest) as bytes arrive; returns the
    file's sha256. Transport failures are retried; a mismatch against the manifest is not (the bytes on the
    server are wrong) and raises ChecksumMismatch with nothing left behind."""
    import requests

    partial = target.with_name(target.name + ".part")

    def get() -> str:
        with requests.get(url, stream=True, timeout=request_timeout()) as response:
            response.raise_for_status()
            length = response.headers.get("Content-Length")
            hasher, got = _Hasher(algo), 0
            try:
                with open(partial, "wb") as out:
                    for chunk in response.iter_content(CHUNK):
                        got += len(chunk)
                        if expected_bytes is not None and got > expected_bytes:
                            raise ChecksumMismatch(f"{target.name}: more than the manifest's {expected_bytes} bytes")
                        hasher.feed(chunk)
                        out.write(chunk)
            finally:
                sha, digest = hasher.result()
            if length is not None and got != int(length):
                raise requests.ConnectionError(f"short read: {got} of {length} bytes")
            if expected_bytes is not None and got != expected_bytes:
                raise ChecksumMismatch(f"{target.name}: {got} bytes, the manifest says {expected_bytes}")
            if expected is not None and digest != expected:
                raise ChecksumMismatch(f"{target.name}: {algo} does not match its manifest")
            os.replace(partial, target)
            return sha

    try:
        return call(get, client.policy, f"download {target.name}")
    finally:
        partial.unlink(missing_ok=True)


class _Hasher:
    """sha256 (and crc32 when the manifest uses it) on a second thread, so hashing overlaps receiving and
    writing (hashlib and zlib release the GIL). A bounded queue keeps memory constant: at most QUEUED chunks."""

    QUEUED = 8

    def __init__(self, algo: Optional[str]):
        self.algo, self.sha, self.crc = algo, hashlib.sha256(), 0
        self.queue: "queue.Queue[Optional[bytes]]" = queue.Queue(self.QUEUED)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (chunk := self.queue.get()) is not None:
            self.sha.update(chunk)
            if self.algo == "crc32":
                self.crc = zlib.crc32(chunk, self.crc)

    def feed(self, chunk: bytes) -> None:
        self.queue.put(chunk)

    def result(self) -> Tuple[str, str]:
        """(sha256, the digest in the manifest's algorithm) once every chunk fed is hashed."""
        self.queue.put(None)
        self.thread.join()
        sha = self.sha.hexdigest()
        return sha, (f"{self.crc:08x}" if self.algo == "crc32" else sha)

