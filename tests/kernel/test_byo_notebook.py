"""A notebook as code.entry (relay/kernel/notebook.py): examples/byo-notebook is examples/byo-plain's loop split
into cells, so relayed in sessions it ends with the script's weights; verify-resume proves it; Jupyter's shell
and magic lines are run, ignored or refused (one line naming the code cell and line, exit 2, nothing written).
Session lengths are step counts, never timers."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat
import pytest
import yaml

from byo_fixtures import copy_example
from relay.kernel import notebook

LENGTHS = {"optim.max_steps": 60, "session.max_steps": 30}


def _progress(workdir: Path) -> dict:
    return json.loads((workdir / "progress.json").read_text())


def _notebook(folder: Path, *cells: str, name: str = "train.ipynb") -> Path:
    """A notebook of these code cells (and a markdown cell first: numbering counts code cells only)."""
    folder.mkdir(parents=True, exist_ok=True)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# notes"),
                                         *(nbformat.v4.new_code_cell(c) for c in cells)])
    nbformat.write(nb, folder / name)
    return folder / name


# -- relayed: the script's weights, and verify-resume --------------------------------------------------------
def test_notebook_relayed_in_sessions_ends_with_the_weights_of_the_script(relay_cli, tmp_path):
    notebook_spec = copy_example("byo-notebook", tmp_path / "nb", **LENGTHS)
    script_spec = copy_example("byo-plain", tmp_path / "script", **LENGTHS)
    split, straight = tmp_path / "split", tmp_path / "straight"
    for _ in range(2):
        relay_cli.train(notebook_spec, split)
    relay_cli.train(script_spec, straight, None, "--max-steps", "none")
    a, b = _progress(split), _progress(straight)
    assert [s["stop_reason"] for s in a["sessions"]] == ["steps", "done"]
    assert a["status"] == b["status"] == "done" and a["global_step"] == b["global_step"] == 60
    assert a["weights_sha256"] == b["weights_sha256"]
    records = [json.loads(line) for line in (split / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [60]  # the eval cell ran, once, at the end


def test_verify_resume_on_a_notebook_says_identical(relay_cli, tmp_path):
    spec = copy_example("byo-notebook", tmp_path / "nb")
    out = relay_cli.run("verify-resume", str(spec), "--steps", "12", "--workdir", str(tmp_path / "v"), timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert out.stdout.startswith("identical") and "(killed mid-save)" in out.stdout, out.stdout


# -- the cells run in one __main__ namespace, shell lines in a shell -----------------------------------------
def test_cells_run_in_order_in_one_main_namespace(tmp_path, monkeypatch, capfd, spawns_processes):
    """What a cell defines is the next cell's (a class pickles as __main__.Point, as in Jupyter); `%` inside a
    string or a bracket is Python's; `!` lines run in a shell and a failing one does not stop the notebook."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RELAY_NB_TEST", raising=False)
    shown = []
    monkeypatch.setattr(notebook, "_display", shown.append)
    path = _notebook(tmp_path, "%matplotlib inline\n%env RELAY_NB_TEST=on\nclass Point:\n    x = 1",
                     'assert __name__ == "__main__"\np = Point()\ntext = """\n%not a magic\n"""',
                     "!echo from-the-shell > shell.txt\n!exit 3\nrows = [1, 7\n  % 5]",
                     "import os, pickle\nassert pickle.loads(pickle.dumps(p)).x == 1\n"
                     "display((os.environ['RELAY_NB_TEST'], text, rows))")
    before = sys.modules["__main__"]
    notebook.run(path)
    assert sys.modules["__main__"] is before  # put back after the run
    assert (tmp_path / "shell.txt").read_text().strip() == "from-the-shell"
    assert "!exit: exit status 3" in capfd.readouterr().err  # reported, not raised: the notebook went on
    assert shown == [("on", "\n%not a magic\n", [1, 2])]


# -- bad notebooks: one line, exit 2, nothing written ----------------------------------------------------------
BAD = {
    "pip in a cell": (["import relay", "!pip install einops"],
                      "code.entry: train.ipynb code cell 2, line 1: '!pip install einops': a relay session installs"
                      " nothing from a cell; list the package in the spec's kaggle.pip"),
    "a cell magic": (["x = 1", "%%bash\nls"], "code.entry: train.ipynb code cell 2, line 1: '%%bash': cell magic"),
    "a line magic": (["x = 1\nif x:\n    %cd /tmp"], "code.entry: train.ipynb code cell 1, line 3: '%cd /tmp': this magic"),
    "a syntax error": (["x = 1", "y = (x +"], "code.entry: train.ipynb code cell 2, line 1: SyntaxError:"),
    "shell output assigned": (["files = !ls"], "code.entry: train.ipynb code cell 1, line 1: SyntaxError: invalid"
                              " syntax (a shell or magic line's output cannot be assigned"),
    "raises in a cell": (["import relay", "session = relay.open_session()",
                          "rows = 3\nraise ValueError('bad column in my data')"],
                         "code.entry train.ipynb: code cell 3, line 2 raised ValueError: bad column in my data"),
    "exits in a cell": (["import sys", "sys.exit(4)"], "code.entry train.ipynb: code cell 2, line 1 exited with status 4"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_notebook_is_one_line_naming_the_cell(case, tmp_path, capsys, monkeypatch):
    from relay.cli import main

    cells, expected = BAD[case]
    _notebook(tmp_path / "code", *cells)
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"name": "nb-bad", "code": {"folder": "code", "entry": "train.ipynb"},
                                    "optim": {"max_steps": 10}, "session": {"threads": 1}}))
    monkeypatch.setattr("sys.path", list(sys.path))  # check_code puts code.folder on it
    workdir = tmp_path / "work"
    assert main(["train", str(spec), "--workdir", str(workdir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("relay: error: ") and expected in err[-1], err[-3:]
    if "raise" not in case and "exits" not in case:  # refused at spec load: the one line alone, nothing written
        assert len(err) == 1 and not workdir.exists(), err


def test_the_front_door_refuses_a_bad_notebook_for_relay_run(tmp_path, monkeypatch):
    """`relay run` and the flows load the spec through the front door: the same line before anything is pushed."""
    from relay.front_door import load_spec
    from relay.shared.spec import SpecError

    monkeypatch.setattr("sys.path", list(sys.path))
    _notebook(tmp_path / "code", "import relay", "%pip install einops")
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"name": "nb-door", "code": {"folder": "code", "entry": "train.ipynb"},
                                    "optim": {"max_steps": 10}}))
    with pytest.raises(SpecError, match=r"spec.yaml: code.entry: train.ipynb code cell 2, line 1: '%pip install"):
        load_spec(spec)
    (tmp_path / "code" / "train.ipynb").write_text("{not json")
    with pytest.raises(SpecError, match=r"code.entry: train.ipynb: not a readable notebook \(JSONDecodeError"):
        load_spec(spec)
