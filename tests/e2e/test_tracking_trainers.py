"""The Hugging Face Trainer and Lightning examples relayed on the emulator like the plain loop and the user
recipe (tests/e2e/test_byo_relay.py), with their tracker flags on (`--report-to tensorboard,wandb`, `--logger
tensorboard,wandb`): 2 step-bounded sessions, the kernel of the second SIGKILLed mid-save, the weights of one
uninterrupted run; the final HF model dataset loads with from_pretrained; the trainers' own TensorBoard writers
land in the relay's one log (each step once), and their W&B loggers in the relay's one W&B run (offline; what
`wandb sync` is handed is recorded by a local stand-in, no W&B server being reachable). One relay per trainer
proves both: each kernel imports transformers or Lightning, the slowest sessions of the suite.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")

from byo_fixtures import relay_example_with_a_kill_mid_save  # noqa: E402
from relay.orchestrator import tracking_handoff, wandb_file  # noqa: E402
from tracking_fixtures import raw_steps, scalars  # noqa: E402

TRACKING = {"tensorboard": True, "wandb": {"project": "relay-test", "mode": "offline"}}
TRAINERS = {  # the example's flags, its own tag, the steps TensorBoard and W&B show it at
    "byo-hf": ({"optim.max_steps": 60, "session.max_steps": 30, "code.entry": "train.py --report-to tensorboard,wandb"},
               "train/loss", list(range(10, 61, 10)), list(range(10, 61, 10))),
    # RelayLightningCallback makes Lightning's loggers record the relay's step (10, 20, ...; Lightning alone: 9, 19),
    # and the relay pins its WandbLogger's calls (which carry no step) to the same
    "byo-lightning": ({"optim.max_steps": 160, "session.max_steps": 80,
                       "code.entry": "train.py --logger tensorboard,wandb"}, "train_mse", list(range(10, 161, 10)),
                      list(range(10, 161, 10))),
}


@pytest.mark.parametrize("example", list(TRAINERS))
def test_trainer_example_relays_to_the_weights_of_one_run_and_its_trackers_are_one_run(example, relay_env, reference,
                                                                                       monkeypatch, tmp_path):
    overrides, tag, steps, wandb_steps = TRAINERS[example]
    synced: list = []

    def stand_in(cmd, env):
        for run in (Path(a) for a in cmd if a.startswith("/") and Path(a).is_dir()):
            synced.append((cmd, shutil.copytree(run, tmp_path / "synced" / f"{len(synced)}-{run.name}")))

    monkeypatch.setattr(tracking_handoff, "run_sync", stand_in)
    relay_example_with_a_kill_mid_save(example, {**overrides, "tracking": TRACKING}, relay_env, reference,
                                       monkeypatch)

    progress = relay_env.published_progress()
    assembled = relay_env.root / "orchestrator" / relay_env.name / "tensorboard"
    shown = scalars(assembled)
    got = [s for s, _ in shown[tag]]
    assert got == raw_steps(assembled, tag) == sorted(set(got)), sorted(shown)  # each step once, increasing
    assert set(steps) <= set(got), got

    run_id = progress["tracking"]["wandb_run_id"]
    files = [f for _, run in synced for f in Path(run).glob("run-*.wandb")]
    assert files and {wandb_file.run_id(f) for f in files} == {run_id}
    assert all(cmd[cmd.index("--id") + 1] == run_id for cmd, _ in synced)
    rows = [(s, row) for f in files for s, row in wandb_file.history(f)]
    assert [s for s, row in rows if "train/loss" in row] == wandb_steps  # the relay's records: complete
    logged = [s for s, row in rows if tag in row]
    assert logged == sorted(set(logged))  # each step once, increasing
    if example == "byo-hf":  # HF's logs are in metrics.jsonl too: the rows a killed wandb-core lost are filled
        assert logged == wandb_steps
    # KNOWN GAP: Lightning's own W&B metrics (train_mse) of the killed session that wandb-core still held in its
    # write buffer are lost (wandb has no flush call; only the relay's records can be filled in)
    if example == "byo-hf":  # the final model dataset is what from_pretrained needs: config, weights, tokenizer
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        model_ds = f"{relay_env.kernel.split('/')[0]}/{relay_env.name}-model"
        versions = relay_env.emu.store.datasets[model_ds]["versions"]
        folder = relay_env.emu.store.dataset_dir(model_ds, versions[-1]["number"])
        model = AutoModelForSequenceClassification.from_pretrained(folder)
        tokens = AutoTokenizer.from_pretrained(folder)("a good movie", return_tensors="pt")
        assert model(**tokens).logits.shape == (1, 2)
