"""What a relay's metrics history must be after it ran on the emulator (relay/orchestrator/history.py): each
published checkpoint version carries only its session's lines (and the compacted history.jsonl), the
orchestrator's local history holds every handed-over session's lines once and in order, and the curves draw the
same records as the whole file the kernels carried from session to session before."""
from __future__ import annotations

import json
import shutil

from relay.orchestrator import history, report


def check_history(relay_env, state_dir: str = "orchestrator") -> list:
    """Assert the above for the relay `relay_env` ran (its flow's state in `state_dir`); the whole history."""
    emu = relay_env.emu
    handed, progress = [], {}
    for version in relay_env.ckpt_versions():
        folder = emu.store.dataset_dir(relay_env.ckpt, version["number"])
        progress = json.loads((folder / "progress.json").read_text())
        index, run_id = history.session_key(progress)
        own = report.read_metrics(folder / "metrics.jsonl")
        assert own and {r["session"] for r in own} == {index}, (version["number"], {r["session"] for r in own})
        assert (folder / "history.jsonl").is_file()
        if not handed or handed[-1][:2] != (index, run_id):  # a version published again (restore) is no new one
            handed.append((index, run_id, own))
    assert [i for i, _, _ in handed] == list(range(1, len(handed) + 1)), [h[:2] for h in handed]
    local = relay_env.root / state_dir / relay_env.name / "history"
    whole = report.read_metrics(local / "metrics.jsonl")
    assert whole == [r for _, _, own in handed for r in own]  # every session once, in order, none lost
    # what each handed-over kernel wrote, one after the other: the file a session carried to the next before
    runs = {r.run_id: r.version for r in relay_env.kernel_runs()}
    carried = []
    for _, run_id, _ in handed:
        carried += report.read_metrics(emu.store.kernel_dir(relay_env.kernel, runs[run_id]) / "working" / "relay"
                                       / "metrics.jsonl")
    assert report.dedupe_metrics(whole) == report.dedupe_metrics(carried)
    # an orchestrator whose folder is new (a GitHub Actions tick) gets the same from history.jsonl and metrics.jsonl
    fresh = relay_env.root / "fresh-orchestrator"
    path = history.local_metrics(relay_env.backend(), relay_env.ckpt, fresh, progress)
    assert report.dedupe_metrics(report.read_metrics(path)) == report.dedupe_metrics(whole)
    # one killed after publishing, before its local append: the next reader fetches that session's lines again
    copy = relay_env.root / "killed-orchestrator"
    shutil.copytree(local.parent, copy)
    index_path = copy / "history" / "index.json"
    kept = json.loads(index_path.read_text())["sessions"]
    index_path.write_text(json.dumps({"sessions": kept[:-1]}))
    assert report.read_metrics(history.local_metrics(relay_env.backend(), relay_env.ckpt, copy, progress)) == whole
    return whole
