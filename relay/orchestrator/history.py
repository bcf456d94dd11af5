"""The run's metrics history: published per session, kept whole on the orchestrator's side.

A session's kernel writes only its own lines into metrics.jsonl (it no longer carries the sessions before it),
so what a hand-over downloads and publishes does not grow with the run. Each checkpoint version carries:
- `metrics.jsonl`: the handed-over session's own lines, whole (W&B's fill and the local history read them);
- `history.jsonl`: the whole run so far, compacted to a bounded size (`compact`): what the curves need when the
  orchestrator's folder is new (a GitHub Actions tick keeps nothing between jobs). It is made from the previous
  version's history.jsonl and this session's lines only, so two orchestrators handing one session over stage
  the same bytes.

The orchestrator keeps the whole history in `<local>/history/metrics.jsonl` (`LocalHistory`), one block of lines
per handed-over session, keyed by (session index, run id) in `index.json` beside it. Appending is idempotent and
survives a kill: a session already there is skipped, a later or other one at the same index replaces what follows
(a restored older checkpoint, a salvaged session handed over again), and a kill between the lines and the index
leaves lines the index does not count, cut off at the next append. Sessions it never saw (handed over by another
orchestrator, or before this folder existed) are filled from the published history.jsonl, marked compacted.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional

from relay.shared import atomic
from relay.shared.progress import Progress, SessionRecord, sessions_of

log = logging.getLogger(__name__)

METRICS = "metrics.jsonl"
HISTORY = "history.jsonl"
# records kept per kind in history.jsonl: a chart is ~1000 px wide, so 2000 points draw the same curve; memory
# samples (as many as train lines by default) are a table's peaks, not a curve. Any other kind: DEFAULT_CAP.
CAPS = {"train": 2000, "memory": 500}
DEFAULT_CAP = 2000


def parse_lines(text: str) -> list[dict]:
    """The records of metrics.jsonl text; a torn line (a kill mid-write) and non-records are skipped."""
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), (int, float)):
            records.append(record)
    return records


def read_records(path: Optional[Path]) -> list[dict]:
    return parse_lines(Path(path).read_text()) if path is not None and Path(path).is_file() else []


def encode(records: Iterable[dict]) -> bytes:
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in records).encode()


def compact(records: Iterable[dict], caps: Optional[dict] = None) -> list[dict]:
    """At most about `caps[kind]` records per kind, whatever the run's length: one record per (kind, step) (a later
    session's wins, as report.dedupe_metrics), then per kind the step range cut into `cap` equal buckets, the last
    record of each kept, and each session's first record of the kind (so every session still shows). Records
    are kept whole, never averaged: a point of the curve is a line the session wrote. Ordered by session, step."""
    caps = CAPS if caps is None else caps
    latest: dict = {}
    for _, r in sorted(enumerate(records), key=lambda ir: (ir[1].get("session") or 0, ir[0])):
        latest[(r.get("kind") or "train", int(r["step"]))] = r
    by_kind: dict = {}
    for (kind, step), r in sorted(latest.items()):
        by_kind.setdefault(kind, []).append(r)
    kept = []
    for kind, rows in by_kind.items():
        cap = caps.get(kind, DEFAULT_CAP)
        if len(rows) <= cap:
            kept += rows
            continue
        low, high = int(rows[0]["step"]), int(rows[-1]["step"])
        width = (high - low + 1) / cap
        buckets: dict = {}
        firsts: dict = {}
        for r in rows:
            buckets[int((int(r["step"]) - low) / width)] = r
            firsts.setdefault(r.get("session"), r)
        kept += list({id(r): r for r in [*firsts.values(), *buckets.values()]}.values())
    return sorted(kept, key=lambda r: (r.get("session") or 0, int(r["step"]), r.get("kind") or "train"))


def next_history(previous: Iterable[dict], session: int, lines: Iterable[dict]) -> list[dict]:
    """history.jsonl after session `session`: the earlier sessions of the previous history (or of an old
    checkpoint's whole metrics.jsonl) and this session's lines, compacted."""
    return compact([r for r in previous if (r.get("session") or 0) < session] + list(lines))


class LocalHistory:
    """The whole metrics history of one relay in `<local>/history/`: metrics.jsonl (every handed-over session's
    lines, oldest first) and index.json ({"blocks": [{"index", "run_id", "start", "end", "lines",
    "compacted"}]}, byte offsets into metrics.jsonl, written after the lines it counts)."""

    def __init__(self, local: Path):
        self.folder = Path(local) / "history"
        self.path = self.folder / METRICS
        self.index_path = self.folder / "index.json"

    def sessions(self) -> list[dict]:
        try:
            return list(json.loads(self.index_path.read_text()).get("blocks") or [])
        except (OSError, ValueError):
            return []

    def has(self, index: int, run_id: Optional[str]) -> bool:
        """Whether session `index` of run `run_id` is here, with every session before it."""
        kept = self.sessions()
        return bool(kept) and any(s["index"] == index and s["run_id"] == run_id for s in kept) \
            and [s["index"] for s in kept if s["index"] <= index] == list(range(1, index + 1))

    def add(self, index: int, run_id: Optional[str], lines: Iterable[dict],
            earlier: Callable[[], Iterable[dict]] = lambda: (), run_ids: Optional[dict] = None) -> bool:
        """Append session `index` (run `run_id`): its `lines` (only records of that session are kept). Sessions
        before it that are missing here come from `earlier()` (the published, compacted history), called only
        then, keyed by `run_ids` ({index: run id}, from progress.json's sessions). False when it was here
        already. One writer at a time (the flow and `relay status` may share it)."""
        import fcntl

        if self.has(index, run_id):
            return False
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return not self.has(index, run_id) and self._append(index, run_id, lines, earlier, run_ids or {})

    def _append(self, index: int, run_id: Optional[str], lines: Iterable[dict],
                earlier: Callable[[], Iterable[dict]], run_ids: dict) -> bool:
        # every append keeps the index a run 1..k with rising offsets, so what is missing before `index` follows k
        kept = [s for s in self.sessions() if s["index"] < index]
        if [s["index"] for s in kept] != list(range(1, len(kept) + 1)):  # an index not written here: start over
            kept = []
        end = kept[-1]["end"] if kept else 0
        blocks: list = []
        missing = range(len(kept) + 1, index)
        if missing:  # sessions this folder did not see: the published history's, compacted
            by_session: dict = {}
            for r in earlier():
                by_session.setdefault(r.get("session"), []).append(r)
            blocks = [({"index": i, "run_id": run_ids.get(i), "compacted": True}, encode(by_session.get(i, [])))
                      for i in missing]
        own = [r for r in lines if r.get("session") == index]
        blocks.append(({"index": index, "run_id": run_id, "compacted": False}, encode(own)))
        with open(self.path, "r+b" if self.path.exists() else "wb") as f:
            f.truncate(end)  # lines a killed append wrote past the index, or of sessions replaced now
            f.seek(end)
            for entry, data in blocks:
                f.write(data)
                kept.append({**entry, "start": end, "end": end + len(data), "lines": data.count(b"\n")})
                end += len(data)
            f.flush()
            os.fsync(f.fileno())
        atomic.write_json(self.index_path, {"blocks": kept})
        log.info("metrics history: session %d (%s) kept locally, %d lines, %s", index, run_id, len(own), self.path)
        return True


# -- the published side: what a hand-over stages, and what a reader with a new folder fetches ---------------
def previous_records(backend, dataset: str, dest: Path) -> list[dict]:
    """The run so far as the published checkpoint has it: its history.jsonl, or, for a checkpoint published
    before there was one, its metrics.jsonl (which then carried the whole run). [] when there is none."""
    from relay.orchestrator.kaggle.types import NotFound

    for name in (HISTORY, METRICS):
        try:
            return read_records(backend.download_dataset_file(dataset, name, dest))
        except NotFound:
            continue
    return []


def stage(stage_dir: Path, session: int, previous: list[dict]) -> list[dict]:
    """Write `stage_dir/history.jsonl` from the previous history and the staged metrics.jsonl (this session's
    lines); returns this session's records."""
    own = [r for r in read_records(stage_dir / METRICS) if r.get("session") == session]
    atomic.write_bytes(stage_dir / HISTORY, encode(next_history(previous, session, own)))
    return own


def session_key(progress: Progress | Mapping, run_id: Optional[str] = None) -> tuple[int, Optional[str]]:
    """(index, run id) of the last session in `progress`: the key of its lines in the local history."""
    progress = Progress.read(progress)
    last = progress.last_session or SessionRecord()
    return int(last.index or max(1, len(progress.sessions))), last.run_id or run_id or progress.run_id


def run_ids(progress: Progress | Mapping) -> dict:
    """{session index: run id} of progress.json's sessions."""
    return {s.index: s.run_id for s in sessions_of(progress) if s.index is not None}


def local_metrics(backend, dataset: str, local: Path, progress: Progress | Mapping) -> Optional[Path]:
    """The whole history of the run up to `progress`'s last session, in `local` (LocalHistory): what the curves,
    the summary and `relay status` read. Only a session this folder did not see is downloaded (its published
    metrics.jsonl; the sessions before it from history.jsonl, once). None when nothing is published or logged."""
    from relay.orchestrator.kaggle.types import NotFound

    history = LocalHistory(local)
    if not sessions_of(progress):
        return _drawable(history.path)
    index, run_id = session_key(progress)
    if not history.has(index, run_id):
        tmp = Path(local) / "published" / "history-tmp"
        try:
            own = read_records(backend.download_dataset_file(dataset, METRICS, tmp))
        except NotFound:
            return _drawable(history.path)
        if own and not any(r.get("session") == index for r in own):  # a newer version than `progress`: later
            return _drawable(history.path)
        history.add(index, run_id, own, earlier=lambda: previous_records(backend, dataset, tmp),
                    run_ids=run_ids(progress))
    return _drawable(history.path)


def _drawable(path: Path) -> Optional[Path]:
    """The history when it holds a line (a session that logged nothing, a user loop crashing before its first log
    step, leaves an empty one): None tells every reader there is nothing to draw."""
    return path if path.is_file() and path.stat().st_size > 0 else None
