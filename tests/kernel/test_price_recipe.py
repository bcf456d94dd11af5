"""Price-model recipe (seed 004) on synthetic data: data, parsing, features, learning, predict, export."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from pydantic import ValidationError  # noqa: E402

from relay.kernel.recipes import price_data  # noqa: E402
from relay.kernel.recipes.price_model import PriceModelParams, PriceModelRecipe, load_exported, smape  # noqa: E402
from relay.shared.errors import InputError  # noqa: E402

torch.set_num_threads(1)
TINY = dict(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, max_len=48, vocab_size=2000,
            side_dim=32, dropout=0.0, eval_fraction=0.2)


def make_recipe(data_dir: Path, cache_dir: Path, **overrides) -> PriceModelRecipe:
    recipe = PriceModelRecipe(PriceModelParams(**{**TINY, **overrides}), data_dir=data_dir,
                              cache_dirs=[cache_dir], seed=0)
    recipe.prepare()
    return recipe


def eval_batches(recipe: PriceModelRecipe, size: int = 16) -> list[dict[str, torch.Tensor]]:
    dataset = recipe.eval_dataset()
    return [recipe.collate([dataset[i] for i in range(s, min(s + size, len(dataset)))])
            for s in range(0, len(dataset), size)]


def evaluate(recipe: PriceModelRecipe, model: torch.nn.Module) -> dict[str, float]:
    model.eval()
    with torch.no_grad():
        metrics = recipe.evaluate(model, eval_batches(recipe))
    model.train()
    return metrics


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("price_data")
    price_data.generate(directory, n_train=800, n_test=120, seed=7)
    return directory


@pytest.fixture(scope="module")
def recipe(data_dir, tmp_path_factory) -> PriceModelRecipe:
    """The tiny config, prepared: what the tests that train no model of their own need (an xdist worker handed
    only these does not make `trained`)."""
    return make_recipe(data_dir, tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def trained(recipe):
    """A hand-written loop (batch 8, AdamW) over the tiny config: metrics before and after 250 steps."""
    torch.manual_seed(0)
    model = recipe.build_model()
    start = evaluate(recipe, model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    dataset, generator, steps = recipe.train_dataset(), torch.Generator().manual_seed(0), 0
    while steps < 250:
        order = torch.randperm(len(dataset), generator=generator).tolist()
        for s in range(0, len(order) - 7, 8):
            loss = recipe.loss(model, recipe.collate([dataset[i] for i in order[s: s + 8]]))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps += 1
            if steps == 250:
                break
    return recipe, model, start, evaluate(recipe, model)


# ------------------------------------------------------------------------------------------------- data
def test_generated_files_are_shaped_like_the_challenge_and_deterministic(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    price_data.generate(a, 50, 10, seed=1)
    price_data.generate(b, 50, 10, seed=1)
    price_data.generate(c, 50, 10, seed=2)
    for name in ("train.csv", "test.csv"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
        assert (a / name).read_bytes() != (c / name).read_bytes()
    train, test = pd.read_csv(a / "train.csv"), pd.read_csv(a / "test.csv")
    assert list(train.columns) == ["sample_id", "catalog_content", "price"] and len(train) == 50
    assert list(test.columns) == ["sample_id", "catalog_content"] and len(test) == 10
    assert train["catalog_content"].str.startswith("Item Name: ").all() and (train["price"] > 0).all()
    assert not set(train["sample_id"]) & set(test["sample_id"])


def test_price_depends_on_the_text():
    train, _ = price_data.make_frames(3000, 0, seed=3)
    pack = np.array([price_data.parse_quantities(t)["pack"] for t in train["catalog_content"]])
    log_price = np.log(train["price"].to_numpy())
    assert log_price[pack >= 6].mean() > log_price[pack == 1].mean() + 0.8
    premium = train["catalog_content"].str.contains(" Gourmet ").to_numpy()
    assert log_price[premium].mean() > log_price[~premium].mean()


@pytest.mark.parametrize("text, pack, size_dim, size_base, total_base", [
    ("Item Name: La Victoria Taco Sauce, 12 Ounce (Pack of 6)\nValue: 72.0\nUnit: Fl Oz\n",
     6, "mass", 12 * 28.3495, 72 * 29.5735),
    ("Item Name: Foo Water 16.9 fl oz, 24-Pack\n", 24, "volume", 16.9 * 29.5735, 24 * 16.9 * 29.5735),
    ("Item Name: Bar Vitamin C 120 ct\nValue: n/a\nUnit: Count\n", 1, "count", 120, 120),
    ("Item Name: Baz Flour, 500g, Set of 3\n", 3, "mass", 500, 1500),
    ("Item Name: Qux Rice 2 lb\nValue: 1.0\nUnit: Kilogram\n", 1, "mass", 2 * 453.592, 1000),
    ("Item Name: Nothing measurable\n", 1, None, 0.0, 0.0),
])
def test_quantity_parsing(text, pack, size_dim, size_base, total_base):
    q = price_data.parse_quantities(text)
    assert q["pack"] == pack and q["size_dim"] == size_dim
    assert q["size_base"] == pytest.approx(size_base) and q["total_base"] == pytest.approx(total_base)


def test_brand_and_category_come_from_the_item_name():
    assert price_data.brand_and_category("Item Name: Kalo Organic Green Tea, 20 Count\n") == ("kalo", "tea")


def test_bad_csv_is_a_one_line_error_naming_file_and_column(tmp_path):
    pd.DataFrame({"sample_id": [1], "catalog_content": ["x"]}).to_csv(tmp_path / "train.csv", index=False)
    with pytest.raises(ValueError, match=r"train\.csv: missing column\(s\) price"):
        price_data.read_split(tmp_path / "train.csv", price_data.TRAIN_COLUMNS)
    pd.DataFrame({"sample_id": [1, 2], "catalog_content": ["x", "y"], "price": [1.0, -2]}).to_csv(
        tmp_path / "train.csv", index=False)
    with pytest.raises(ValueError, match=r"train\.csv: price must be a number >= 0 \(line 3"):
        price_data.read_split(tmp_path / "train.csv", price_data.TRAIN_COLUMNS)
    with pytest.raises(InputError, match=r"nowhere[/\\]train\.csv: file not found"):
        make_recipe(tmp_path / "nowhere", tmp_path / "cache")


def test_params_are_validated():
    with pytest.raises(ValidationError, match="hidden_size \\(64\\) must be divisible by num_heads \\(3\\)"):
        PriceModelParams(**{**TINY, "num_heads": 3})
    with pytest.raises(ValidationError, match="extra_forbidden|Extra inputs"):
        PriceModelParams(**TINY, hidden=3)
    with pytest.raises(ValidationError, match="eval_fraction"):
        PriceModelParams(**{**TINY, "eval_fraction": 1.5})


# --------------------------------------------------------------------------------- features and datasets
def test_prepare_splits_rows_and_second_prepare_hits_the_cache(data_dir, tmp_path):
    first = make_recipe(data_dir, tmp_path / "cache")
    assert (len(first.train_rows), len(first.eval_rows), len(first.test_rows)) == (640, 160, 120)
    assert not set(first.train_rows) & set(first.eval_rows)
    second = make_recipe(data_dir, tmp_path / "cache")
    assert [e.hit for e in first.feature_cache.events] == [False]
    assert [e.hit for e in second.feature_cache.events] == [True]
    assert np.array_equal(first.ids_values, second.ids_values) and first.brands == second.brands
    # A read-only published cache hits for a session with an empty cache of its own.
    third = PriceModelRecipe(first.params, data_dir=data_dir, cache_dirs=[tmp_path / "own", tmp_path / "cache"], seed=0)
    third.prepare()
    assert [e.hit for e in third.feature_cache.events] == [True]
    # Shape params that the features do not depend on reuse them; max_len does not.
    assert make_recipe(data_dir, tmp_path / "cache", hidden_size=32).feature_cache.events[0].hit
    assert not make_recipe(data_dir, tmp_path / "cache", max_len=32).feature_cache.events[0].hit


def test_items_are_pure_functions_of_the_index_and_collate_pads(recipe):
    dataset = recipe.train_dataset()
    for i in (0, 5, len(dataset) - 1):
        a, b = dataset[i], dataset[i]
        assert np.array_equal(a["input_ids"], b["input_ids"]) and a["target"] == b["target"]
    batch = recipe.collate([dataset[i] for i in range(8)])
    lengths = batch["attention_mask"].sum(1)
    assert batch["input_ids"].shape[1] % 8 == 0 and batch["input_ids"].shape[1] <= recipe.params.max_len
    assert (batch["input_ids"][:, 0] == recipe.special_ids["cls"]).all()
    assert all(batch["input_ids"][r, lengths[r]:].eq(recipe.special_ids["pad"]).all() for r in range(8))
    assert batch["numeric"].shape == (8, 9) and batch["target"].dtype == torch.float32


# --------------------------------------------------------------------------------------------- learning
def test_training_lowers_smape_clearly(trained):
    _, _, start, end = trained
    print(f"SMAPE {start['smape']:.1f} -> {end['smape']:.1f}, loss {start['loss']:.3f} -> {end['loss']:.3f}")
    assert end["smape"] < 0.6 * start["smape"] and end["loss"] < 0.4 * start["loss"]


def test_smape_matches_the_challenge_definition():
    assert smape(np.array([100.0, 0.0]), np.array([50.0, 0.0])) == pytest.approx(100 * (50 / 75) / 2)
    assert smape(np.array([1.0]), np.array([1.0])) == 0.0


def test_activation_checkpointing_keeps_gradients_and_uses_the_current_api(recipe):
    batch = recipe.collate([recipe.train_dataset()[i] for i in range(4)])
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(1)
        model = recipe.build_model()
        if checkpointing:
            with warnings.catch_warnings():
                warnings.simplefilter("error", FutureWarning)
                assert recipe.enable_activation_checkpointing(model)
        recipe.loss(model, batch).backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads))


# ------------------------------------------------------------------------------------ predict and export
def test_predict_writes_one_price_per_test_row(trained, data_dir, tmp_path):
    recipe, model, _, _ = trained
    path = recipe.predict(model, tmp_path / "out")
    assert path == tmp_path / "out" / "test_out.csv" and model.training
    out, test = pd.read_csv(path), pd.read_csv(data_dir / "test.csv")
    assert list(out.columns) == ["sample_id", "price"]
    assert out["sample_id"].tolist() == test["sample_id"].tolist()
    assert np.isfinite(out["price"]).all() and (out["price"] >= 0).all() and out["price"].nunique() > 10


def test_export_round_trips_through_safetensors(trained, tmp_path):
    from safetensors.torch import load_file

    recipe, model, _, _ = trained
    recipe.export(model, tmp_path / "export")
    assert {p.name for p in (tmp_path / "export").iterdir()} >= {"model.safetensors", "config.json", "tokenizer.json"}
    assert set(load_file(tmp_path / "export" / "model.safetensors")) == set(model.state_dict())
    restored = load_exported(tmp_path / "export")
    batch = eval_batches(recipe)[0]
    inputs = {k: v for k, v in batch.items() if k != "target"}
    model.eval()
    with torch.no_grad():
        assert torch.equal(restored(**inputs), model(**inputs))
    model.train()


def test_pretrained_loads_from_a_local_folder_and_falls_back_when_missing(recipe, data_dir, tmp_path, caplog):
    from transformers import DebertaV2Model, PreTrainedTokenizerFast

    torch.manual_seed(3)
    source = recipe.build_model().text_encoder
    source.save_pretrained(tmp_path / "local_model")
    PreTrainedTokenizerFast(tokenizer_object=recipe.tokenizer, unk_token="[UNK]", pad_token="[PAD]",
                            cls_token="[CLS]", sep_token="[SEP]").save_pretrained(tmp_path / "local_model")
    local = make_recipe(data_dir, tmp_path / "cache", pretrained=str(tmp_path / "local_model"))
    assert np.array_equal(local.ids_values, recipe.ids_values)  # same vocabulary -> same ids
    encoder = local.build_model().text_encoder
    assert isinstance(encoder, DebertaV2Model)
    assert torch.equal(encoder.embeddings.word_embeddings.weight, source.embeddings.word_embeddings.weight)

    missing = make_recipe(data_dir, tmp_path / "cache2", pretrained=str(tmp_path / "no_such_model"))
    assert isinstance(missing.build_model().text_encoder, DebertaV2Model)
    assert "not available offline" in caplog.text
