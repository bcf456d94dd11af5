"""Recsys recipe (seed 000): CSR reader and its errors, SVD/item-KNN/ALS as fit stages, ALS iterations resumed
across sessions with the same factor matrices."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from conftest import write_spec
from relay.kernel.recipes import recsys_data
from relay.kernel.recipes.recsys import RecsysParams, RecsysRecipe, load_exported
from relay.kernel.session import checkpoint
from relay.kernel.session.stages import Stage
from relay.shared.errors import InputError
from split_sessions import progress, random_splits, run_split

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]


def tiny_spec(data_dir: Path) -> dict:
    spec = yaml.safe_load((REPO / "examples/recsys-tiny.yaml").read_text())
    spec["params"] = {**spec["params"], "data_dir": str(data_dir)}
    return spec


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("recsys")
    recsys_data.generate(directory, 20000, 600, 400, rank=6, seed=1)
    return directory


# ----------------------------------------------------------------------------------------------- reading
def test_reader_keeps_needed_columns_compact_and_csr_matches_the_ratings(data_dir):
    frame = recsys_data.read_ratings(data_dir / "ratings.csv")
    assert list(frame.columns) == ["userId", "movieId", "rating"]  # timestamp never read
    assert [str(t) for t in frame.dtypes] == ["int32", "int32", "float32"]
    rows, cols = frame["userId"].to_numpy() - 1, frame["movieId"].to_numpy() - 1
    csr = recsys_data.CSR.from_coo(rows, cols, frame["rating"].to_numpy(), (600, 400))
    dense = np.zeros((600, 400), dtype=np.float32)
    dense[rows, cols] = frame["rating"].to_numpy()
    for r in (0, 17, 599):
        cols_r = csr.indices[csr.indptr[r]: csr.indptr[r + 1]]
        assert np.array_equal(cols_r, np.flatnonzero(dense[r])) and np.array_equal(csr.data[csr.indptr[r]: csr.indptr[r + 1]], dense[r, cols_r])
    t = csr.transpose()
    assert t.shape == (400, 600) and t.nnz == csr.nnz and csr.data.dtype == np.float32 and csr.indices.dtype == np.int32


@pytest.mark.parametrize("content, message", [
    ("userId,rating\n1,4\n", r"ratings\.csv: missing column\(s\) movieId"),
    ("userId,movieId,rating\n1,2,4\n1,x,3\n", r"ratings\.csv: line 3: movieId must be an integer id \(got 'x'\)"),
    ("userId,movieId,rating\n1,2,4\n1,3,good\n", r"ratings\.csv: line 3: rating must be a number \(got 'good'\)"),
    ("userId,movieId,rating\n1,2,4\n1,3,\n", r"ratings\.csv: line 3: rating is missing \(NaN\)"),
    ("userId,movieId,rating\n1,2,4\n2,3,NaN\n", r"ratings\.csv: line 3: rating is missing \(NaN\)"),
    ("userId,movieId,rating\n", r"ratings\.csv: no ratings"),
    ("userId,movieId,rating\n1,2,4\n1,3,inf\n", r"ratings\.csv: line 3: rating must be finite \(got inf\)"),
    ("userId,movieId,rating\n1,2,4\n1,3,-Infinity\n", r"ratings\.csv: line 3: rating must be finite \(got -inf\)"),
    ("userId,movieId,rating\n1,2,4\n1,3,4,9\n", r"ratings\.csv: line 3: 4 fields, expected 3 \(the header's\)"),
    ("userId,movieId,rating\n1,2,4\n1,3\n", r"ratings\.csv: line 3: 2 fields, expected 3 \(the header's\)"),
    ("userId,movieId,rating,timestamp\r\n1,2,4,5\r\n\r\n1,3,4", r"ratings\.csv: line 4: 3 fields, expected 4"),
])
def test_bad_rating_files_are_one_line_errors_naming_the_line(tmp_path, content, message):
    (tmp_path / "ratings.csv").write_text(content)
    with pytest.raises(InputError, match=message):
        recsys_data.read_ratings(tmp_path / "ratings.csv")


def test_duplicates_empty_split_and_the_cli_exit_2(tmp_path, relay_cli):
    (tmp_path / "dup").mkdir()
    (tmp_path / "dup/ratings.csv").write_text("userId,movieId,rating\n1,2,4\n1,3,3\n1,2,5\n")
    with pytest.raises(InputError, match=r"line 4: user 1 rated movie 2 again \(first on line 2\)"):
        RecsysRecipe(RecsysParams(), data_dir=tmp_path / "dup", cache_dirs=[], seed=0).prepare()
    (tmp_path / "one").mkdir()
    (tmp_path / "one/ratings.csv").write_text("userId,movieId,rating\n1,2,4\n2,2,3\n")
    with pytest.raises(InputError, match=r"ratings\.csv: 2 ratings leave an empty held-out split"):
        RecsysRecipe(RecsysParams(), data_dir=tmp_path / "one", cache_dirs=[], seed=0).prepare()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad/ratings.csv").write_text("userId,movieId,rating\n1,2,4\n1,3,\n")
    proc = relay_cli.train(write_spec(tmp_path, tiny_spec(tmp_path / "bad")), tmp_path / "wd", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"relay: error: {tmp_path / 'bad/ratings.csv'}: line 3: rating is missing (NaN); every row needs one")
    assert not (tmp_path / "wd/checkpoints").exists() and not (tmp_path / "wd/progress.json").exists()


def test_user_cap_samples_users_by_seed(data_dir):
    def users(seed):
        r = RecsysRecipe(RecsysParams(max_users=100, sample_seed=seed), data_dir=data_dir, cache_dirs=[], seed=0)
        r.prepare()
        return r.user_ids

    assert len(users(0)) == 100 and np.array_equal(users(0), users(0)) and not np.array_equal(users(0), users(1))


# ------------------------------------------------------------------------------------------------ the relay
@pytest.fixture(scope="module")
def reference(relay_cli, data_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("recsys-ref")
    spec = write_spec(root, tiny_spec(data_dir))
    relay_cli.train(spec, root / "wd")
    return spec, root / "wd", progress(root / "wd")


def test_models_beat_the_user_mean_baseline(reference):
    import json

    _, workdir, final = reference
    evals = {r["step"]: r for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "eval"}
    baseline = evals[1]["rmse_user_mean"]
    assert evals[1]["rmse_svd"] < baseline and evals[7]["rmse_als"] < 0.9 * baseline
    assert evals[1]["precision_at_10"] > 0.02  # ~7x a random pick of the unseen items here
    assert [evals[s]["rmse_als"] for s in (3, 5, 7)] == sorted([evals[s]["rmse_als"] for s in (3, 5, 7)], reverse=True)
    assert final["metrics"]["peak_rss_mb"] > 0
    assert final["best"] is None  # SVD, item-KNN and ALS RMSEs are not one model's to rank (keep_best not applied)
    model = load_exported(workdir / "export")
    assert checkpoint.weights_sha256(model.state_dict()) == final["weights_sha256"]


def test_sessions_ending_between_als_iterations_end_with_the_same_factor_matrices(reference, relay_cli, tmp_path):
    spec, ref_dir, ref = reference
    final = run_split(relay_cli, spec, tmp_path / "split", random_splits(7, 4, seed=3))
    assert final["weights_sha256"] == ref["weights_sha256"]
    a = torch.load(tmp_path / "split" / final["checkpoint"] / checkpoint.STATE_FILE, weights_only=True)["objects"]["model"]
    b = torch.load(ref_dir / ref["checkpoint"] / checkpoint.STATE_FILE, weights_only=True)["objects"]["model"]
    for name in ("svd_user", "svd_item", "knn_index", "knn_sim", "als_user", "als_item"):
        assert torch.equal(a[name], b[name]), name


def test_als_gives_a_row_with_no_training_ratings_zero_factors_not_a_singular_solve():
    # `relay data recsys` at its default size leaves some movies rated only in the held-out split.
    from relay.kernel.recipes.recsys_data import CSR

    m = CSR.from_coo(np.array([0, 0, 2]), np.array([0, 1, 1]), np.array([1.0, 2.0, 3.0]), (3, 2))  # row 1 empty
    recipe = RecsysRecipe(RecsysParams(), data_dir=Path("."), cache_dirs=[], seed=0)
    target, fixed = torch.full((3, 2), 9.0), torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    recipe._solve(target, fixed, m, m.data)
    assert torch.equal(target[1], torch.zeros(2)) and torch.isfinite(target).all()
    assert target[0, 0] == pytest.approx(1.0 / 1.2) and target[2, 1] == pytest.approx(3.0 / 1.1)


# ---------------------------------------------------------------------------------- processes per session
def test_a_fit_only_recipe_runs_in_one_process_on_a_t4_x2(monkeypatch, capsys):
    """micro-batch 1 x 1 over the 2 processes of `devices: auto` on a T4 x2 stopped the run (exit 2): closed-form
    fits have no batch to split, so the recsys recipe takes one process; a gradient recipe still takes both."""
    from relay.cli import main
    from relay.kernel.session import distributed
    from relay.shared import spec as spec_mod

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # a T4 x2 on this CPU machine
    recsys, legal = (spec_mod.load(REPO / f"examples/{n}-t4.yaml") for n in ("recsys", "legal"))
    assert distributed.world_size_for(recsys.session.devices, "cuda", recsys.recipe_params().fit_only) == 1
    assert distributed.world_size_for(legal.session.devices, "cuda", legal.recipe_params().fit_only) == 2
    assert main(["plan", str(REPO / "examples/recsys-t4.yaml"), "--step-seconds", "60"]) == 0
    assert "processes per session: 1 (session.devices: auto, recipe recsys is made only of fit stages)" in (
        capsys.readouterr().out)


def test_several_devices_asked_for_a_fit_only_recipe_is_a_one_line_spec_error(tmp_path):
    from relay.shared import spec as spec_mod

    spec = yaml.safe_load((REPO / "examples/recsys-t4.yaml").read_text())
    spec["session"]["devices"] = 2
    path = write_spec(tmp_path, spec)
    with pytest.raises(spec_mod.SpecError) as err:
        spec_mod.load(path)
    assert str(err.value) == (f"{path}: session.devices: recipe recsys is made only of closed-form fits, which run"
                              " in one process (no batch to split); set 1 or auto (got 2)")


@pytest.mark.parametrize("example", ["legal", "price", "recsys", "temporal", "vqa"])
def test_params_fit_only_matches_the_recipes_stages(example, tmp_path):
    """`fit_only` is declared torch-free on the Params class; it must say what the recipe's stages say."""
    from relay.kernel import recipes
    from relay.shared import spec as spec_mod

    spec = spec_mod.load(REPO / f"examples/{example}-tiny.yaml")
    recipe = recipes.get(spec.recipe)(spec.recipe_params(), data_dir=tmp_path, cache_dirs=[tmp_path], seed=0)
    assert spec.recipe_params().fit_only == all(s.fit for s in recipe.stages())


