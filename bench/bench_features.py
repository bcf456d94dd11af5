"""Benchmark 3: price-model feature preparation, first (extract + write parquet) vs second (cache hit).

Realistic size: 60k train + 15k test synthetic rows shaped like the Amazon ML Challenge, real-size feature
params (max_len 256, vocabulary cap 128100). Three timings of `PriceModelRecipe.prepare()` in one process:
  first      empty cache: read CSVs, train the tokenizer, tokenize, parse quantities, write parquet
  second     same cache dir: input hashes come from the size+mtime memo, parquet read memory-mapped
  published  empty writable dir + the first cache as a read-only dir (a mounted Kaggle features dataset):
             no memo there, so both CSVs are fully sha256-hashed before the hit
Run: `python bench/bench_features.py [--train N --test N]`; `run()` returns the named figures.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

try:
    import relay  # noqa: F401
except ImportError:  # run as a script from a checkout without an installed package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from machine import describe  # noqa: E402  (bench/machine.py)
from relay.kernel.recipes import price_data
from relay.kernel.recipes.price_model import PriceModelParams, PriceModelRecipe

TARGET_SPEEDUP = 10.0
FEATURE_PARAMS = dict(max_len=256, vocab_size=128100)


def _timed_prepare(data_dir: Path, cache_dirs: list[Path]) -> tuple[float, PriceModelRecipe]:
    recipe = PriceModelRecipe(PriceModelParams(**FEATURE_PARAMS), data_dir=data_dir, cache_dirs=cache_dirs, seed=0)
    start = time.perf_counter()
    recipe.prepare()
    return time.perf_counter() - start, recipe


def run(n_train: int = 60_000, n_test: int = 15_000, workdir: Path | None = None) -> dict:
    import tokenizers  # noqa: F401  (imported up front: the first timing should not pay for imports)

    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        data_dir, cache, own = Path(tmp) / "data", Path(tmp) / "cache", Path(tmp) / "own"
        price_data.generate(data_dir, n_train, n_test, seed=0)
        first_s, first = _timed_prepare(data_dir, [cache])
        second_s, second = _timed_prepare(data_dir, [cache])
        published_s, published = _timed_prepare(data_dir, [own, cache])
        assert [first.feature_cache.events[0].hit, second.feature_cache.events[0].hit,
                published.feature_cache.events[0].hit] == [False, True, True], "unexpected cache behaviour"
        assert (first.ids_values == second.ids_values).all(), "cache hit returned different token ids"
        parquet = first.feature_cache.events[0].path
        figures = {
            "features_rows": n_train + n_test,
            "features_csv_mb": round(sum(p.stat().st_size for p in data_dir.iterdir()) / 2**20, 2),
            "features_parquet_mb": round(parquet.stat().st_size / 2**20, 2),
            "features_tokens_per_row": round(len(first.ids_values) / (n_train + n_test), 1),
            "features_first_s": round(first_s, 3),
            "features_second_s": round(second_s, 3),
            "features_published_s": round(published_s, 3),
            "features_speedup": round(first_s / second_s, 1),
            "features_published_speedup": round(first_s / published_s, 1),
            "features_target_speedup": TARGET_SPEEDUP,
        }
    figures["features_meets_target"] = figures["features_speedup"] >= TARGET_SPEEDUP
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=60_000)
    parser.add_argument("--test", type=int, default=15_000)
    args = parser.parse_args(argv)
    figures = run(args.train, args.test)
    print(json.dumps(figures, indent=1))
    print(describe())
    print(f"feature cache: second preparation {figures['features_speedup']}x faster than the first "
          f"(target >= {TARGET_SPEEDUP:g}x; from a published read-only cache: {figures['features_published_speedup']}x)")
    return 0 if figures["features_meets_target"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
