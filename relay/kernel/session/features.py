"""Parquet feature cache: expensive preprocessing is built once and read back memory-mapped.

An entry is `<dir>/<name>-<key16>.parquet` plus `<name>-<key16>.json` (the meta, written LAST). The key is
a sha256 over (content hashes of the input files, the build parameters, a code version), so a changed
input, parameter or extraction code misses and rebuilds. Input files are identified by their relative
name and content, not their absolute path: features built locally hit on Kaggle where the same files sit
under /kaggle/input.

Input hashing is honest content hashing (sha256). To avoid re-reading large unchanged inputs, the
writable dir keeps a memo `file-hashes.json` of (absolute path, size, mtime_ns) -> sha256; a file rewritten
in place with identical size AND mtime_ns would be missed (the same trade-off make and rsync take). Pass
`trust_mtime=False` to always re-hash.

Reads go through `pyarrow.memory_map` (the file is mapped, not read() into a buffer); parquet decoding still
allocates the columns, so a hit costs a decode, not an extraction.

Integrity on read: the meta must name the same key, the file size must match, and the parquet is written
with page checksums that pyarrow verifies while decoding; any failure counts as a miss and rebuilds. The
meta also records the parquet's sha256 for whoever publishes the cache (e.g. as a Kaggle dataset).

Several dirs: the first is writable (the session's own cache); later ones are read-only mounts that are
used when they hit. Builds always go to the first.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from relay.shared import atomic
from relay.shared.errors import InputError

log = logging.getLogger(__name__)

FORMAT = 1
_NAME_OK = re.compile(r"^[A-Za-z0-9_.-]+$")
_HASH_MEMO = "file-hashes.json"
_CHUNK = 1 << 20


# ---------------------------------------------------------------------------------------------- fingerprints
def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def source_version(*objects: Any) -> str:
    """A code version from the source text of functions/classes/modules (changes when any of them is edited)."""
    digest = hashlib.sha256()
    for obj in objects:
        digest.update(inspect.getsource(obj).encode())
    return digest.hexdigest()[:16]


def _input_files(inputs: Iterable[str | os.PathLike]) -> list[tuple[str, Path]]:
    """(stable name, path) for every input; a directory contributes its files by relative path."""
    files = []
    for raw in inputs:
        path = Path(raw)
        if path.is_dir():
            files += [(f"{path.name}/{p.relative_to(path).as_posix()}", p) for p in sorted(path.rglob("*")) if p.is_file()]
        elif path.is_file():
            files.append((path.name, path))
        else:
            raise InputError(f"feature cache input {path}: no such file or directory")
    return files


def fingerprint(
    inputs: Iterable[str | os.PathLike],
    params: Mapping[str, Any],
    version: str,
    hasher: Callable[[Path], str] = file_sha256,
) -> tuple[str, dict]:
    """Return (key, detail): key is a sha256 hex string; detail is what it was computed from (kept in the meta)."""
    detail = {
        "inputs": [{"name": name, "bytes": p.stat().st_size, "sha256": hasher(p)} for name, p in _input_files(inputs)],
        "params": json.loads(json.dumps(dict(params), sort_keys=True, default=str)),
        "version": version,
    }
    canonical = json.dumps(detail, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest(), detail


class _HashMemo:
    """sha256 of input files memoised by (absolute path, size, mtime_ns) in the writable cache dir."""

    def __init__(self, path: Path | None):
        self.path = path
        self.entries: dict[str, dict] = {}
        self.dirty = False
        if path is not None and path.is_file():
            try:
                self.entries = json.loads(path.read_text())
            except (OSError, ValueError):
                self.entries = {}  # a broken memo only costs re-hashing

    def sha256(self, file: Path) -> str:
        stat = file.stat()
        key = str(file.resolve())
        hit = self.entries.get(key)
        if hit and hit["bytes"] == stat.st_size and hit["mtime_ns"] == stat.st_mtime_ns:
            return hit["sha256"]
        digest = file_sha256(file)
        self.entries[key] = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest}
        self.dirty = True
        return digest

    def save(self) -> None:
        if self.path is None or not self.dirty:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic.write_bytes(self.path, json.dumps(self.entries, indent=0, sort_keys=True).encode())
            self.dirty = False
        except OSError as exc:
            log.warning("feature cache: could not save %s (%s); inputs will be re-hashed", self.path, exc)


# ------------------------------------------------------------------------------------------------ the cache
@dataclass
class CacheEvent:
    name: str
    key: str
    hit: bool
    path: Path
    seconds: float


class FeatureCache:
    """`FeatureCache([writable_dir, *read_only_dirs]).get_or_build(name, inputs, params, version, build)`."""

    def __init__(self, dirs: Sequence[str | os.PathLike], *, trust_mtime: bool = True, compression: str = "zstd"):
        if not dirs:
            raise ValueError("FeatureCache needs at least one directory (the first one is written)")
        self.dirs = [Path(d) for d in dirs]
        self.compression = compression
        self.events: list[CacheEvent] = []
        self._memo = _HashMemo(self.dirs[0] / _HASH_MEMO if trust_mtime else None)

    def key(self, inputs: Iterable[str | os.PathLike], params: Mapping[str, Any], version: str) -> tuple[str, dict]:
        hasher = self._memo.sha256 if self._memo.path is not None else file_sha256
        return fingerprint(inputs, params, version, hasher)

    def get_or_build(
        self,
        name: str,
        inputs: Iterable[str | os.PathLike],
        params: Mapping[str, Any],
        version: str,
        build: Callable[[], pa.Table],
    ) -> pa.Table:
        """The cached table for this fingerprint, or `build()`'s result written to the first dir."""
        if not _NAME_OK.match(name):
            raise ValueError(f"feature cache name {name!r}: expected letters, digits, '_', '.', '-' only")
        start = time.perf_counter()
        key, detail = self.key(inputs, params, version)
        for directory in self.dirs:
            table = self._read(directory, name, key)
            if table is not None:
                self._memo.save()
                self._record(name, key, True, _paths(directory, name, key)[0], start)
                return table
        table = build()  # may refuse the inputs (InputError): then nothing is written, not even the memo
        self._memo.save()
        if not isinstance(table, pa.Table):
            raise TypeError(f"feature cache build for {name!r} returned {type(table).__name__}, expected pyarrow.Table")
        path = self._write(name, key, detail, table, build_seconds=time.perf_counter() - start)
        self._record(name, key, False, path, start)
        # Hand back the written file, memory-mapped, so a hit and a miss return the same thing.
        return self._read(self.dirs[0], name, key) or table

    def path(self, name: str, key: str) -> Path | None:
        """The parquet file of an entry that is present and valid in any dir, else None."""
        for directory in self.dirs:
            if self._read(directory, name, key) is not None:
                return _paths(directory, name, key)[0]
        return None

    # -------------------------------------------------------------------------------------------- internals
    def _read(self, directory: Path, name: str, key: str) -> pa.Table | None:
        parquet_path, meta_path = _paths(directory, name, key)
        if not meta_path.is_file():
            return None
        try:
            meta = json.loads(meta_path.read_text())
            if meta.get("format") != FORMAT or meta.get("key") != key:
                raise ValueError("meta names another key or format")
            if parquet_path.stat().st_size != meta["bytes"]:
                raise ValueError(f"size {parquet_path.stat().st_size} != {meta['bytes']} in meta")
            with pa.memory_map(str(parquet_path), "r") as source:  # no read() copy of the file
                table = pq.read_table(source, page_checksum_verification=True)
            if table.num_rows != meta["rows"] or table.column_names != meta["columns"]:
                raise ValueError("rows/columns differ from meta")
            return table
        except (OSError, ValueError, KeyError, TypeError, pa.ArrowException) as exc:
            log.warning("feature cache: ignoring invalid entry %s (%s); it will be rebuilt", parquet_path, exc)
            return None

    def _write(self, name: str, key: str, detail: dict, table: pa.Table, build_seconds: float) -> Path:
        directory = self.dirs[0]
        directory.mkdir(parents=True, exist_ok=True)
        parquet_path, meta_path = _paths(directory, name, key)
        # Invalidate first: a crash between the two renames below must never pair an old meta with a new file.
        meta_path.unlink(missing_ok=True)
        tmp = parquet_path.with_name(f".{parquet_path.name}.tmp-{os.getpid()}")
        pq.write_table(table, tmp, compression=self.compression, write_page_checksum=True)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, parquet_path)
        atomic.fsync(directory)
        meta = {
            "format": FORMAT,
            "name": name,
            "key": key,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "rows": table.num_rows,
            "columns": table.column_names,
            "bytes": parquet_path.stat().st_size,
            "sha256": file_sha256(parquet_path),
            "build_seconds": round(build_seconds, 3),
            "fingerprint": detail,
        }
        atomic.write_bytes(meta_path, json.dumps(meta, indent=1).encode())
        return parquet_path

    def _record(self, name: str, key: str, hit: bool, path: Path, start: float) -> None:
        event = CacheEvent(name, key, hit, path, time.perf_counter() - start)
        self.events.append(event)
        log.info("feature cache %s: %s (%s, %.2fs)", "hit" if hit else "built", name, path, event.seconds)


def _paths(directory: Path, name: str, key: str) -> tuple[Path, Path]:
    stem = f"{name}-{key[:16]}"
    return directory / f"{stem}.parquet", directory / f"{stem}.json"
