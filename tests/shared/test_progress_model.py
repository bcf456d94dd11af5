"""progress.json as one typed model (relay/shared/progress.py): read by every orchestrator module through its
attributes, written by the kernel through it; the documents of earlier kernels still read, a newer one's keys kept."""
import json
from pathlib import Path

import pytest

from relay.shared.errors import InputError
from relay.shared.progress import FORMAT, Charge, Progress, SessionRecord

OLD = Path(__file__).parents[1] / "data" / "old-layout-toy" / "workdir" / "progress.json"


def test_an_old_kernels_document_reads_and_writes_back_the_same():
    """The fixture an earlier kernel wrote (no `format`, no `charges`, no `saving_s`): format 0, every field an
    attribute, and written back key for key (no null added for what it did not have)."""
    raw = json.loads(OLD.read_text())
    progress = Progress.load(OLD)
    assert progress.format == 0 and progress.global_step == 10 and progress.total_steps == 24
    assert progress.best["metric"] == "mse" and progress.checkpoint == "checkpoints/step-00000010"
    (s,) = progress.sessions
    assert (s.index, s.step_start, s.step_end, s.stop_reason, s.saving_s) == (1, 0, 10, "steps", None)
    assert s.gpus == {"count": 0, "names": []} and progress.charges == ()
    assert progress.to_dict() == raw
    assert json.dumps(progress.to_dict(), sort_keys=True) == json.dumps(raw, sort_keys=True)


def test_a_document_made_here_writes_exactly_what_it_was_given():
    made = Progress.written(format=FORMAT, status="paused", run_id=None, global_step=3,
                            sessions=(SessionRecord.from_dict({"index": 1, "run_id": None, "seconds": 2.0}),))
    assert made.to_dict() == {"format": FORMAT, "status": "paused", "run_id": None, "global_step": 3,
                              "sessions": [{"index": 1, "run_id": None, "seconds": 2.0}]}
    again = Progress.from_json(json.dumps(made.to_dict()))
    assert again == made and again.to_dict() == made.to_dict()


def test_charges_round_trip_and_are_attributes():
    doc = {"global_step": 5, "sessions": [{"index": 1, "run_id": "r-s001-a1", "step_start": 0, "step_end": 5}],
           "charges": [{"run_id": "r-s001-a1", "wedged": False, "pushed_at": 10.0, "process_end": 70.5},
                       {"run_id": "r-s002-a1", "wedged": True, "failed": "wedged", "kaggle_end_seen": 99.0}]}
    progress = Progress.from_dict(doc)
    assert progress.charge_of("r-s001-a1").pushed_at == 10.0
    assert [c.failed for c in progress.charges] == [None, "wedged"]
    assert progress.to_dict() == doc
    grown = progress.with_charges([*progress.charges, Charge.from_dict({"run_id": "r-s003-a1", "wedged": False})])
    assert grown.to_dict()["charges"][-1] == {"run_id": "r-s003-a1", "wedged": False}
    assert progress.to_dict() == doc  # frozen: the one read is unchanged


def test_a_newer_writers_keys_are_kept_not_a_crash():
    doc = {"format": FORMAT + 1, "global_step": 7, "new_top": {"a": 1},
           "sessions": [{"index": 1, "step_start": 0, "step_end": 7, "cpu_model": "x", "future": [1, 2]}]}
    progress = Progress.from_dict(doc)
    assert progress.format == FORMAT + 1 and progress.global_step == 7
    assert progress.get_extra("new_top") == {"a": 1} and progress.sessions[0].get_extra("future") == [1, 2]
    assert progress.to_dict() == doc


@pytest.mark.parametrize("doc, field", [
    ([1, 2], "expected a JSON object"),
    ({"sessions": {"index": 1}}, "sessions: expected a list"),
    ({"sessions": [3]}, "sessions[0]: expected a JSON object"),
    ({"sessions": [{"step_end": "ten"}]}, "sessions[0]: step_end: expected a whole number"),
    ({"global_step": 2.5}, "global_step: expected a whole number"),
    ({"charges": [None]}, "charges[0]: expected a JSON object"),
])
def test_a_malformed_document_is_one_line_naming_the_file_and_field(doc, field):
    with pytest.raises(InputError) as err:
        Progress.from_dict(doc, "runs/x/progress.json")
    assert str(err.value).startswith("runs/x/progress.json: ") and field in str(err.value)
    assert "\n" not in str(err.value)


def test_not_json_names_the_file(tmp_path):
    path = tmp_path / "progress.json"
    path.write_text('{"global_step": 3')
    with pytest.raises(InputError, match=f"{path}: unreadable progress.json, not JSON"):
        Progress.load(path)


