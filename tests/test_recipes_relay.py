"""The recsys demo relayed on the Kaggle emulator (real `kaggle` client, real Prefect flow, one kernel per
session): its data published as a dataset, 4 step-bounded sessions that end between ALS iterations, and the
relayed factor matrices equal to an uninterrupted local run's."""
from __future__ import annotations

from pathlib import Path

import yaml

from relay.recipes import recsys_data
from relay_fixtures import USER, prefect_api, relay_env  # noqa: F401
from split_sessions import progress

REPO = Path(__file__).resolve().parents[1]


def test_recsys_demo_relays_over_sessions_to_the_uninterrupted_weights(relay_env, relay_cli, monkeypatch, tmp_path):
    data = tmp_path / "data"
    recsys_data.generate(data, 20000, 600, 400, rank=6, seed=1)
    spec = yaml.safe_load((REPO / "examples/recsys-demo.yaml").read_text())
    spec["name"] = "recsys-relay"
    spec["kaggle"].update(dataset_sources=[f"{USER}/recsys-data"], session_timeout="5m", startup_overhead="1s")
    relay_env.root.mkdir(exist_ok=True)
    relay_env.spec = relay_env.root / "spec.yaml"
    relay_env.spec.write_text(yaml.safe_dump(spec, sort_keys=False))

    relay_cli.train(relay_env.spec, tmp_path / "reference", "none", "--max-steps", "none", "--data", str(data))
    reference = progress(tmp_path / "reference")

    relay_env.start()
    relay_env.backend().publish_folder(data, f"{USER}/recsys-data", "Synthetic ratings")
    summary = relay_env.run_flow(monkeypatch)
    assert summary["state"] == "done", summary
    published = relay_env.published_progress()
    assert [(s["step_start"], s["step_end"]) for s in published["sessions"]] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert published["weights_sha256"] == reference["weights_sha256"] == summary["weights_sha256"]
    assert published["metrics"]["rmse_als"] < published["metrics"]["rmse_user_mean"]
