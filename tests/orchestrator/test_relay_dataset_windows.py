"""Kaggle's dataset-version windows are waited out, never a failure: a new version refused (403) while the
previous one still processes (though its status reads READY), and a new version that 404s for a few reads
after its creation; processing that takes longer the larger the version, and a version whose processing ends
FAILED (published again). The emulator's `version_refused`, `version_404` and `dataset_failed` faults and its
processing polls count requests, not seconds. Real `kaggle` client, real Prefect flow, sessions running
`relay train`."""
from __future__ import annotations

import json

from relay_fixtures import STEPS_PER_SESSION, USER, backend_for  # noqa: F401

WINDOWS = {"version_refused": {"calls": 2}, "version_404": {"calls": 3}}
MAX_STEPS = 2 * STEPS_PER_SESSION  # two sessions: the second checkpoint version meets both windows


def test_a_publish_waits_out_both_windows(make_emulator, tmp_path):
    emu = make_emulator(faults=WINDOWS)
    backend = backend_for(emu)
    dataset = f"{USER}/windows-test"
    for number in (1, 2):
        folder = tmp_path / f"v{number}"
        folder.mkdir()
        (folder / "state.bin").write_bytes(bytes([number]) * 1000)
        result = backend.publish_folder(folder, dataset, "Windows test data", f"version {number}")
        assert (result.version, result.already_published) == (number, False)
    assert len(emu.store.datasets[dataset]["versions"]) == 2  # no version made twice
    assert emu.faults.injected["version_refused"] == 2  # the 2nd version was refused twice, then made
    assert emu.faults.injected["version_404"] == 6      # each new version 404'd three times, then was read


def test_a_relay_through_both_windows_ends_as_an_uninterrupted_run(relay_env, reference, monkeypatch):
    emu = relay_env.start(faults=WINDOWS)
    spec = relay_env.write_spec(**{"optim.max_steps": MAX_STEPS})
    reference.start(spec)
    summary = relay_env.run_flow(monkeypatch)
    assert summary["state"] == "done", summary
    runs = relay_env.kernel_runs()
    assert [r.run_id for r in runs] == ["toy-relay-s001-a1", "toy-relay-s002-a1"], runs  # none pushed twice
    published = [json.loads((emu.store.dataset_dir(relay_env.ckpt, v["number"]) / "progress.json").read_text())
                 for v in relay_env.ckpt_versions()]
    assert [p["run_id"] for p in published] == ["toy-relay-s001-a1", "toy-relay-s002-a1"]  # each handed over once
    assert emu.faults.injected["version_refused"] >= 2 and emu.faults.injected["version_404"] >= 6
    assert published[-1]["weights_sha256"] == reference.weights(spec)


def test_a_version_processes_in_polls_that_grow_with_its_size_and_a_failed_one_is_published_again(make_emulator,
                                                                                                   tmp_path):
    # one status poll per 1000 bytes; the 2nd version of every *-ckpt* dataset ends FAILED (kagglesdk
    # DatabundleVersionStatus.FAILED); a version refused while the previous one processes (kagglehub PR #182)
    emu = make_emulator(dataset_processing_bytes_per_poll=1000,
                        faults={"dataset_failed": {"versions": [2], "slugs": ["-ckpt"]},
                                "dataset_reprocessing": {"calls": 2}})
    backend = backend_for(emu)
    dataset = f"{USER}/failed-ckpt"
    results = []
    for number, size in ((1, 3000), (2, 9000)):
        folder = tmp_path / f"v{number}"
        folder.mkdir()
        (folder / "state.bin").write_bytes(bytes([number]) * size)
        results.append(backend.publish_folder(folder, dataset, "Failed test data", f"state {number}"))
    versions = emu.store.datasets[dataset]["versions"]
    assert [(v["number"], v["failed"]) for v in versions] == [(1, False), (2, True), (3, False)]
    assert [(r.version, r.created, r.already_published) for r in results] == [(1, True, False), (3, False, False)]
    assert emu.faults.injected["dataset_failed"] == 1
    assert {f.name: f.size for f in backend.list_dataset_files(dataset)}["state.bin"] == 9000  # the republished one
    assert all(v["polls_left"] == 0 for v in versions)  # every poll a version's size cost was spent, none skipped
    # and each version read REPROCESSING twice after them (waited out like any state but READY and FAILED)
    assert all(v["reprocess_left"] == 0 for v in versions) and emu.faults.injected["dataset_reprocessing"] == 6
    assert backend.dataset_info(dataset)["current"] == 3

    # a new version while the newest still processes: 403 (kagglehub PR #182), waited out by the publisher
    with emu.store.lock:
        versions[-1]["polls_left"] = 4
    folder = tmp_path / "v3"
    folder.mkdir()
    (folder / "state.bin").write_bytes(b"3" * 10)
    assert backend.publish_folder(folder, dataset, "Failed test data", "state 3").version == 4


def test_the_processing_states_and_the_failed_fault_setting(make_emulator):
    from relay.emulator.faults import FaultPlan
    from relay.shared.errors import InputError

    import pytest

    for bad in ({"versions": 2}, {"versions": [0]}, {"every": [1]}, {"versions": [1], "slugs": "ckpt"}):
        with pytest.raises(InputError, match=r"^faults: dataset_failed: expected"):
            FaultPlan({"dataset_failed": bad})
    assert FaultPlan({}).fails_processing("a/b-ckpt", 2) is False
    plan = FaultPlan({"dataset_failed": {"versions": [2]}})
    assert plan.fails_processing("a/anything", 2) and not plan.fails_processing("a/anything", 1)


def test_a_relay_whose_checkpoint_version_fails_processing_republishes_it_and_ends_as_an_uninterrupted_run(
        relay_env, reference, monkeypatch):
    # the 2nd checkpoint version ends FAILED; every version processes in polls (one per 4 KB)
    emu = relay_env.start(dataset_processing_bytes_per_poll=4096,
                          faults={"dataset_failed": {"versions": [2], "slugs": ["-ckpt"]}})
    spec = relay_env.write_spec(**{"optim.max_steps": MAX_STEPS})
    reference.start(spec)
    summary = relay_env.run_flow(monkeypatch)
    assert summary["state"] == "done", summary
    runs = relay_env.kernel_runs()
    assert [r.run_id for r in runs] == ["toy-relay-s001-a1", "toy-relay-s002-a1"], runs  # none pushed twice
    versions = relay_env.ckpt_versions()
    assert [v["failed"] for v in versions] == [False, True, False]
    published = [json.loads((emu.store.dataset_dir(relay_env.ckpt, v["number"]) / "progress.json").read_text())
                 for v in versions]
    assert [p["run_id"] for p in published] == ["toy-relay-s001-a1", "toy-relay-s002-a1", "toy-relay-s002-a1"]
    assert emu.faults.injected["dataset_failed"] == 1
    assert published[-1]["weights_sha256"] == reference.weights(spec)
