"""Every bad input, whatever it is (the spec file, a value in it, a CLI argument, the recipe's data files), is
refused the same way: exit code 2, exactly one line on stderr naming the file/key/line and what is expected,
nothing on stdout, no traceback, and no file or folder created or changed anywhere under the case's folder
(the spec, the data, a workdir that already exists, the working directory).

Each case runs `relay.cli.main` in-process (fast) and the ones marked `SUB` also run the real `python -m relay`
in a new process, so import-time and logging output would be seen too.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import yaml

from conftest import RelayCLI, deep_merge, toy_spec_dict
from kaggle_fixtures import warm_python
from relay.cli import main as relay_main
from relay.kernel.recipes import price_data

# The toy spec of conftest, written out by hand so that duplicate-key cases know their line numbers.
TOY_YAML = """\
name: toy-test
recipe: toy
seed: 3
params:
  n_train: 256
  n_eval: 64
  hidden: 64
optim:
  micro_batch: 8
  lr: 0.003
  epochs: 2
data:
  num_workers: 0
session:
  threads: 1
  safety_margin: 0
"""

PRICE_SPEC = {
    "name": "price-bad-inputs",
    "recipe": "price_model",
    "params": {"data_dir": "data", "vocab_size": 200, "max_len": 16, "hidden_size": 16, "num_layers": 1,
               "num_heads": 2, "intermediate_size": 32, "side_dim": 4, "eval_fraction": 0.2},
    "optim": {"micro_batch": 4, "max_steps": 1},
    "data": {"num_workers": 0},
    "session": {"threads": 1, "safety_margin": 0},
}
TRAIN_HEADER = "sample_id,catalog_content,price\n"


@dataclass
class Case:
    id: str
    setup: Callable[[Path], list[str]]  # writes the case's files under root, returns the `relay` argv
    expect: str  # a fragment of the one stderr line; "{root}" is the case's folder
    sub: bool = False  # also through a new `python -m relay` process
    marks: list = field(default_factory=list)


# -- building blocks --------------------------------------------------------------------------------------
def train(spec: str = "spec.yaml", *extra: str) -> Callable[[Path], list[str]]:
    return lambda root: ["train", str(root / spec), "--workdir", str(root / "work"), *extra]


def toy_text(root: Path, text: str | bytes, *extra: str) -> list[str]:
    path = root / "spec.yaml"
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return train("spec.yaml", *extra)(root)


def toy(**dotted) -> Callable[[Path], list[str]]:
    """The toy spec with dotted-key overrides (a value of DROP deletes the key)."""
    return lambda root: toy_text(root, yaml.safe_dump(toy_spec_dict(dotted), sort_keys=False))


def toy_args(*extra: str) -> Callable[[Path], list[str]]:
    return lambda root: toy_text(root, TOY_YAML, *extra)


def raw(text: str | bytes) -> Callable[[Path], list[str]]:
    return lambda root: toy_text(root, text)


def write_price_world(root: Path, spec_overrides: dict | None = None) -> None:
    """A good price spec and data/train.csv + data/test.csv (test_good_worlds_train proves they are good)."""
    price_data.generate(root / "data", n_train=30, n_test=5, seed=0)
    spec = deep_merge(PRICE_SPEC, spec_overrides or {})
    spec["params"]["data_dir"] = str(root / "data")
    (root / "price.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))


def price(file: str = "train.csv", content: str | bytes | None = None, *extra: str,
          existing_workdir: bool = False) -> Callable[[Path], list[str]]:
    """The price world with data/<file> replaced by `content` (None: removed)."""

    def setup(root: Path) -> list[str]:
        write_price_world(root)
        target = root / "data" / file
        if content is None:
            target.unlink()
        else:
            target.write_bytes(content.encode() if isinstance(content, str) else content)
        if existing_workdir:  # a workdir from an earlier session: the bad data must not touch it either
            (root / "work" / "cache").mkdir(parents=True)
            (root / "work" / "metrics.jsonl").write_text('{"step": 1}\n')
        return train("price.yaml", *extra)(root)

    return setup


def first_rows(n: int) -> str:
    """The header and the first n rows of a good train.csv, as text."""
    frame, _ = price_data.make_frames(30, 0, seed=0)
    return frame.iloc[:n].to_csv(index=False)


def with_row(row: str) -> str:
    """A good train.csv (3 rows) with `row` appended, which starts on file line 1 + lines of the 3 rows + 1."""
    return first_rows(3) + row


def line_of_appended_row() -> int:
    return first_rows(3).count("\n") + 1


# -- the cases --------------------------------------------------------------------------------------------
DUP_TOP = TOY_YAML.replace("seed: 3\n", "seed: 3\nname: other-name\n")
DUP_NESTED = TOY_YAML.replace("  epochs: 2\n", "  epochs: 2\n  lr: 0.1\n")
DUP_PARAMS = TOY_YAML.replace("  hidden: 64\n", "  hidden: 64\n  hidden: 32\n")
DUP_FLOW = TOY_YAML.replace("data:\n  num_workers: 0\n", "data: {num_workers: 0, num_workers: 1}\n")
NUL = TOY_YAML.replace("seed: 3\n", "seed: 3\x00\n")
ROW = line_of_appended_row()

CASES = [
    # the spec file itself
    Case("spec-latin-1", raw(TOY_YAML.replace("name: toy-test\n", "name: toy-test\n# café\n").encode("latin-1")),
         "{root}/spec.yaml: line 2 is not UTF-8 text (byte 0xe9); expected a file saved as UTF-8", sub=True),
    Case("spec-utf-16", raw(TOY_YAML.encode("utf-16")),
         "{root}/spec.yaml: line 1 is not UTF-8 text (byte 0xff); expected a file saved as UTF-8"),
    Case("spec-nul-byte", raw(NUL), "{root}/spec.yaml: not valid YAML at line 3"),
    Case("duplicate-top-key", raw(DUP_TOP),
         "{root}/spec.yaml: name: duplicate key at line 4 (first set at line 1); set each key once", sub=True),
    Case("duplicate-nested-key", raw(DUP_NESTED),
         "{root}/spec.yaml: optim.lr: duplicate key at line 12 (first set at line 10); set each key once"),
    Case("duplicate-params-key", raw(DUP_PARAMS),
         "{root}/spec.yaml: params.hidden: duplicate key at line 8 (first set at line 7)"),
    Case("duplicate-flow-key", raw(DUP_FLOW),
         "{root}/spec.yaml: data.num_workers: duplicate key at line 12 (first set at line 12)"),
    Case("spec-missing", train("nope.yaml"), "{root}/nope.yaml: cannot read the spec (No such file or directory)"),
    Case("spec-is-a-directory", lambda root: (root / "spec.yaml").mkdir() or train()(root),
         "{root}/spec.yaml: cannot read the spec (Is a directory)"),
    Case("spec-empty", raw(""), "{root}/spec.yaml: expected a mapping of spec keys at the top level"),
    Case("spec-bad-yaml", raw("name: x\n\tfoo: 1\n"), "{root}/spec.yaml: not valid YAML at line 2"),
    # beyond what Kaggle allows
    Case("budget-over-12h", toy(**{"session.budget": "13h"}),
         "session.budget: must be at most 12h, the longest Kaggle session; 'none' runs to the end (got 13h)",
         sub=True),
    Case("timeout-over-12h", toy(**{"kaggle.session_timeout": "12h30m"}),
         "kaggle.session_timeout: must be a duration > 0 and at most 12h, the longest Kaggle session (got 12h30m)"),
    Case("timeout-0", toy(**{"kaggle.session_timeout": 0}),
         "kaggle.session_timeout: must be a duration > 0 and at most 12h"),
    Case("output-over-20gb", toy(**{"checkpoints.disk_budget_gb": 25}),
         "checkpoints.disk_budget_gb: must be at most 20, the GB of output Kaggle keeps (got 25)"),
    Case("timeout-over-weekly-quota", toy(**{"kaggle.weekly_gpu_quota": "10h"}),
         "kaggle.session_timeout: must be at most kaggle.weekly_gpu_quota (10h) (got 12h)"),
    Case("budget-over-weekly-quota",
         toy(**{"kaggle.weekly_gpu_quota": "5h", "kaggle.session_timeout": "4h", "session.budget": "6h"}),
         "session.budget: must be at most 5h, kaggle.weekly_gpu_quota; 'none' runs to the end (got 6h)"),
    Case("weekly-quota-over-a-week", toy(**{"kaggle.weekly_gpu_quota": "200h"}),
         "kaggle.weekly_gpu_quota: must be a duration > 0 and at most 168h, one week (got 200h)"),
    Case("startup-longer-than-session", toy(**{"kaggle.session_timeout": "1h", "kaggle.startup_overhead": "2h"}),
         "kaggle.startup_overhead: must be a duration >= 0 and shorter than kaggle.session_timeout (1h) (got 2h)"),
    Case("cli-budget-over-12h", toy_args("--budget", "12h1m"),
         "session.budget: must be at most 12h, the longest Kaggle session; 'none' runs to the end (got 12h1m)"),
    # wrong types, at every level
    Case("top-name-int", toy(name=123), "name: Input should be a valid string (got 123)"),
    Case("top-seed-string", toy(seed="three"), "seed: Input should be a valid integer (got 'three')"),
    Case("top-seed-too-big", toy(seed=2**40), "seed: Input should be less than or equal to 4294967295"),
    Case("top-params-list", toy(params=[1, 2]), "params: Input should be a valid dictionary (got [1, 2])"),
    Case("top-recipe-int", toy(recipe=5), "recipe: Input should be a valid string (got 5)"),
    Case("optim-epochs-string", toy(**{"optim.epochs": "two"}), "optim.epochs: Input should be a valid integer"),
    Case("optim-tf32-string", toy(**{"optim.tf32": "yes"}), "optim.tf32: Input should be a valid boolean (got 'yes')"),
    Case("optim-lr-infinite", raw(TOY_YAML.replace("lr: 0.003", "lr: .inf")),
         "optim.lr: Input should be a finite number (got inf)"),
    Case("data-workers-bool", toy(**{"data.persistent_workers": "no"}),
         "data.persistent_workers: Input should be a valid boolean (got 'no')"),
    Case("data-prefetch-float", toy(**{"data.prefetch_factor": 1.5}),
         "data.prefetch_factor: Input should be a valid integer (got 1.5)"),
    Case("session-threads-string", toy(**{"session.threads": "one"}),
         "session.threads: Input should be a valid integer (got 'one')"),
    Case("session-budget-list", toy(**{"session.budget": [1, 2]}),
         "session.budget: expected seconds or a duration like '11h30m' (got [1, 2])", sub=True),
    Case("session-max-steps-string", toy(**{"session.max_steps": "10"}),
         "session.max_steps: Input should be a valid integer (got '10')"),
    Case("checkpoints-keep-best-string", toy(**{"checkpoints.keep_best": "yes"}),
         "checkpoints.keep_best: Input should be a valid boolean (got 'yes')"),
    Case("checkpoints-digest-int", toy(**{"checkpoints.digest": 5}),
         "checkpoints.digest: Input should be 'crc32' or 'sha256' (got 5)"),
    Case("kaggle-gpu-string", toy(**{"kaggle.enable_gpu": "true"}),
         "kaggle.enable_gpu: Input should be a valid boolean (got 'true')"),
    Case("kaggle-sources-string", toy(**{"kaggle.dataset_sources": "me/prices"}),
         "kaggle.dataset_sources: Input should be a valid list (got 'me/prices')"),
    Case("kaggle-sources-int-item", toy(**{"kaggle.dataset_sources": [5]}),
         "kaggle.dataset_sources.0: Input should be a valid string (got 5)"),
    Case("kaggle-timeout-mapping", toy(**{"kaggle.session_timeout": {"h": 1}}),
         "kaggle.session_timeout: expected seconds or a duration like '11h30m' (got {'h': 1})"),
    Case("params-int-string", toy(**{"params.n_train": "lots"}),
         "params.n_train: Input should be a valid integer (got 'lots')"),
    Case("params-float-string", toy(**{"params.dropout": "0.1"}),
         "params.dropout: Input should be a valid number (got '0.1')"),
    Case("session-step-seconds-zero", toy(**{"session.step_seconds": "0s"}),
         "session.step_seconds: must be a duration > 0 or none"),
    # the CLI's own arguments
    Case("cli-budget-words", toy_args("--budget", "three hours"),
         "relay train: error: argument --budget: expected seconds or a duration like '11h30m' (got 'three hours')",
         sub=True),
    Case("cli-budget-negative", toy_args("--budget", "-5"),
         "session.budget: must be longer than session.safety_margin (0s), the time reserved to save (got -5s)"),
    Case("cli-max-steps-0", toy_args("--max-steps", "0"),
         "argument --max-steps: expected a positive number of steps or 'none' (got '0')"),
    Case("cli-max-steps-fraction", toy_args("--max-steps", "2.5"),
         "argument --max-steps: expected a positive number of steps or 'none' (got '2.5')"),
    Case("cli-deadline-words", toy_args("--deadline", "tomorrow"),
         "argument --deadline: expected a unix time in seconds, e.g. 1767225600 (got 'tomorrow')"),
    Case("cli-no-workdir", lambda root: toy_text(root, TOY_YAML) and ["train", str(root / "spec.yaml")],
         "relay train: error: the following arguments are required: --workdir (see relay train --help)"),
    Case("cli-unknown-option", toy_args("--bogus"), "relay: error: unrecognized arguments: --bogus"),
    Case("cli-unknown-command", lambda root: ["trian", "x"], "relay: error: argument command: invalid choice: 'trian'"),
    Case("cli-workdir-is-a-file", lambda root: (root / "work").write_text("x") and toy_args()(root),
         "{root}/work: it is a file; --workdir expects a folder (or a path that does not exist yet)", sub=True),
    Case("cli-workdir-under-a-file",
         lambda root: (root / "file").write_text("x") and toy_text(root, TOY_YAML)[:2] + ["--workdir",
                                                                                        str(root / "file" / "w")],
         "{root}/file/w: {root}/file is a file; --workdir expects a folder"),
    Case("cli-status-no-progress", lambda root: (root / "empty").mkdir() or ["status", str(root / "empty")],
         "no progress.json in {root}/empty; expected a workdir or harvested outputs with a progress.json"),
    Case("cli-status-broken-progress",
         lambda root: (root / "progress.json").write_text("{not json") and ["status", str(root)],
         "{root}/progress.json: unreadable progress.json"),
    Case("cli-plan-no-step-time",
         lambda root: ["plan", toy_text(root, TOY_YAML.replace("  epochs: 2\n", "  max_steps: 10\n"))[1]],
         "relay plan: no session has measured a step yet: pass --step-seconds S or set session.step_seconds in the"
         " spec"),
    Case("cli-plan-negative-step-time",
         lambda root: ["plan", toy_text(root, TOY_YAML.replace("  epochs: 2\n", "  max_steps: 10\n"))[1],
                       "--step-seconds", "-1"],
         "relay: error: relay plan: step_seconds must be a finite number > 0, got -1.0"),
    Case("cli-data-no-rows", lambda root: ["data", "price-model", "--out", str(root / "gen"), "--train", "0"],
         "relay data price-model: error: price data: need n_train >= 1 and n_test >= 0, got 0, 500", sub=True),
    # the price recipe's data files
    Case("data-train-missing", price("train.csv", None),
         "{root}/data/train.csv: file not found (expected a CSV with columns sample_id, catalog_content, price)"),
    Case("data-missing-column", price("train.csv", "sample_id,catalog_content\n1,x\n2,y\n"),
         "{root}/data/train.csv: missing column(s) price; expected sample_id, catalog_content, price"),
    Case("data-price-not-a-number", price("train.csv", with_row('999,"Item Name: X",cheap\n')),
         f"{{root}}/data/train.csv: price must be a number >= 0 (line {ROW} has 'cheap')", sub=True),
    Case("data-price-negative", price("train.csv", with_row('999,"Item Name: X",-3\n')),
         f"{{root}}/data/train.csv: price must be a number >= 0 (line {ROW} has '-3.0')"),
    Case("data-price-infinite", price("train.csv", with_row('999,"Item Name: X",inf\n')),
         f"{{root}}/data/train.csv: price must be a number >= 0 (line {ROW} has 'inf')"),
    Case("data-sample-id-not-integer", price("train.csv", with_row('A-17,"Item Name: X",3.5\n')),
         f"{{root}}/data/train.csv: sample_id must be an integer (line {ROW} has 'A-17')"),
    Case("data-empty-file", price("train.csv", b""),
         "{root}/data/train.csv: empty file (expected a CSV with columns sample_id, catalog_content, price)",
         sub=True),
    Case("data-header-only", price("train.csv", TRAIN_HEADER),
         "{root}/data/train.csv: 0 data rows leave nothing to train on with params.eval_fraction=0.2;"
         " expected at least 2"),
    Case("data-not-utf8", price("train.csv", with_row('999,"Item Name: Caf\xe9",3.5\n').encode("latin-1")),
         f"{{root}}/data/train.csv: line {ROW} is not UTF-8 text (byte 0xe9); expected a CSV saved as UTF-8",
         sub=True),
    Case("data-ragged-row", price("train.csv", with_row('999,"Item Name: X",3.5,extra\n')),
         f"{{root}}/data/train.csv: not a valid CSV (line {ROW} has 4 fields, the header 3; expected a CSV with"),
    Case("data-unclosed-quote", price("train.csv", with_row('999,"Item Name: X,3.5\n')),
         f"{{root}}/data/train.csv: not a valid CSV (line {ROW}: unexpected end of data;"),
    Case("data-test-missing-column", price("test.csv", "sample_id,text\n1,x\n"),
         "{root}/data/test.csv: missing column(s) catalog_content; expected sample_id, catalog_content"),
    Case("data-test-not-utf8", price("test.csv", b'sample_id,catalog_content\n1,"\xff"\n'),
         "{root}/data/test.csv: line 2 is not UTF-8 text (byte 0xff)"),
    Case("data-dir-is-a-file",
         lambda root: price()(root) + ["--data", str(root / "data" / "test.csv")],
         "{root}/data/test.csv/train.csv: file not found"),
    Case("data-error-keeps-existing-workdir", price("train.csv", b"", existing_workdir=True),
         "{root}/data/train.csv: empty file"),
]


# -- running a case -----------------------------------------------------------------------------------------
def snapshot(root: Path) -> dict[str, str]:
    """Every file and folder under root with its content hash: equal snapshots mean nothing was written."""
    tree = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            tree[os.path.relpath(os.path.join(folder, name), root) + "/"] = "dir"
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                tree[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return tree


def check_refusal(case: Case, root: Path, returncode, stdout: str, stderr: str, before: dict) -> None:
    expected = case.expect.replace("{root}", str(root))
    assert "Traceback" not in stderr, stderr
    assert returncode == 2, (returncode, stderr)
    lines = stderr.splitlines()
    assert len(lines) == 1, f"expected one stderr line, got:\n{stderr}"
    assert lines[0].startswith(("relay: error: ", "relay train: error: ", "relay data price-model: error: ")), lines[0]
    assert expected in lines[0], f"\n  got:      {lines[0]}\n  expected: ...{expected}..."
    assert stdout == ""
    assert snapshot(root) == before, "a refused input created or changed files"


@pytest.fixture
def case_root(tmp_path) -> Path:
    root = tmp_path / "case"
    root.mkdir()
    return root


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_in_process(case: Case, case_root: Path, capsys, monkeypatch):
    argv = case.setup(case_root)
    monkeypatch.chdir(case_root)  # a stray relative write would land in the snapshot
    before = snapshot(case_root)
    capsys.readouterr()
    try:
        returncode = relay_main(argv)
    except SystemExit as exit_:  # argparse exits; anything else escaping is a traceback: the test fails
        returncode = exit_.code
    out, err = capsys.readouterr()
    check_refusal(case, case_root, returncode, out, err, before)


SUB_CASES = [c for c in CASES if c.sub]


@pytest.mark.parametrize("case", SUB_CASES, ids=[c.id for c in SUB_CASES])
def test_bad_input_through_the_real_command(case: Case, case_root: Path, tmp_path, spawns_processes):
    argv = case.setup(case_root)
    cli = RelayCLI(tmp_path / "env")  # HOME, TMPDIR outside the case folder
    before = snapshot(case_root)
    python, env = warm_python(cli.env)  # `python -m relay` forked warm (tests/kaggle_fixtures.py): its own main
    proc = subprocess.run([python, *cli.argv(*argv)[1:]], env=env, cwd=case_root, capture_output=True, text=True,
                          timeout=120)
    check_refusal(case, case_root, proc.returncode, proc.stdout, proc.stderr, before)


def test_the_suite_is_broad():
    groups = {c.id.split("-")[0] for c in CASES}
    assert len(CASES) >= 40 and {"spec", "duplicate", "cli", "data", "top", "optim", "session", "kaggle",
                                 "params", "checkpoints"} <= groups
    assert len({c.expect for c in CASES}) == len(CASES)  # no two cases expect the same line


def test_good_worlds_train(case_root, capsys, monkeypatch):
    """The worlds the cases break are good: the toy spec and the price spec with its data train (one step),
    so each refusal above is caused by its one change."""
    monkeypatch.chdir(case_root)
    toy_text(case_root, TOY_YAML)
    assert relay_main(["train", str(case_root / "spec.yaml"), "--workdir", str(case_root / "toy"),
                       "--max-steps", "1"]) == 0
    write_price_world(case_root)
    assert relay_main(["train", str(case_root / "price.yaml"), "--workdir", str(case_root / "price")]) == 0
    assert (case_root / "price" / "progress.json").is_file()


def test_yaml_merge_keys_may_be_overridden(case_root):
    """Not a duplicate: a `<<: *anchor` merge brings keys in that the mapping may set again, as YAML intends."""
    from relay.shared import spec as spec_mod

    text = TOY_YAML.replace("optim:\n", "defaults: &d {lr: 0.1, micro_batch: 4}\noptim:\n  <<: *d\n")
    path = case_root / "merge.yaml"
    path.write_text(text.replace("defaults: &d", "x-defaults: &d"))
    with pytest.raises(spec_mod.SpecError, match="x-defaults: unknown key"):  # parsed fine; only the key is foreign
        spec_mod.load(path)
    from relay.shared.inputs import load_yaml

    data = load_yaml(text)
    assert data["optim"]["lr"] == 0.003 and data["optim"]["micro_batch"] == 8


def test_a_reader_that_closes_the_pipe_ends_the_command_quietly(monkeypatch, capsys):
    """`relay plan SPEC | head -1`: once the reader has closed the pipe, the command ends with a shell's SIGPIPE
    status and no traceback (it used to end in BrokenPipeError's)."""
    import io
    import sys

    class ClosedPipe(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    example = Path(__file__).resolve().parents[2] / "examples/recsys-t4.yaml"
    assert relay_main(["plan", str(example), "--step-seconds", "60"]) == 141
    assert "Traceback" not in capsys.readouterr().err


def test_relay_plan_plans_from_the_specs_step_time_before_any_session(tmp_path, capsys):
    """session.step_seconds stands in for --step-seconds until a session measured a step."""
    spec = toy_text(tmp_path, TOY_YAML.replace("  epochs: 2\n", "  max_steps: 10\n") + "  step_seconds: 0.5s\n")[1]
    assert relay_main(["plan", spec]) == 0
    assert "10 steps at 0.5 s/step" in capsys.readouterr().out
