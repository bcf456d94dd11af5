"""The checkpoint manifest, the part of a checkpoint both sides of the wire read: a session writes it
(relay.kernel.session.checkpoint), the orchestrator verifies a downloaded or mounted copy before it hands it on.
No torch: a manifest lists each file's size and digest, and verifying needs only those.

A checkpoint is a folder `step-<8 digits>[.<seq>]` holding state.pt and manifest.json
({"format", "step", "files": {name: {"bytes", "crc32"|"sha256"}}, "created", run meta}).
"""
from __future__ import annotations

import hashlib
import json
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

FORMAT = 1
STATE_FILE = "state.pt"
MANIFEST = "manifest.json"
NAME = re.compile(r"^step-(\d{8})(?:\.(\d+))?$")
@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    seq: int  # several saves at one step get .1, .2, ...
    manifest: dict

    @property
    def metric(self) -> Optional[float]:
        """The watched metric of THIS checkpoint's weights. Every manifest carries the run's best-so-far
        record; only the checkpoint saved at that record's step holds the weights that scored it."""
        best = self.manifest.get("best") or {}
        if best.get("value") is None or best.get("step") != self.step:
            return None
        return float(best["value"])

    def nbytes(self) -> int:
        return sum(f["bytes"] for f in self.manifest["files"].values())


# -- durability helpers ---------------------------------------------------------------------------
DIGESTS = ("crc32", "sha256")


class Checksum:
    """A running checksum. crc32 (~3 GB/s) catches torn and corrupted files at a fraction of a save's cost;
    sha256 runs at 200-400 MB/s on CPUs without SHA extensions, slower than torch.save itself (measured in
    bench/bench_checkpoint.py), so it is opt-in (`checkpoints.digest`). Published datasets get sha256 anyway."""

    def __init__(self, algo: str):
        if algo not in DIGESTS:
            raise ValueError(f"checkpoint digest {algo!r}: expected one of {', '.join(DIGESTS)}")
        self.algo = algo
        self._crc = 0
        self._sha = hashlib.sha256() if algo == "sha256" else None

    def update(self, data) -> None:
        if self._sha is not None:
            self._sha.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def hexdigest(self) -> str:
        return self._sha.hexdigest() if self._sha is not None else f"{self._crc:08x}"


def file_digest(path: Path, algo: str, chunk: int = 8 << 20) -> str:
    checksum = Checksum(algo)
    with open(path, "rb") as f:
        while block := f.read(chunk):
            checksum.update(block)
    return checksum.hexdigest()


def sha256_file(path: Path) -> str:
    return file_digest(path, "sha256")


def digest_of(info: dict) -> tuple[str, str]:
    """(algorithm, expected hex) recorded for one file in a manifest."""
    for algo in DIGESTS:
        if isinstance(info.get(algo), str):
            return algo, info[algo]
    raise KeyError("no digest")

def seq_of(name: str) -> int:
    m = NAME.match(name)
    return int(m.group(2) or 0) if m else 0

def size_text(nbytes: float) -> str:
    """Bytes in the largest unit that still shows them (a 40 KB checkpoint is not "0.00 GB")."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} bytes"

def find_checkpoints(root: Path) -> list[Path]:
    """Checkpoint folders in `root`: root itself, root/step-*, or root/checkpoints/step-*."""
    root = Path(root)
    if (root / MANIFEST).is_file():
        return [root]
    found = []
    for base in (root, root / "checkpoints"):
        if base.is_dir():
            found += [p for p in base.iterdir() if p.is_dir() and NAME.match(p.name)]
    return found


def read_manifest(path: Path) -> Optional[dict]:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if manifest_ok(manifest) else None


def manifest_ok(manifest: Any) -> bool:
    """A manifest damaged into other valid JSON (a flipped bit in a key) counts as no manifest."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return False
    step, files = manifest.get("step"), manifest.get("files")
    if type(step) is not int or step < 0 or not isinstance(files, dict) or STATE_FILE not in files:
        return False
    return all(isinstance(info, dict) and type(info.get("bytes")) is int
               and any(isinstance(info.get(algo), str) for algo in DIGESTS) for info in files.values())


def list_valid(*roots: Path, verify_hashes: bool = False) -> list[Checkpoint]:
    """Checkpoints with a readable manifest and files of the right size, newest first."""
    out = []
    for root in roots:
        for path in find_checkpoints(root):
            manifest = read_manifest(path)
            if manifest is None:
                continue
            if not files_match(path, manifest, verify_hashes):
                continue
            out.append(Checkpoint(path, int(manifest["step"]), seq_of(path.name), manifest))
    return sorted(out, key=lambda c: (c.step, c.manifest.get("created", 0), c.seq), reverse=True)


def files_match(path: Path, manifest: dict, verify_hashes: bool) -> bool:
    for name, info in manifest["files"].items():
        f = path / name
        try:
            if f.stat().st_size != info["bytes"]:
                return False
        except OSError:
            return False
        if verify_hashes:
            algo, expected = digest_of(info)
            if file_digest(f, algo) != expected:
                return False
    return True

def why_unusable(root: Path) -> str:
    """What is wrong with the checkpoints in `root`, in a few words (for a folder list_valid/load reject)."""
    paths = find_checkpoints(root)
    if not paths:
        return f"no checkpoint in it (no {MANIFEST})"
    for path in paths:
        manifest = read_manifest(path)
        if manifest is None:
            return f"{MANIFEST} is missing or unreadable"
        for name, info in manifest["files"].items():
            size = (path / name).stat().st_size if (path / name).is_file() else None
            if size != info["bytes"]:
                return f"{name} is {'missing' if size is None else f'{size} bytes'}, its manifest says" \
                       f" {info['bytes']} (truncated)"
            algo, expected = digest_of(info)
            if file_digest(path / name, algo) != expected:
                return f"{name} {algo} mismatch"
    return f"{STATE_FILE} cannot be loaded"
