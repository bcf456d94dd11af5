"""The legal-BERT, temporal and recsys demos relayed on the Kaggle emulator (real `kaggle` client, real Prefect
flow, one kernel per session): their data published as a dataset, step-bounded sessions (recsys: ending between
ALS iterations; temporal: ending inside a model, the next switching models mid-session), and the relayed weights
equal to an uninterrupted local run's. Two sessions each, longer than the examples' own (which cut 3-4 on any
machine): one hand-over in the middle of the work is what the weights' equality proves."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from relay.kernel.recipes import legal_data, recsys_data, temporal_data
from relay_fixtures import USER
from split_sessions import progress

REPO = Path(__file__).resolve().parents[2]

DEMOS = {  # workload: (make the data, session.max_steps, the sessions' (first, last) steps)
    # step 1 the SVD, step 2 the item-KNN, then one ALS iteration each: the cut falls between iterations 4 and 5
    "recsys": (lambda out: recsys_data.generate(out, 20000, 600, 400, rank=6, seed=1), 6, [(0, 6), (6, 12)]),
    # 3 epochs of 75 steps: the cut falls inside the second
    "legal": (lambda out: legal_data.main(["--out", str(out), "--train", "1200", "--val", "200"]), 120,
              [(0, 120), (120, 225)]),
    # 72 steps per model (lstm, transformer, mlp): the cut falls inside the transformer's
    "temporal": (lambda out: temporal_data.main(["--out", str(out), "--rows", "3000"]), 108, [(0, 108), (108, 216)]),
}


@pytest.mark.parametrize("workload", list(DEMOS))
def test_demo_relays_over_sessions_to_the_uninterrupted_weights(workload, relay_env, relay_cli, monkeypatch,
                                                                tmp_path):
    make_data, per_session, sessions = DEMOS[workload]
    data = tmp_path / "data"
    make_data(data)
    spec = yaml.safe_load((REPO / f"examples/{workload}-demo.yaml").read_text())
    spec["name"] = f"{workload}-relay"
    spec["kaggle"].update(dataset_sources=[f"{USER}/{workload}-data"], session_timeout="5m", startup_overhead="1s")
    spec["session"]["max_steps"] = per_session
    relay_env.root.mkdir(exist_ok=True)
    relay_env.spec = relay_env.root / "spec.yaml"
    relay_env.spec.write_text(yaml.safe_dump(spec, sort_keys=False))

    relay_cli.train(relay_env.spec, tmp_path / "reference", "none", "--max-steps", "none", "--data", str(data))
    reference = progress(tmp_path / "reference")

    relay_env.start()
    relay_env.backend().publish_folder(data, f"{USER}/{workload}-data", f"Synthetic {workload} data")
    summary = relay_env.run_flow(monkeypatch)
    assert summary["state"] == "done", summary
    published = relay_env.published_progress()
    assert [(s["step_start"], s["step_end"]) for s in published["sessions"]] == sessions
    assert published["weights_sha256"] == reference["weights_sha256"] == summary["weights_sha256"]
    if workload == "recsys":
        assert published["metrics"]["rmse_als"] < published["metrics"]["rmse_user_mean"]
