"""Temporal recipe (seed 003) and the stage contract: LSTM -> Transformer -> MLP in one relay, exact resume
when a session ends between two models or in the middle of one, bad bar files."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from conftest import write_spec
from relay.kernel.recipes import temporal_data
from relay.kernel.recipes.temporal import TemporalParams, TemporalRecipe, load_exported
from relay.kernel.session import checkpoint, stages
from relay.kernel.session.stages import Stage
from relay.shared.errors import InputError
from split_sessions import progress, random_splits, run_split

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]


def tiny_spec(data_dir: Path) -> dict:
    spec = yaml.safe_load((REPO / "examples/temporal-tiny.yaml").read_text())
    spec["params"] = {**spec["params"], "data_dir": str(data_dir), "window": 8}
    spec["optim"] = {**spec["optim"], "epochs": 3, "micro_batch": 128, "warmup_steps": 2}  # one epoch per model
    return spec


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("temporal")
    temporal_data.generate(directory, 1500, seed=2)
    return directory


# ------------------------------------------------------------------------------------- the stage plan
def test_stage_plan_is_a_pure_layout_of_the_steps():
    spans = stages.plan([Stage("a"), Stage("b"), Stage("c")], 10)
    assert [(s.stage.name, s.start, s.end) for s in spans] == [("a", 0, 3), ("b", 3, 6), ("c", 6, 10)]
    spans = stages.plan([Stage("svd", 1, fit=True), Stage("als", fit=True)], 6)
    assert [(s.start, s.end) for s in spans] == [(0, 1), (1, 6)]
    assert stages.at(spans, 0).stage.name == "svd" and stages.at(spans, 1).stage.name == "als"
    assert stages.at(spans, 6).stage.name == "als"  # past the end: the last stage
    with pytest.raises(InputError, match=r"the run has 2 optimizer steps, the recipe's stages \(a: 2, b: a share\)"):
        stages.plan([Stage("a", 2), Stage("b")], 2)


def test_a_stage_at_k_times_the_batch_gets_one_kth_of_the_steps():
    """Stage.batch_scale: equal samples per shared stage, so the MLP at 2 x the batch gets half the steps."""
    spans = stages.plan([Stage("lstm"), Stage("transformer"), Stage("mlp", batch_scale=2)], 10)
    assert [(s.start, s.end) for s in spans] == [(0, 4), (4, 8), (8, 10)]
    spans = stages.plan([Stage("a"), Stage("b", batch_scale=2)], 2)  # too few steps to weight: one each
    assert [(s.start, s.end) for s in spans] == [(0, 1), (1, 2)]
    with pytest.raises(ValueError, match="batch_scale"):
        Stage("x", batch_scale=0)


# ---------------------------------------------------------------------------------------------- data
def test_features_only_look_back_and_the_target_looks_ahead(data_dir):
    bars = temporal_data.read_bars(data_dir / "bars.csv")
    feats, target = temporal_data.features(bars, horizon=5)
    changed = bars.copy()
    changed.loc[1000:, "close"] *= 1.5  # the future changes
    feats2, target2 = temporal_data.features(changed, horizon=5)
    pd.testing.assert_frame_equal(feats.iloc[:1000], feats2.iloc[:1000])
    assert np.allclose(target[:995], target2[:995], equal_nan=True)
    assert not np.allclose(target[995:1000], target2[995:1000])
    assert np.isnan(target[-5:]).all()


@pytest.mark.parametrize("content, message", [
    ("timestamp,close\n2024-01-01,1\n", r"bars\.csv: missing column\(s\) volume"),
    ("timestamp,close,volume\n1,100,5\n2,abc,5\n", r"bars\.csv: line 3: close must be a number \(got 'abc'\)"),
    ("timestamp,close,volume\n1,100,5\n2,101,5\n3,,5\n", r"bars\.csv: line 4: close is missing \(NaN\)"),
    ("timestamp,close,volume\n1,100,5\n2,NaN,5\n", r"bars\.csv: line 3: close is missing \(NaN\)"),
    ("timestamp,close,volume\n1,100,5\n2,inf,5\n", r"bars\.csv: line 3: close must be finite \(got 'inf'\)"),
    ("timestamp,close,volume\n1,100,5\n2,101,1e400\n", r"bars\.csv: line 3: volume must be finite \(got '1e400'\)"),
    ("timestamp,close,volume\n1,100,5\n2,101,5,7\n", r"bars\.csv: line 3: 4 fields, expected 3 \(the header's\)"),
    ("timestamp,close,volume\n1,100,5\n2,101\n", r"bars\.csv: line 3: 2 fields, expected 3 \(the header's\)"),
])
def test_bad_bar_files_are_one_line_errors_naming_the_line(tmp_path, content, message):
    (tmp_path / "bars.csv").write_text(content)
    with pytest.raises(InputError, match=message):
        temporal_data.read_bars(tmp_path / "bars.csv")


def test_too_few_bars_is_an_empty_split_error_and_the_cli_exits_2(relay_cli, tmp_path):
    temporal_data.generate(tmp_path / "short", 75, seed=0)
    with pytest.raises(InputError, match=r"bars\.csv: 75 bars leave 0 training and .* both splits need"):
        TemporalRecipe(TemporalParams(window=8), data_dir=tmp_path / "short", cache_dirs=[tmp_path / "c"],
                       seed=0).prepare()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad/bars.csv").write_text("timestamp,close,volume\n1,100,5\n2,oops,5\n")
    proc = relay_cli.train(write_spec(tmp_path, tiny_spec(tmp_path / "bad")), tmp_path / "wd", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"relay: error: {tmp_path / 'bad/bars.csv'}: line 3: close must be a number (got 'oops')")
    assert not (tmp_path / "wd/checkpoints").exists() and not list((tmp_path / "wd").rglob("*.parquet"))


# ------------------------------------------------------------------------------------------ the relay
@pytest.fixture(scope="module")
def reference(relay_cli, data_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("temporal-ref")
    spec = write_spec(root, tiny_spec(data_dir))
    relay_cli.train(spec, root / "wd")
    return spec, root / "wd", progress(root / "wd")


def test_models_train_one_after_another_and_each_learns(reference):
    _, workdir, final = reference
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    # Every model is scored at the end of its stage, by the model just trained, and beats predicting the mean.
    for name in ("lstm", "transformer", "mlp"):
        last = [r for r in evals if f"mse_{name}" in r][-1]
        assert last["r2"] > 0.03, (name, last)
    stages_logged = [r["stage"] for r in records if r["kind"] == "train"]
    assert stages_logged == sorted(stages_logged, key=["lstm", "transformer", "mlp"].index)
    # The last stage's optimizer holds only the MLP's parameters: earlier models' state was dropped.
    state = torch.load(workdir / final["checkpoint"] / checkpoint.STATE_FILE, weights_only=True)
    n_mlp = sum(1 for k in state["objects"]["model"] if k.startswith("mlp."))
    assert len(state["objects"]["optimizer"]["state"]) == n_mlp
    model = load_exported(workdir / "export")
    assert checkpoint.weights_sha256(model.state_dict()) == final["weights_sha256"]


def test_no_best_checkpoint_compares_one_models_mse_with_anothers(reference):
    """keep_best (on by default) is not applied to a recipe of several models: the transformer's first
    evaluation must not be ranked against the trained LSTM's, so no best is kept and the export is final."""
    _, workdir, final = reference
    assert final["best"] is None
    assert all(c.manifest["reason"] != "best" for c in checkpoint.list_valid(workdir / "checkpoints"))
    assert len(checkpoint.list_valid(workdir / "checkpoints")) <= 2  # keep_last only, no best spared