# -- every reader goes through the model ------------------------------------------------------------------------
ROOT = Path(__file__).parents[2]
# Keys that name a progress.json field, a session record's or a charge's and no other document's the readers hold:
# the model's fields less those a `relay-progress` line, the session plan or a lease also has (a `.get` of those
# is theirs) and less bookkeeping words any dict may use.
SHARED_WITH_OTHER_DOCUMENTS = {
    "step", "kind", "loss", "lr", "samples_per_s", "micro_batch", "grad_accum", "stage", "epoch", "run_id", "session",
    "step_start", "total_steps", "status", "stop_reason", "why", "time", "time_left_s",  # relay-progress lines
    "pushed_at", "charges", "budget", "timeout_s",  # the session plan
    "started", "name", "index", "format", "metrics", "checkpoint", "seconds", "failed", "precision",  # any dict's
    "world_size", "peak_mem_mb", "loss_end", "gpus",  # the session table's rows (report.session_table)
    "best", "code_version",  # a checkpoint's manifest and meta
    "wedged",  # a goodput category
}
# Names a progress document is held by: any subscript or .get on them is a read around the model.
DOCUMENT_NAMES = {"progress", "published"}
# Names of what is not one though it has a field of the same name: a flow's result (its `sessions` a count) and the
# relays table's rows.
NOT_DOCUMENTS = {"summary", "r", "row"}
# The model, and the kernel, which builds the records it writes (books.py, core.py: the writer's own working
# record) and writes them through the model; the emulator stands for Kaggle, not a reader.
OUTSIDE = ("relay/shared/progress.py", "relay/kernel/", "relay/emulator/")


def progress_keys() -> set:
    from dataclasses import fields

    names = {f.name for cls in (Progress, SessionRecord, Charge) for f in fields(cls)} - {"extra", "present"}
    return names - SHARED_WITH_OTHER_DOCUMENTS


def reads_around_the_model(tree, keys: set) -> list:
    """(line, text) of each `.get("key")`/`["key"]` of a progress key, and each `.get(`/`[...]` on a name in
    DOCUMENT_NAMES (`progress.get(...)`, `obs.published["..."]`)."""
    import ast

    def named(node) -> bool:
        if isinstance(node, ast.BoolOp):  # (progress or {}).get(...)
            return named(node.values[0])
        return (isinstance(node, ast.Name) and node.id in DOCUMENT_NAMES) or \
            (isinstance(node, ast.Attribute) and node.attr in DOCUMENT_NAMES)

    def key(node):
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and node.args:
            receiver, k = node.func.value, key(node.args[0])
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):  # a write builds a document
            receiver, k = node.value, key(node.slice)
        else:
            continue
        if isinstance(receiver, ast.Name) and receiver.id in NOT_DOCUMENTS:
            continue
        if k in keys or (named(receiver) and k is not None):
            found.append((node.lineno, ast.unparse(node)))
    return found


def source_files(root: Path):
    for folder in ("relay", "flows", "tasks"):
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if not rel.startswith(OUTSIDE):
                yield rel, path


def test_no_reader_reads_a_progress_document_around_the_model():
    """Every orchestrator-side reader (relay/orchestrator, relay/commands.py, relay/launch.py, relay/shared, flows/,
    tasks/) reads progress.json, its sessions and charges through the model's attributes, not by key."""
    import ast

    keys = progress_keys()
    assert {"global_step", "sessions", "step_end", "saving_s", "weights_sha256", "process_end"} <= keys
    hits = [f"{rel}:{line}: {text}" for rel, path in source_files(ROOT)
            for line, text in reads_around_the_model(ast.parse(path.read_text()), keys)]
    assert not hits, "read by key, not through relay/shared/progress.py:\n" + "\n".join(hits)


def test_the_scan_finds_reads_by_key():
    """The scan is not blind: the forms the readers used before the model are each found (on main before this
    model it found 175 reads in 20 modules), a progress line's `step` is not."""
    import ast

    old = '''
total = progress.get("total_steps") or 0
steps = [s.get("step_end") for s in doc.get("sessions") or []]
done = obs.published["status"] == "done"
wedged = c.get("process_end")
line = record.get("step")
'''
    found = [text for _, text in reads_around_the_model(ast.parse(old), progress_keys())]
    assert sorted(found) == sorted(["progress.get('total_steps')", "s.get('step_end')", "doc.get('sessions')",
                                    "obs.published['status']", "c.get('process_end')"]), found