def test_item_knn_similarity_accumulated_in_user_batches_equals_one_batch(data_dir):
    """_fit_knn sums dense user slices (500 users by default) into the item x item similarity instead of one
    dense users x items matrix: the batching must not change the neighbours (600 users: 500 + 100, 7 x 86)."""
    def knn(user_batch):
        recipe = RecsysRecipe(RecsysParams(max_users=None, knn_user_batch=user_batch), data_dir=data_dir,
                              cache_dirs=[], seed=0)
        recipe.prepare()
        model = recipe.build_model()
        recipe._fit_knn(model)  # on CPU here; on a GPU only under gpu_max_elements
        return model.knn_sim, model.knn_index

    one_sim, one_index = knn(10_000)
    for user_batch in (500, 7):
        sim, index = knn(user_batch)
        assert torch.allclose(sim, one_sim, atol=1e-5)
        assert (index == one_index).float().mean() > 0.99  # only near-ties may swap places


def test_item_knn_beats_the_user_mean_baseline(data_dir):
    """A held-out pair mostly has 0 or 1 rated neighbours among its item's 15: without the shrinkage term one
    weakly similar neighbour set the whole deviation from the user mean, and KNN scored worse than the mean."""
    def knn_rmse(shrinkage):
        recipe = RecsysRecipe(RecsysParams(max_users=None, knn_shrinkage=shrinkage), data_dir=data_dir,
                              cache_dirs=[], seed=0)
        recipe.prepare()
        model = recipe.build_model()
        recipe._fit_knn(model)
        recipe.begin_stage(model, Stage("knn", 1, fit=True))
        loader = torch.utils.data.DataLoader(recipe.eval_dataset(), batch_size=4096, collate_fn=recipe.collate)
        scores = recipe.evaluate(model, loader)
        return scores["rmse_knn"], scores["rmse_user_mean"]

    shrunk, baseline = knn_rmse(0.1)
    unshrunk, _ = knn_rmse(0.0)
    assert shrunk < baseline < unshrunk, (shrunk, baseline, unshrunk)
