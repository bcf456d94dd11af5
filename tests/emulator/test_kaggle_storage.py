"""A private account's dataset storage (docs/kaggle.md, "Where the emulator holds to Kaggle"): every version counts
against a quota, past it a create is answered with success and the dataset then 404s (kaggle-cli #284); Kaggle has
no per-version delete, only `delete_old_versions` on a new version. The relay keeps at most
kaggle.checkpoint_versions versions and says what it stores. Real `kaggle` client against the emulator."""
from __future__ import annotations

import pytest

from kaggle_fixtures import USER, backend_for, isolated_env, make_emulator  # noqa: F401
from relay.orchestrator import storage
from relay.orchestrator.chain import Names
from relay.orchestrator.kaggle.types import PublishError


def _folder(tmp_path, name: str, size: int):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "state.bin").write_bytes(name.encode().ljust(size, b"x"))  # each folder's own bytes
    return folder


def test_past_the_private_storage_quota_a_create_reports_success_and_the_dataset_is_absent(make_emulator, tmp_path):
    emu = make_emulator(private_storage_bytes=10_000)
    backend = backend_for(emu)
    backend.publish_folder(_folder(tmp_path, "small", 4_000), f"{USER}/fits-in-quota", "Fits in quota")
    with pytest.raises(PublishError, match=r"does not show it: the account's private dataset storage is likely full"):
        backend.publish_folder(_folder(tmp_path, "big", 8_000), f"{USER}/past-the-quota", "Past the quota")
    assert f"{USER}/past-the-quota" not in emu.store.datasets and emu.store.private_bytes(USER) < 10_000
    # what the API answered: success, then 404 (the client's create raised nothing)
    assert backend.dataset_info(f"{USER}/past-the-quota") is None


def test_the_relay_keeps_at_most_its_checkpoint_versions_through_delete_old_versions(make_emulator, tmp_path):
    # 5 versions of 3000 bytes would need 15 KB: the quota holds 10 KB, so only a bounded dataset fits (the quota
    # is checked before the old versions go: 2 kept + the new one, at the moment it is made)
    emu = make_emulator(private_storage_bytes=10_000)
    backend = backend_for(emu)
    names = Names(USER, "bounded")
    held = []
    for n in range(1, 6):
        result = backend.publish_folder(_folder(tmp_path, f"v{n}", 3_000), names.checkpoint_dataset,
                                        "bounded checkpoint", f"session {n}", keep_versions=2)
        assert result.version == n  # numbers go on past the deleted versions
        held.append(backend.dataset_versions(names.checkpoint_dataset))
    assert held == [[1], [1, 2], [3], [3, 4], [5]]
    assert emu.store.private_bytes(USER) <= 2 * 3_200  # two versions' state.bin and relay-publish.json

    stored = storage.relay_storage(backend, names)
    (ckpt,) = stored["datasets"].values()
    assert ckpt["versions"] == 1 and 3_000 < ckpt["bytes"] < 3_300 and stored["bytes"] == ckpt["bytes"]
    line = storage.storage_line(stored, 2)
    assert line.startswith("stored on Kaggle: 1 dataset version(s), 3.") and line.endswith("at most 2"), line


def test_without_a_bound_the_same_versions_overflow_the_quota(make_emulator, tmp_path):
    emu = make_emulator(private_storage_bytes=10_000)
    backend = backend_for(emu, attempts=3)
    backend.publisher.wait_s = 3.0  # a dropped version never shows: the publisher's wait ends, said as storage
    dataset = f"{USER}/unbounded-ckpt"
    for n in (1, 2, 3):
        backend.publish_folder(_folder(tmp_path, f"v{n}", 3_000), dataset, "unbounded checkpoint", f"session {n}")
    with pytest.raises(PublishError, match=r"private dataset storage is likely full"):
        backend.publish_folder(_folder(tmp_path, "v4", 3_000), dataset, "unbounded checkpoint", "session 4")
    assert [v["number"] for v in emu.store.datasets[dataset]["versions"]] == [1, 2, 3]
