"""The TensorBoard log carried from checkpoint to checkpoint (relay/orchestrator/tb_history.py): the sessions
before the handed-over one compacted into one history file, each tag at most MAX_EVENTS events, so what a
hand-over stages does not grow with the run; each step once, the last kept, what TensorBoard shows unchanged
while a tag has fewer events than that."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("tensorboard")

from tracking_fixtures import raw_steps, scalars  # noqa: E402


def write_events(path: Path, steps, tags=("train/loss", "train/lr"), restart_at=None) -> Path:
    """An event file as a SummaryWriter writes it: a file-version event, one scalar per event; a restart marker
    (purge_step) first when `restart_at`."""
    from tensorboard.compat.proto import event_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter

    with open(path, "wb") as f:
        writer = RecordWriter(f)
        writer.write(event_pb2.Event(wall_time=1.0, file_version="brain.Event:2").SerializeToString())
        if restart_at is not None:
            marker = event_pb2.Event(wall_time=1.0, step=restart_at)
            marker.session_log.status = event_pb2.SessionLog.START
            writer.write(marker.SerializeToString())
        for step in steps:
            for i, tag in enumerate(tags):
                event = event_pb2.Event(wall_time=2.0 + step, step=step)
                event.summary.value.add(tag=tag, simple_value=step * 0.5 + i)
                writer.write(event.SerializeToString())
        writer.flush()
    return path


def test_the_history_keeps_each_step_once_and_what_tensorboard_shows(tmp_path):
    from relay.orchestrator import tb_history

    one = write_events(tmp_path / "events.out.tfevents.1.a", range(10, 110, 10))
    two = write_events(tmp_path / "events.out.tfevents.2.b", range(110, 210, 10), restart_at=101)
    out = tmp_path / "out"
    out.mkdir()
    tb_history.compact([one, two], out / tb_history.HISTORY)
    assert raw_steps(out, "train/loss") == list(range(10, 210, 10)) == raw_steps(out, "train/lr")
    whole = tmp_path / "whole"
    whole.mkdir()
    for f in (one, two):
        (whole / f.name).write_bytes(f.read_bytes())
    assert scalars(out) == scalars(whole)


def test_a_tag_over_the_bound_keeps_evenly_spaced_steps_the_first_and_the_last(tmp_path):
    from relay.orchestrator import tb_history

    src = write_events(tmp_path / "events.out.tfevents.1.a", range(1, 1001))
    out = tmp_path / "out"
    out.mkdir()
    tb_history.compact([src], out / tb_history.HISTORY, max_events=100)
    kept = raw_steps(out, "train/loss")
    assert len(kept) == 100 and kept[0] == 1 and kept[-1] == 1000 and kept == sorted(set(kept))
    gaps = {b - a for a, b in zip(kept, kept[1:])}
    assert gaps <= {10, 11}, gaps  # evenly spaced


def test_what_a_hand_over_stages_does_not_grow_with_the_sessions(tmp_path):
    """Ten hand-overs of sessions of 500 logged steps, the history bounded at 200 events a tag: the bytes staged
    (the history and the session's own file) at the tenth are within 10 % of the second's (the first has no
    history). Unbounded, the history would grow by a session's events at every hand-over."""
    from relay.orchestrator import tb_history

    staged, previous = [], []
    for n in range(1, 11):
        stage = tmp_path / f"v{n}"
        stage.mkdir()
        own = write_events(stage / f"events.out.tfevents.{n}.s", range(500 * (n - 1) + 1, 500 * n + 1))
        parts = [own]
        if previous:
            tb_history.compact(previous, stage / tb_history.HISTORY, max_events=200)
            parts.append(stage / tb_history.HISTORY)
        staged.append(sum(p.stat().st_size for p in parts))
        previous = parts
    assert staged[9] <= 1.1 * staged[1], staged
    assert raw_steps(tmp_path / "v10", "train/loss")[-1] == 5000


def test_the_published_files_the_local_mirror_holds_are_not_downloaded_again(tmp_path):
    """The orchestrator's mirror holds what it published last: those files (the same name and size) are read from
    it; a file it lacks or holds otherwise (another orchestrator handed the session over) is downloaded."""
    from relay.orchestrator import tb_history
    from relay.orchestrator.kaggle.types import DatasetFile

    published = tmp_path / "published"
    published.mkdir()
    history = write_events(published / tb_history.HISTORY, range(10, 60, 10))
    own = write_events(published / "events.out.tfevents.2.s", range(60, 110, 10))
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / history.name).write_bytes(history.read_bytes())
    (mirror / own.name).write_bytes(own.read_bytes()[:-7])  # not what was published

    class Backend:
        downloads: list = []

        def list_dataset_files(self, dataset):
            return [DatasetFile(p.name, p.stat().st_size) for p in (history, own)] + [DatasetFile("state.pt", 9)]

        def download_dataset_file(self, dataset, name, dest):
            self.downloads.append(name)
            dest.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes((published / name).read_bytes())
            return dest / name

    backend = Backend()
    found = tb_history.previous_files(backend, "u/ckpt", tmp_path / "dl", mirror)
    assert backend.downloads == [own.name]
    assert [p.read_bytes() for p in found] == [history.read_bytes(), own.read_bytes()]
