"""The Hugging Face Trainer and Lightning examples relayed on the emulator like the plain loop and the user
recipe (tests/test_byo_relay.py): >= 3 step-bounded sessions, one kernel SIGKILLed mid-save, final weights
equal to an uninterrupted run. Slower (transformers/lightning imports per kernel), hence a file of their own.
"""
from __future__ import annotations

import pytest

from byo_fixtures import relay_example_with_a_kill_mid_save

TRAINERS = {
    "byo-hf": {"optim.max_steps": 90, "session.max_steps": 30},
    "byo-lightning": {"optim.max_steps": 240, "session.max_steps": 80},
}


@pytest.mark.parametrize("example", list(TRAINERS))
def test_trainer_example_relays_to_the_weights_of_one_run(example, relay_env, reference, monkeypatch):
    relay_example_with_a_kill_mid_save(example, TRAINERS[example], relay_env, reference, monkeypatch)
    if example == "byo-hf":  # the final model dataset is what from_pretrained needs: config, weights, tokenizer
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        model_ds = f"{relay_env.kernel.split('/')[0]}/{relay_env.name}-model"
        versions = relay_env.emu.store.datasets[model_ds]["versions"]
        folder = relay_env.emu.store.dataset_dir(model_ds, versions[-1]["number"])
        model = AutoModelForSequenceClassification.from_pretrained(folder)
        tokens = AutoTokenizer.from_pretrained(folder)("a good movie", return_tensors="pt")
        assert model(**tokens).logits.shape == (1, 2)
