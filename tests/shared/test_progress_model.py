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
    with pytest.raises(InputError, match=f"{path}: not a JSON document"):
        Progress.load(path)