def test_sessions_ending_between_models_and_mid_model_resume_bit_identical(reference, relay_cli, tmp_path):
    spec, _, ref = reference
    total = ref["total_steps"]
    per_model = total // 3
    # session 1 ends exactly where the LSTM ends; session 2 ends in the middle of the Transformer
    steps = [per_model, per_model // 2, total - per_model - per_model // 2]
    final = run_split(relay_cli, spec, tmp_path / "a", steps)
    assert final["weights_sha256"] == ref["weights_sha256"] and final["best"] == ref["best"]
    final = run_split(relay_cli, spec, tmp_path / "b", random_splits(total, 3, seed=5))
    assert final["weights_sha256"] == ref["weights_sha256"]


def test_mlp_at_twice_the_batch_resumes_bit_identical_mid_mlp(relay_cli, data_dir, tmp_path):
    """params.mlp_batch_scale 2 (the t4 spec's seed 512 beside 256): the MLP stage's micro-batches are 2 x,
    its data order a pure function of the step, so sessions cut mid-MLP end with the same weights."""
    raw = tiny_spec(data_dir)
    raw["params"]["mlp_batch_scale"] = 2
    raw["optim"]["log_every_steps"] = 1
    spec = write_spec(tmp_path, raw)
    relay_cli.train(spec, tmp_path / "ref")
    ref = progress(tmp_path / "ref")
    records = [json.loads(line) for line in (tmp_path / "ref/metrics.jsonl").read_text().splitlines()]
    batches = {(r["stage"], r["micro_batch"]) for r in records if r["kind"] == "train"}
    assert batches == {("lstm", 128), ("transformer", 128), ("mlp", 256)}
    total = ref["total_steps"]
    mlp_start = 2 * (total // 5)  # lstm and transformer: 2 units each, the MLP 1 unit plus the remainder
    steps = [mlp_start - 3, 4, total - mlp_start - 1]  # session 2 ends one step into the MLP
    assert min(steps) > 0
    final = run_split(relay_cli, spec, tmp_path / "split", steps)
    assert final["weights_sha256"] == ref["weights_sha256"]
