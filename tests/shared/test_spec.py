"""The run spec: every bad spec is refused with one exact line naming the key path and what is expected;
`relay train` on a bad spec exits 2 with that single stderr line and writes nothing."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conftest import toy_spec_dict, write_spec
from relay.cli import main as relay_main
from relay.kernel import recipes
from relay.shared import spec as spec_mod


def drop(*path):
    def apply(d):
        node = d
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
    return apply


def put(dotted, value):
    def apply(d):
        *parents, leaf = dotted.split(".")
        node = d
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return apply


# (id, change to a good toy spec, the exact message after "<path>: ")
BAD = [
    ("unknown-top-key", put("colour", "red"), "colour: unknown key"),
    ("unknown-nested-key", put("optim.learning_rate", 0.1), "optim.learning_rate: unknown key"),
    ("wrong-type", put("optim.lr", "fast"),
     "optim.lr: Input should be a valid number (got 'fast')"),
    ("negative-lr", put("optim.lr", -0.1), "optim.lr: Input should be greater than 0 (got -0.1)"),
    ("grad-accum-0", put("optim.grad_accum", 0), "optim.grad_accum: Input should be greater than 0 (got 0)"),
    ("fractional-micro-batch", put("optim.micro_batch", 2.5),
     "optim.micro_batch: Input should be a valid integer (got 2.5)"),
    ("bool-micro-batch", put("optim.micro_batch", True),
     "optim.micro_batch: Input should be a valid integer (got True)"),
    ("string-number", put("optim.lr", "0.1"),
     "optim.lr: Input should be a valid number (got '0.1')"),
    ("budget-shorter-than-margin", lambda d: d["session"].update(budget=30, safety_margin="1m"),
     "session.budget: must be longer than session.safety_margin (60s), the time reserved to save (got 30s)"),
    ("budget-equal-to-margin", lambda d: d["session"].update(budget="1h", safety_margin=3600),
     "session.budget: must be longer than session.safety_margin (3600s), the time reserved to save (got 3600s)"),
    ("both-epochs-and-max-steps", put("optim.max_steps", 100), "optim: set exactly one of epochs or max_steps"),
    ("neither-epochs-nor-max-steps", drop("optim", "epochs"), "optim: set exactly one of epochs or max_steps"),
    ("unknown-recipe", put("recipe", "resnet"),
     "recipe: unknown recipe 'resnet'; expected one of " + ", ".join(recipes.names())),
    ("bad-recipe-param", put("params.hidden", 0), "params.hidden: Input should be greater than or equal to 1 (got 0)"),
    ("unknown-recipe-param", put("params.layers", 3), "params.layers: unknown key"),
    ("bad-duration", put("session.budget", "3 hours"),
     "session.budget: expected seconds or a duration like '11h30m' (got '3 hours')"),
    ("bool-duration", put("session.save_every", True),
     "session.save_every: expected seconds or a duration like '11h30m'"),
    ("save-every-0", put("session.save_every", 0), "session.save_every: must be a positive duration"),
    ("negative-margin", put("session.safety_margin", "-5s"),
     "session.safety_margin: expected seconds or a duration like '11h30m' (got '-5s')"),
    ("negative-margin-number", put("session.safety_margin", -5), "session.safety_margin: must be a duration >= 0"),
    ("bad-dataset-slug", put("kaggle.dataset_sources", ["just-a-name"]),
     "kaggle.dataset_sources: expected 'owner/slug' (got 'just-a-name')"),
    ("bad-precision", put("optim.precision", "fp8"),
     "optim.precision: Input should be 'auto', 'fp32', 'fp16' or 'bf16' (got 'fp8')"),
    ("bad-schedule", put("optim.schedule", "step"),
     "optim.schedule: Input should be 'constant', 'linear' or 'cosine' (got 'step')"),
    ("missing-name", drop("name"), "name: required key is missing"),
    ("missing-optim", drop("optim"), "optim: required key is missing"),
    ("section-not-mapping", put("optim", 5),
     "optim: Input should be a valid dictionary or instance of OptimConfig (got 5)"),
    ("negative-workers", put("data.num_workers", -1),
     "data.num_workers: Input should be greater than or equal to 0 (got -1)"),
    ("keep-last-0", put("checkpoints.keep_last", 0), "checkpoints.keep_last: Input should be greater than 0 (got 0)"),
    ("disk-budget-0", put("checkpoints.disk_budget_gb", 0),
     "checkpoints.disk_budget_gb: Input should be greater than 0 (got 0)"),
    ("bad-name", put("name", "My Run"),
     "name: String should match pattern '^[a-z0-9]+(?:-[a-z0-9]+)*$' (got 'My Run')"),
    # Kaggle names the session kernel after its title `<name> session`: a name slugify would change is refused
    ("name-not-its-own-slug", put("name", "my--run"),
     "name: String should match pattern '^[a-z0-9]+(?:-[a-z0-9]+)*$' (got 'my--run')"),
    ("bad-kaggle-duration", put("kaggle.session_timeout", "12 h"),
     "kaggle.session_timeout: expected seconds or a duration like '11h30m' (got '12 h')"),
]


def bad_spec_file(tmp_path: Path, change) -> Path:
    data = toy_spec_dict()
    change(data)
    return write_spec(tmp_path, data, "bad.yaml")


@pytest.mark.parametrize("change,message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_spec_message(tmp_path, change, message):
    path = bad_spec_file(tmp_path, change)
    with pytest.raises(spec_mod.SpecError) as err:
        spec_mod.load(path)
    assert str(err.value) == f"{path}: {message}"


BAD_FILES = [
    ("bad-yaml", "name: x\noptim: {lr: [1, 2\n", "not valid YAML at line 3"),
    ("bad-yaml-tab", "name: x\n\tfoo: 1\n", "not valid YAML at line 2"),
    ("top-level-list", "- name: x\n", "expected a mapping of spec keys at the top level"),
    ("top-level-scalar", "just words\n", "expected a mapping of spec keys at the top level"),
    ("empty-file", "", "expected a mapping of spec keys at the top level"),
]


@pytest.mark.parametrize("text,message", [b[1:] for b in BAD_FILES], ids=[b[0] for b in BAD_FILES])
def test_bad_spec_file_message(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(spec_mod.SpecError) as err:
        spec_mod.load(path)
    assert str(err.value) == f"{path}: {message}"


def test_missing_spec_file(tmp_path):
    with pytest.raises(spec_mod.SpecError) as err:
        spec_mod.load(tmp_path / "nope.yaml")
    assert str(err.value) == f"{tmp_path / 'nope.yaml'}: cannot read the spec (No such file or directory)"


def test_at_least_fifteen_distinct_bad_specs():
    assert len({m for *_, m in BAD} | {m for *_, m in BAD_FILES}) >= 15


# -- the CLI --------------------------------------------------------------------------------------
@pytest.mark.parametrize("change,message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_cli_bad_spec_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys, change, message):
    path = bad_spec_file(tmp_path, change)
    workdir = tmp_path / "work"
    assert relay_main(["train", str(path), "--workdir", str(workdir)]) == 2
    out, err = capsys.readouterr()
    assert err == f"relay: error: {path}: {message}\n" and out == ""
    assert not workdir.exists()


def test_cli_budget_flag_is_validated_like_the_spec(tmp_path, capsys):
    path = write_spec(tmp_path, toy_spec_dict(session={"safety_margin": 60}))
    assert relay_main(["train", str(path), "--workdir", str(tmp_path / "w"), "--budget", "45s"]) == 2
    err = capsys.readouterr().err
    assert err == (f"relay: error: {path}: session.budget: must be longer than session.safety_margin (60s),"
                   " the time reserved to save (got 45s)\n")
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("case", ["unknown-nested-key", "bad-yaml", "missing-file"])
def test_cli_subprocess_bad_spec(relay_cli, tmp_path, case):
    """The real command in a new process: exit code 2, exactly one stderr line, nothing on stdout, no workdir."""
    if case == "bad-yaml":
        path = tmp_path / "bad.yaml"
        path.write_text("name: x\noptim: {lr: [1, 2\n")
        message = f"{path}: not valid YAML at line 3"
    elif case == "missing-file":
        path = tmp_path / "missing.yaml"
        message = f"{path}: cannot read the spec (No such file or directory)"
    else:
        path = bad_spec_file(tmp_path, put("optim.learning_rate", 0.1))
        message = f"{path}: optim.learning_rate: unknown key"
    workdir = tmp_path / "work"
    proc = relay_cli.run("train", str(path), "--workdir", str(workdir), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"relay: error: {message}"]
    assert proc.stdout == ""
    assert not workdir.exists()
    assert not any(relay_cli.cwd.iterdir())


# -- good specs -----------------------------------------------------------------------------------
@pytest.mark.parametrize("text,seconds", [
    ("11h30m", 41400.0), ("45m", 2700.0), ("90s", 90.0), ("2h15m30s", 8130.0), ("1.5h", 5400.0), ("0.5m", 30.0),
    ("90", 90.0), (90, 90.0), (12.5, 12.5), (" 11H30M ", 41400.0), ("none", None), ("None", None), (None, None),
])
def test_durations(text, seconds):
    assert spec_mod.parse_duration(text) == seconds


def test_good_spec_with_durations_loads(tmp_path):
    path = write_spec(tmp_path, toy_spec_dict(session={"budget": "11h30m", "save_every": "30m", "safety_margin": "2m"},
                                              kaggle={"session_timeout": "12h", "dataset_sources": ["me/prices"]}))
    spec = spec_mod.load(path)
    assert (spec.session.budget, spec.session.save_every, spec.session.safety_margin) == (41400.0, 1800.0, 120.0)
    assert spec.kaggle.session_timeout == 43200.0 and spec.kaggle.dataset_sources == ["me/prices"]
    assert spec.recipe_params().hidden == 64
    assert spec_mod.validate(spec_mod.to_dict(spec)) == spec  # round trip


def test_defaults(tmp_path):
    spec = spec_mod.load(write_spec(tmp_path, {"name": "abc", "recipe": "toy", "optim": {"max_steps": 10}}))
    assert spec.optim.precision == "auto" and spec.optim.grad_accum == 1 and spec.session.budget is None
    assert spec.checkpoints.disk_budget_gb == 20.0 and spec.checkpoints.keep_best


def test_overrides_apply_before_validation(tmp_path):
    path = write_spec(tmp_path, toy_spec_dict(session={"budget": "1h"}))
    spec = spec_mod.load(path, {"session.budget": "11h30m", "optim.lr": 0.01, "params.hidden": 32})
    assert (spec.session.budget, spec.optim.lr, spec.recipe_params().hidden) == (41400.0, 0.01, 32)
    assert spec_mod.load(path, {"session.budget": None}).session.budget is None  # --budget none
    assert spec_mod.load(path, {"kaggle.enable_gpu": False}).kaggle.enable_gpu is False  # a new section
    with pytest.raises(spec_mod.SpecError, match=r"optim\.lr: Input should be greater than 0 \(got 0\)"):
        spec_mod.load(path, {"optim.lr": 0})
    assert yaml.safe_load(path.read_text())["session"]["budget"] == "1h"  # the file is untouched


def test_example_specs_are_valid():
    examples = sorted(Path(__file__).resolve().parents[2].glob("examples/*.yaml"))
    assert examples
    for path in examples:
        spec_mod.load(path)


def test_override_is_the_one_way_to_change_spec_data():
    base = {"session": {"budget": "1h", "threads": 1}, "optim": {"lr": 1}}
    changed = spec_mod.override(base, {"session.budget": None, "optim": {"max_steps": 5}, "kaggle.lease": "10s"})
    assert changed == {"session": {"budget": None, "threads": 1}, "optim": {"lr": 1, "max_steps": 5},
                       "kaggle": {"lease": "10s"}}
    assert spec_mod.override(base, {"session.budget": None}, none_deletes=True)["session"] == {"threads": 1}
    assert base == {"session": {"budget": "1h", "threads": 1}, "optim": {"lr": 1}}  # a copy: the base unchanged
