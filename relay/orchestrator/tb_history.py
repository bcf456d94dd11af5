"""The relay's TensorBoard log carried from checkpoint to checkpoint without growing with the run (issue 61).

Each checkpoint version holds the log as two parts: the handed-over session's own event files, cut at the
checkpoint's step (relay/orchestrator/tracking_handoff.py), and one history file, HISTORY, the sessions before it
compacted: every tag keeps at most MAX_EVENTS events, evenly spaced by step, the last always kept. At each
hand-over the previous version's parts (its history and its session's files) become the new history. What a
hand-over moves is then one session's events and a history of bounded size, whatever the run's length (it used
to carry, download and publish every session's files whole, from version to version).

TensorBoard itself shows at most 1,000 points of a scalar tag by default (its reservoir), so a history of 2,000
per tag shows what TensorBoard would have shown. Events are read and written with TensorBoard's own record
reader and writer, as the cut does; restart markers are dropped (after the cut they purge nothing).
"""
from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path
from typing import Iterable, List, Optional

log = logging.getLogger(__name__)
HISTORY = "events.out.tfevents.0000000000.relay-history"  # sorts first: the sessions' files follow it
MAX_EVENTS = 2000  # per tag, in the history


def is_event_file(name: str) -> bool:
    return "tfevents" in Path(name).name


def previous_files(backend, dataset: str, dest: Path, local: Optional[Path] = None) -> List[Path]:
    """The published checkpoint's event files (its history and its session's own): those `local` holds as
    published (the orchestrator's mirror, `<state_dir>/<name>/tensorboard`, the same name and size) read from
    there, the others downloaded into `dest`; [] when there is none. A file that cannot be had is a warning: a
    tracker never fails a hand-over."""
    try:
        published = [f for f in backend.list_dataset_files(dataset) if is_event_file(f.name)]
    except Exception as err:  # noqa: BLE001
        log.warning("TensorBoard: the published checkpoint's files could not be listed (%s)", err)
        return []
    found = []
    for f in sorted(published, key=lambda f: f.name):
        mirrored = local / f.name if local is not None else None
        if mirrored is not None and mirrored.is_file() and mirrored.stat().st_size == f.size:
            found.append(mirrored)
            continue
        try:
            found.append(backend.download_dataset_file(dataset, f.name, dest))
        except Exception as err:  # noqa: BLE001
            log.warning("TensorBoard: %s of the published checkpoint not fetched (%s); left out", f.name, err)
    return found


def compact(sources: Iterable[Path], dst: Path, max_events: int = MAX_EVENTS) -> int:
    """Write `dst` from the events of `sources` (the history before and a session's files): at most `max_events`
    per tag, evenly spaced by step and the last kept, one value per event; the first file-version event kept.
    Returns the events written."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto import event_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter

    head, by_tag = [], defaultdict(dict)  # tag -> {step: event}: a later file's event of a step wins
    for path in sources:
        for raw in RawEventFileLoader(str(path)).Load():
            event = event_pb2.Event.FromString(raw)
            if event.HasField("summary"):
                for value in event.summary.value:
                    one = event_pb2.Event(wall_time=event.wall_time, step=event.step)
                    one.summary.value.add().CopyFrom(value)
                    by_tag[value.tag][event.step] = one
            elif event.HasField("file_version") and not head:
                head.append(event)
    written = 0
    with open(dst, "wb") as f:
        writer = RecordWriter(f)
        for event in head + [e for tag in sorted(by_tag) for e in _spaced(by_tag[tag], max_events)]:
            writer.write(event.SerializeToString())
            written += 1
        writer.flush()
    return written


def _spaced(events: dict, max_events: int) -> list:
    """At most `max_events` of {step: event}, evenly spaced over the steps, the first and the last kept."""
    steps = sorted(events)
    if len(steps) > max_events:
        stride = (len(steps) - 1) / (max_events - 1)
        steps = sorted({steps[round(i * stride)] for i in range(max_events)})
    return [events[s] for s in steps]
