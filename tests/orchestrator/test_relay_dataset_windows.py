"""Kaggle's dataset-version windows are waited out, never a failure: a new version refused (403) while the
previous one still processes (though its status reads READY), and a new version that 404s for a few reads
after its creation. The emulator's `version_refused` and `version_404` faults count requests, not seconds.
Real `kaggle` client, real Prefect flow, sessions running `relay train`."""
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
