"""The VQA demo spec relayed on the Kaggle emulator: the Prefect flow pushes step-bounded sessions (20 optimizer
steps each, 60 in all: the demo's 4 epochs over 120 training samples) that mount the published data dataset; one
kernel of session >= 2 is SIGKILLed in the middle of a checkpoint save (frozen the moment a `.tmp-step-*` folder
exists beside a committed one). The relay completes across the ANSWER_FOCUS -> FORMAT_LEARNING change (epoch 2:
step 30, inside session 2) with the weights of an uninterrupted run.

The demo's own data (240 samples) and sessions (40 steps, 120 in all) would prove the same at twice the steps:
the stage change inside session 2, the kill in the save at it, session 2 done again across it, session 3 after it.
"""
from __future__ import annotations


import yaml

from conftest import REPO
from relay.kernel.recipes import vqa_data
from relay.orchestrator import report

from kaggle_fixtures import KERNEL_ENV  # noqa: E402
from relay_fixtures import USER  # noqa: E402
from process_fixtures import run_flow_with_a_kill_mid_save  # noqa: E402
from history_checks import check_history  # noqa: E402


TRAIN = 120  # training samples: 15 optimizer steps an epoch (micro_batch 4 x grad_accum 2)
STEPS = 4 * TRAIN // 8  # the demo's 4 epochs: 60 steps, in 3 sessions of 20
STAGE_CHANGE = 2 * TRAIN // 8  # FORMAT_LEARNING from epoch 2: step 30


def test_vqa_demo_relays_across_the_stage_change_with_a_kernel_killed_mid_save(relay_env, reference, monkeypatch,
                                                                                tmp_path):
    # the kernel of session 2 (steps 20-40) stops itself inside its first save at or after step 30 (the stage change)
    emu = relay_env.start(kernel_env={**KERNEL_ENV, "RELAY_TEST_STOP_MID_SAVE": str(STAGE_CHANGE)})
    data = tmp_path / "vqa-data"
    vqa_data.main(["--out", str(data), "--train", str(TRAIN)])
    relay_env.backend().publish_folder(data, f"{USER}/vqa-data", "VQA demo data", "synthetic")

    spec = yaml.safe_load((REPO / "examples" / "vqa-demo.yaml").read_text())
    spec["params"]["data_dir"] = str(data)  # the reference run reads it directly; kernels get the mount as --data
    spec["session"].update(save_every="0.01s", safety_margin="0.5s",  # a save every step: session 2 commits some
                           max_steps=STEPS // 3)
    spec["kaggle"].update(dataset_sources=[f"{USER}/vqa-data"], session_timeout="5m", startup_overhead="1s")
    relay_env.spec = relay_env.root / "spec" / "spec.yaml"
    relay_env.spec.parent.mkdir(parents=True)
    relay_env.spec.write_text(yaml.safe_dump(spec, sort_keys=False))
    reference.start(relay_env.spec)

    summary, killer = run_flow_with_a_kill_mid_save(relay_env, monkeypatch)
    assert summary["state"] == "done" and summary["step"] == STEPS

    runs = relay_env.kernel_runs()
    killed = next(r for r in runs if r.version == killer.killed["version"])
    assert killed.status == "ERROR" and "-9" in killed.failure, killed
    working = emu.store.kernel_dir(relay_env.kernel, killed.version) / "working" / "relay" / "checkpoints"
    assert (working / killer.killed["torn"]).is_dir()  # the save really was torn
    assert all(r.status == "COMPLETE" for r in runs if r.version != killed.version), runs
    assert len([r for r in runs if r.status == "COMPLETE"]) >= 3

    published = relay_env.published_progress()
    assert published["status"] == "done" and published["global_step"] == STEPS
    assert summary["weights_sha256"] == published["weights_sha256"] == reference.weights(relay_env.spec)
    stages = [s.get("stage") for s in published["sessions"]]
    assert stages[0] == "ANSWER_FOCUS" and stages[-1] == "FORMAT_LEARNING", stages
    assert any(s and "->" in s for s in stages) or "FORMAT_LEARNING" in stages, stages

    # the run's whole history is the orchestrator's (each checkpoint version carries its session's lines)
    metrics = report.dedupe_metrics(check_history(relay_env))
    assert report.stage_changes(metrics) == [(STAGE_CHANGE, "FORMAT_LEARNING")]
    assert published["memory_rungs"] == []  # no OOM on CPU: the ladder was never needed
