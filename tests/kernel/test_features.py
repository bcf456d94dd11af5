"""Parquet feature cache: hit, miss on every part of the fingerprint, corruption, atomicity, read-only dirs."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pytest

from relay.kernel.session.features import FeatureCache, fingerprint, source_version
from relay.shared.errors import InputError


class Builder:
    """A build function that counts its calls and derives its table from the input file."""

    def __init__(self, source: Path, rows: int = 2000):
        self.source, self.rows, self.calls = source, rows, 0

    def __call__(self) -> pa.Table:
        self.calls += 1
        text = self.source.read_text()
        table = pa.table({"row": pa.array(range(self.rows), type=pa.int64()),
                          "ids": pa.array([[i, len(text)] for i in range(self.rows)], type=pa.list_(pa.int32()))})
        return table.replace_schema_metadata({"source": text})


@pytest.fixture
def setup(tmp_path):
    source = tmp_path / "data" / "train.csv"
    source.parent.mkdir()
    source.write_text("a,b\n1,2\n")
    return source, Builder(source), tmp_path / "cache"


def get(cache_dir, source, build, params=None, version="v1", **kwargs):
    dirs = cache_dir if isinstance(cache_dir, list) else [cache_dir]
    return FeatureCache(dirs, **kwargs).get_or_build("feats", [source], params or {"max_len": 64}, version, build)


def entry_files(directory: Path, suffix: str) -> list[Path]:
    return sorted(directory.glob(f"feats-*{suffix}"))


def test_hit_skips_build_and_returns_the_same_table(setup):
    source, build, cache_dir = setup
    first = get(cache_dir, source, build)
    second = get(cache_dir, source, build)
    assert build.calls == 1
    assert second.equals(first) and second.schema.metadata[b"source"] == b"a,b\n1,2\n"
    cache = FeatureCache([cache_dir])
    cache.get_or_build("feats", [source], {"max_len": 64}, "v1", build)
    assert [e.hit for e in cache.events] == [True]


def test_input_content_change_misses_even_with_same_size(setup):
    source, build, cache_dir = setup
    get(cache_dir, source, build)
    source.write_text("a,b\n1,3\n")  # same size, new content (and a new mtime)
    table = get(cache_dir, source, build)
    assert build.calls == 2 and table.schema.metadata[b"source"] == b"a,b\n1,3\n"


def test_mtime_memo_is_the_documented_trade_off(setup):
    source, build, cache_dir = setup
    get(cache_dir, source, build)
    stat = source.stat()
    source.write_text("a,b\n9,9\n")
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size AND same mtime: the memo trusts it
    get(cache_dir, source, build)
    assert build.calls == 1
    get(cache_dir, source, build, trust_mtime=False)  # full re-hash sees the new content
    assert build.calls == 2


def test_param_and_code_version_changes_miss_and_old_entries_still_hit(setup):
    source, build, cache_dir = setup
    get(cache_dir, source, build, params={"max_len": 64})
    get(cache_dir, source, build, params={"max_len": 128})
    assert build.calls == 2
    get(cache_dir, source, build, params={"max_len": 128}, version="v2")
    assert build.calls == 3
    get(cache_dir, source, build, params={"max_len": 64})
    assert build.calls == 3
    assert len(entry_files(cache_dir, ".parquet")) == 3


def test_source_version_follows_the_code():
    def extract_a(x):
        return x + 1

    def extract_b(x):
        return x + 2

    assert source_version(extract_a) != source_version(extract_b)
    assert source_version(extract_a) == source_version(extract_a)


def test_fingerprint_ignores_where_the_inputs_live(tmp_path):
    for folder in ("local", "kaggle_input"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "train.csv").write_text("same bytes")
    key_local, _ = fingerprint([tmp_path / "local" / "train.csv"], {"p": 1}, "v")
    key_kaggle, detail = fingerprint([tmp_path / "kaggle_input" / "train.csv"], {"p": 1}, "v")
    assert key_local == key_kaggle and detail["inputs"][0]["name"] == "train.csv"
    (tmp_path / "kaggle_input" / "extra.csv").write_text("x")
    key_dir_a, _ = fingerprint([tmp_path / "kaggle_input"], {"p": 1}, "v")
    (tmp_path / "kaggle_input" / "extra.csv").write_text("y")
    key_dir_b, _ = fingerprint([tmp_path / "kaggle_input"], {"p": 1}, "v")
    assert key_dir_a != key_dir_b


@pytest.mark.parametrize("damage", ["flip_bytes", "truncate", "bad_meta", "meta_other_key"])
def test_corrupt_entry_rebuilds(setup, damage):
    source, build, cache_dir = setup
    good = get(cache_dir, source, build)
    parquet, meta = entry_files(cache_dir, ".parquet")[0], entry_files(cache_dir, ".json")[0]
    data = bytearray(parquet.read_bytes())
    if damage == "flip_bytes":  # same size: caught by the parquet page checksums
        for i in range(len(data) // 3, len(data) // 3 + 64):
            data[i] ^= 0xFF
        parquet.write_bytes(bytes(data))
    elif damage == "truncate":
        parquet.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "bad_meta":
        meta.write_text("{not json")
    else:
        meta.write_text(json.dumps({**json.loads(meta.read_text()), "key": "0" * 64}))
    rebuilt = get(cache_dir, source, build)
    assert build.calls == 2 and rebuilt.equals(good)
    assert get(cache_dir, source, build).equals(good) and build.calls == 2  # the rebuilt entry hits


def test_half_written_files_are_ignored(setup):
    source, build, cache_dir = setup
    get(cache_dir, source, build)
    parquet, meta = entry_files(cache_dir, ".parquet")[0], entry_files(cache_dir, ".json")[0]
    # A crash after the parquet rename but before the meta: no meta -> not an entry.
    meta.unlink()
    # ...and a stray temp file from a writer killed mid-write next to it.
    (cache_dir / f".{parquet.name}.tmp-99999").write_bytes(b"PAR1 half a file")
    get(cache_dir, source, build)
    assert build.calls == 2
    assert get(cache_dir, source, build) is not None and build.calls == 2


def test_read_only_later_dir_is_used_on_hit_and_never_written(setup, tmp_path):
    source, build, published = setup
    good = get(published, source, build)
    before = {p.name: p.stat().st_mtime_ns for p in published.iterdir()}
    session_dir = tmp_path / "session_cache"
    for path in [published, *published.iterdir()]:
        path.chmod(0o555 if path.is_dir() else 0o444)
    try:
        table = get([session_dir, published], source, build)
    finally:
        for path in [published, *published.iterdir()]:
            path.chmod(0o755 if path.is_dir() else 0o644)
    assert build.calls == 1 and table.equals(good)
    assert {p.name: p.stat().st_mtime_ns for p in published.iterdir()} == before
    assert not list(session_dir.glob("*.parquet"))
    # A miss in every dir builds into the FIRST (writable) one.
    get([session_dir, published], source, build, params={"max_len": 1})
    assert build.calls == 2 and len(list(session_dir.glob("*.parquet"))) == 1
    assert len(list(published.glob("*.parquet"))) == 1


def test_reads_are_memory_mapped(setup, monkeypatch):
    source, build, cache_dir = setup
    get(cache_dir, source, build)
    mapped = []
    real_memory_map = pa.memory_map
    monkeypatch.setattr(pa, "memory_map", lambda path, *a, **k: mapped.append(Path(path)) or real_memory_map(path, *a, **k))
    table = get(cache_dir, source, build)
    assert build.calls == 1 and table.num_rows == build.rows
    assert mapped == entry_files(cache_dir, ".parquet")


def test_meta_records_what_the_key_was_built_from(setup):
    source, build, cache_dir = setup
    get(cache_dir, source, build, params={"max_len": 64})
    meta = json.loads(entry_files(cache_dir, ".json")[0].read_text())
    assert meta["rows"] == build.rows and meta["columns"] == ["row", "ids"]
    assert meta["fingerprint"]["params"] == {"max_len": 64} and meta["fingerprint"]["version"] == "v1"
    assert meta["fingerprint"]["inputs"][0]["name"] == "train.csv"
    assert meta["bytes"] == entry_files(cache_dir, ".parquet")[0].stat().st_size


def test_bad_usage_is_a_clear_error(setup):
    source, build, cache_dir = setup
    with pytest.raises(ValueError, match="feature cache name"):
        FeatureCache([cache_dir]).get_or_build("bad/name", [source], {}, "v", build)
    with pytest.raises(InputError, match="missing.csv"):
        FeatureCache([cache_dir]).get_or_build("feats", [source.parent / "missing.csv"], {}, "v", build)
    with pytest.raises(TypeError, match="expected pyarrow.Table"):
        FeatureCache([cache_dir]).get_or_build("feats", [source], {}, "v", lambda: {"a": [1]})
    with pytest.raises(ValueError, match="at least one directory"):
        FeatureCache([])

