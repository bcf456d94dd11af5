"""Read and cut a W&B offline run file (`run-<id>.wandb`), with W&B's own record protobuf.

The file is W&B's transaction log: a 7-byte header (":W&B", magic 0xBEE1, version 0), then 32 KiB blocks of
chunks, each `crc32 (4) | length (2) | type (1) | data`, a record split FIRST/MIDDLE/LAST across blocks (the
LevelDB log layout; the crc is zlib's crc32 of the data seeded with the crc of the type byte). wandb >= 0.19
ships no Python reader for it (wandb-core, in Go, writes and syncs it), so this is the ~60-line reader and
writer the orchestrator needs: which run a file belongs to, the steps it holds, and a copy without the history
rows a killed session logged after its last checkpoint (the next session logs those steps again). A torn tail
(a SIGKILLed writer) ends the read at the last whole record.
"""
from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Iterator, Optional

HEADER = struct.pack("<4sHB", b":W&B", 0xBEE1, 0)
BLOCK = 32768
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
_TYPE_CRC = {t: zlib.crc32(bytes([t])) & 0xFFFFFFFF for t in (FULL, FIRST, MIDDLE, LAST)}


def read_records(path: Path) -> Iterator[bytes]:
    """The serialized records of a .wandb file, in order; stops quietly at a torn or corrupt tail."""
    data = Path(path).read_bytes()
    if data[:len(HEADER)] != HEADER:
        raise ValueError(f"{path}: not a W&B run file (header {data[:7]!r})")
    pos, pending = len(HEADER), b""
    while pos + CHUNK_HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER:  # the block's zero padding
            pos += left
            continue
        crc, length, kind = struct.unpack_from("<IHB", data, pos)
        chunk = data[pos + CHUNK_HEADER:pos + CHUNK_HEADER + length]
        if kind not in _TYPE_CRC or len(chunk) < length or zlib.crc32(chunk, _TYPE_CRC[kind]) & 0xFFFFFFFF != crc:
            return
        pos += CHUNK_HEADER + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        else:
            yield pending + chunk
            pending = b""


def write_records(path: Path, records: list[bytes]) -> None:
    out, pos = bytearray(HEADER), len(HEADER)
    for record in records:
        first = True
        while True:
            left = BLOCK - pos % BLOCK
            if left < CHUNK_HEADER:
                out += b"\0" * left
                pos += left
                continue
            room = left - CHUNK_HEADER
            chunk, record = record[:room], record[room:]
            kind = (FULL if not record else FIRST) if first else (LAST if not record else MIDDLE)
            out += struct.pack("<IHB", zlib.crc32(chunk, _TYPE_CRC[kind]) & 0xFFFFFFFF, len(chunk), kind) + chunk
            pos += CHUNK_HEADER + len(chunk)
            first = False
            if not record:
                break
    Path(path).write_bytes(bytes(out))


def _parse(raw: bytes):
    from wandb.proto import wandb_internal_pb2

    record = wandb_internal_pb2.Record()
    record.ParseFromString(raw)
    return record


def run_id(path: Path) -> Optional[str]:
    """The id of the run a .wandb file belongs to (its run record)."""
    for raw in read_records(path):
        record = _parse(raw)
        if record.WhichOneof("record_type") == "run":
            return record.run.run_id
    return None


def history(path: Path) -> list[tuple[int, dict]]:
    """(step, {key: value}) of every history row, values decoded from W&B's JSON."""
    import json

    rows = []
    for raw in read_records(path):
        record = _parse(raw)
        if record.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
            rows.append((int(record.history.step.num), items))
    return rows


def cut(path: Path, max_step: int) -> int:
    """Rewrite `path` without the history rows past `max_step` (and without a torn tail); rows dropped."""
    kept, dropped = [], 0
    for raw in read_records(path):
        record = _parse(raw)
        if record.WhichOneof("record_type") == "history" and record.history.step.num > max_step:
            dropped += 1
            continue
        kept.append(raw)
    write_records(path, kept)
    return dropped


def append_rows(path: Path, rows: list[tuple[int, dict]]) -> int:
    """Append history rows (step, {key: value}) to a cut file: the rows a killed writer never wrote."""
    if not rows:
        return 0
    import json

    from wandb.proto import wandb_internal_pb2 as pb

    records = list(read_records(path))
    for step, values in rows:
        record = pb.Record()
        record.history.step.num = step
        for key, value in {**values, "_step": step}.items():
            item = record.history.item.add()
            item.key, item.value_json = key, json.dumps(value)
        records.append(record.SerializeToString())
    write_records(path, records)
    return len(rows)


def start_file(path: Path, run_id: str, project: str) -> None:
    """A file holding only the run record: a killed session's offline run that wandb-core never wrote."""
    from wandb.proto import wandb_internal_pb2 as pb

    record = pb.Record()
    record.run.run_id, record.run.project = run_id, project
    write_records(path, [record.SerializeToString()])
