"""Accelerate's own examples as written, relayed (issue 58): examples/byo-accelerate-checkpointing holds
by_feature/checkpointing.py and complete_nlp_example.py made offline as examples/byo-accelerate is (a tiny BERT
from a config, generated sentence pairs, a tokenizer built in memory). They accumulate by hand and never enter
accelerator.accumulate() (a relay step is then a micro-batch, and a session may end inside an optimizer step);
`--use_accumulate` is the same loop with accumulate(). `relay verify-resume` says identical at cuts on an epoch's
end and between, one session killed mid-save; the save_state folders the script writes into its code folder
(--checkpointing_steps epoch) never ship.

Sessions are bounded by step counts (`--cut-at`), never by time.
"""
from __future__ import annotations

import pytest

pytest.importorskip("accelerate")


@pytest.mark.parametrize("entry, max_steps, steps, cuts", [
    # by hand: 12 micro-batch steps an epoch; 12 is the first epoch's end, 17 inside an optimizer step
    ("checkpointing.py --cpu --checkpointing_steps epoch", 36, 26, "12,17"),
    # accumulate(): 6 optimizer steps an epoch; 6 is the first epoch's end, 9 inside the second
    ("checkpointing.py --cpu --use_accumulate", 18, 14, "6,9"),
    ("complete_nlp_example.py --cpu", 36, 20, "7,12"),
], ids=["checkpointing-by-hand", "checkpointing-accumulate", "complete_nlp_example"])
def test_accelerates_examples_resume_identically(entry, max_steps, steps, cuts, relay_cli, tmp_path):
    from byo_fixtures import copy_example
    from kaggle_fixtures import HF_MODULES, verify_warm

    spec = copy_example("byo-accelerate-checkpointing", tmp_path / "ex",
                        **{"code.entry": entry, "optim.max_steps": max_steps})
    out = relay_cli.run("verify-resume", str(spec), "--steps", str(steps), "--cut-at", cuts,
                        "--workdir", str(tmp_path / "v"), timeout=900, env=verify_warm(*HF_MODULES))
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert out.stdout.startswith("identical") and "(killed mid-save)" in out.stdout, out.stdout
    if "--checkpointing_steps epoch" in entry:  # its own save_state wrote epoch_0/, epoch_1/ beside the script
        from relay.shared.code_folder import accelerate_states, code_files

        assert accelerate_states(tmp_path / "ex") == ["epoch_0", "epoch_1"]
        assert "epoch_0/, epoch_1/ in the code folder: Accelerate's save_state output, never shipped" in out.stdout
        shipped = [rel for rel, _ in code_files(tmp_path / "ex")]
        assert shipped == ["checkpointing.py", "complete_nlp_example.py", "offline.py", "spec.yaml"], shipped
