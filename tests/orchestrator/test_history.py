"""The run's metrics history (relay/orchestrator/history.py): history.jsonl stays bounded whatever the run's length,
and the orchestrator's local history takes each handed-over session once, in order, through a hand-over seen
twice, a kill between its lines and its index, a session replaced at the same index, and a new folder."""
from __future__ import annotations

import json

from relay.orchestrator import history, report


def lines(session: int, start: int, end: int, every: int = 1) -> list[dict]:
    out = []
    for step in range(start + every, end + 1, every):
        out.append({"session": session, "time": float(step), "kind": "train", "step": step, "loss": 1.0 / step})
        if step % 10 == 0:
            out.append({"session": session, "time": float(step), "kind": "memory", "step": step, "peak_mb": step})
    out.append({"session": session, "time": float(end), "kind": "eval", "step": end, "eval_loss": 1.0 / end})
    return out


def test_history_jsonl_stays_bounded_and_keeps_every_session():
    caps = {"train": 100, "memory": 20, "eval": 100}
    previous: list = []
    sizes = []
    for session in range(1, 11):
        own = lines(session, (session - 1) * 5000, session * 5000)
        previous = history.compact([r for r in previous if r["session"] < session] + own, caps)
        sizes.append(len(history.encode(previous)))
    kinds = [r["kind"] for r in previous]
    assert kinds.count("train") <= 100 + 10 and kinds.count("memory") <= 20 + 10 and kinds.count("eval") == 10
    assert {r["session"] for r in previous if r["kind"] == "train"} == set(range(1, 11))
    assert max(sizes[1:]) <= 1.1 * min(sizes[1:]), sizes  # it does not grow with the sessions
    steps = [r["step"] for r in previous if r["kind"] == "train"]
    assert steps == sorted(steps) and steps[-1] == 50000  # the newest point is kept


def test_compact_is_the_records_themselves_below_its_cap():
    records = lines(1, 0, 50) + lines(2, 40, 90)  # session 2 redid 41-50 after a kill
    def key(r):
        return json.dumps(r, sort_keys=True)
    assert sorted(map(key, history.compact(records))) == sorted(map(key, report.dedupe_metrics(records)))


def test_local_history_appends_each_session_once_and_survives_a_kill(tmp_path):
    local = history.LocalHistory(tmp_path)
    s1, s2, s3 = lines(1, 0, 30), lines(2, 30, 60), lines(3, 55, 90)  # session 2 killed after its save at 55
    assert local.add(1, "r-s001-a1", s1)
    assert local.add(2, "r-s002-a1", s2 + [{"session": 1, "kind": "train", "step": 1}])  # not its own: left out
    assert not local.add(2, "r-s002-a1", s2)  # the same hand-over seen twice
    whole = local.path.read_bytes()
    assert report.read_metrics(local.path) == s1 + s2
    # killed after writing session 3's lines, before its index: the lines past the index are cut at the retry
    with open(local.path, "ab") as f:
        f.write(history.encode(s3)[:-40])
    assert local.add(3, "r-s003-a1", s3)
    assert report.read_metrics(local.path) == s1 + s2 + s3
    assert local.path.read_bytes() == whole + history.encode(s3)
    # a restored older checkpoint: session 3 again as another run; what followed session 2 is replaced
    s3b = lines(3, 60, 80)
    assert local.add(3, "r-s003-a2", s3b)
    assert report.read_metrics(local.path) == s1 + s2 + s3b
    assert [(s["index"], s["run_id"]) for s in local.sessions()] == [(1, "r-s001-a1"), (2, "r-s002-a1"),
                                                                     (3, "r-s003-a2")]


def test_a_new_folder_fills_the_sessions_it_did_not_see_from_the_published_history(tmp_path):
    s1, s2, s3 = lines(1, 0, 30), lines(2, 30, 60), lines(3, 60, 90)
    published = history.next_history(history.next_history([], 1, s1), 2, s2)
    local = history.LocalHistory(tmp_path)
    asked = []
    assert local.add(3, "r-s003-a1", s3, earlier=lambda: asked.append(1) or published,
                     run_ids={1: "r-s001-a1", 2: "r-s002-a1", 3: "r-s003-a1"})
    assert asked == [1]
    assert report.dedupe_metrics(report.read_metrics(local.path)) == report.dedupe_metrics(s1 + s2 + s3)
    assert [s["compacted"] for s in local.sessions()] == [True, True, False]
    assert local.has(3, "r-s003-a1") and not local.has(3, "r-s003-a2")
    # a reader with an older progress.json finds its session here: nothing after it is dropped
    assert local.has(2, "r-s002-a1") and not local.add(2, "r-s002-a1", s2)
    assert [s["index"] for s in local.sessions()] == [1, 2, 3]
