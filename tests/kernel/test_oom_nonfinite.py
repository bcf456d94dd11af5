"""OOM back-off and the non-finite-loss guard, driven in-process through run_session with test recipes.

CUDA out-of-memory cannot happen on this CPU-only machine, so it is simulated: the recipe's loss raises
torch.cuda.OutOfMemoryError (a real exception type, constructible without CUDA) when the micro-batch is
larger than a limit. Non-finite losses are made by multiplying the loss by NaN on chosen optimizer steps.
"""
from __future__ import annotations

import json
import logging
import os
import signal

import pytest
import torch

from conftest import load_toy_spec
from relay.kernel.recipes.toy import ToyRecipe
from relay.kernel.run import run_session
from relay.kernel.trainer import NonFiniteLossError, Trainer


class Script:
    """What the test recipe does, keyed by the optimizer step the Trainer is in; reset for every test."""

    def reset(self) -> None:
        self.oom_above = None  # raise OOM when the micro-batch is larger than this...
        self.oom_skip_calls = 0  # ...but only after this many oversized calls went through
        self.nan_steps: set[int] = set()  # global steps whose loss is NaN
        self.nan_gradients = True  # ...and so are its gradients (loss x NaN); False: they stay finite (loss + NaN)
        self.bad = float("nan")  # what those steps' loss is made (inf and -inf: non-finite too)
        self.sigterm_at = None  # (global step, micro-batch index): send SIGTERM during it
        self.step = None  # the global step of the running Trainer._step; None outside it (the pre-flight)
        self.micro = 0
        self.calls: list[tuple[str, int, str]] = []  # (step or "preflight", micro-batch size, precision)


SCRIPT = Script()


class ScriptedRecipe(ToyRecipe):
    name = "scripted-toy"

    def loss(self, model, batch):
        n = len(batch["y"])
        mode = str(torch.get_autocast_dtype("cpu")).removeprefix("torch.") if torch.is_autocast_enabled("cpu") else "fp32"
        SCRIPT.calls.append(("preflight" if SCRIPT.step is None else SCRIPT.step, n, mode))
        if SCRIPT.step is not None and SCRIPT.sigterm_at == (SCRIPT.step, SCRIPT.micro):
            os.kill(os.getpid(), signal.SIGTERM)  # the session finishes this step, saves and returns
        if SCRIPT.step is not None:
            SCRIPT.micro += 1
        if SCRIPT.oom_above is not None and n > SCRIPT.oom_above:
            if SCRIPT.oom_skip_calls > 0:
                SCRIPT.oom_skip_calls -= 1
            else:
                raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (simulated: micro-batch {n})")
        loss = super().loss(model, batch)
        if SCRIPT.step in SCRIPT.nan_steps:
            loss = loss * SCRIPT.bad if SCRIPT.nan_gradients else loss + torch.tensor(SCRIPT.bad)
        return loss


@pytest.fixture
def scripted(register_recipe, monkeypatch):
    register_recipe(ScriptedRecipe.name, ScriptedRecipe)
    real_step = Trainer._step

    def step(self):  # tell the recipe which optimizer step it is in (an OOM retry re-enters the same step)
        SCRIPT.step, SCRIPT.micro = self.state.global_step, 0
        try:
            return real_step(self)
        finally:
            SCRIPT.step = None

    monkeypatch.setattr(Trainer, "_step", step)
    SCRIPT.reset()
    yield SCRIPT
    SCRIPT.reset()


def sizes(phase="step"):
    return [n for s, n, _ in SCRIPT.calls if (s == "preflight") == (phase == "preflight")]


def spec(**overrides):
    overrides.setdefault("recipe", ScriptedRecipe.name)
    overrides.setdefault("optim", {})
    overrides["optim"] = {"epochs": None, "max_steps": 6, "schedule": "constant", "warmup_steps": 0,
                          **overrides["optim"]}
    return load_toy_spec(**overrides)


def final_state(workdir) -> dict:
    progress = json.loads((workdir / "progress.json").read_text())
    return torch.load(workdir / progress["checkpoint"] / "state.pt", weights_only=True)


def assert_same_weights(a, b) -> None:
    sa, sb = final_state(a)["objects"], final_state(b)["objects"]
    for part in ("model", "optimizer"):
        for k, v in sa[part].items() if part == "model" else sa[part]["state"].items():
            if part == "model":
                assert torch.equal(v, sb[part][k]), k
            else:
                for name, t in v.items():
                    assert torch.equal(t, sb[part]["state"][k][name]), (k, name)


# -- OOM back-off -----------------------------------------------------------------------------------
def test_oom_halves_micro_batch_doubles_accumulation_and_retries_the_same_step(scripted, tmp_path, caplog):
    scripted.oom_above = 4
    with caplog.at_level(logging.WARNING):
        progress = run_session(spec(optim={"micro_batch": 8, "grad_accum": 2}), tmp_path / "oom")
    assert progress["status"] == "done" and progress["global_step"] == 6
    assert (progress["micro_batch"], progress["grad_accum"]) == (4, 4)  # effective batch stays 16
    # The pre-flight (one forward/backward before training) hits the OOM and backs off before step 0.
    assert sizes("preflight") == [8, 4] and sizes() == [4] * (6 * 4)
    assert "out of memory at micro-batch 8: retrying step 0 with micro-batch 4 x accumulation 4" in caplog.text
    assert final_state(tmp_path / "oom")["relay"]["micro_batch"] == 4
    # The retried step saw the same samples and the same dropout masks: identical to running 4 x 4 throughout.
    scripted.reset()
    run_session(spec(optim={"micro_batch": 4, "grad_accum": 4}), tmp_path / "plain")
    assert_same_weights(tmp_path / "oom", tmp_path / "plain")


def test_oom_after_a_half_accumulated_step_discards_its_gradient(scripted, tmp_path):
    """The pre-flight and step 0's first 8-sample micro-batch go through (forward, backward, dropout RNG used);
    the second runs out of memory. The retry must start from clean gradients and the step's RNG state."""
    scripted.oom_above, scripted.oom_skip_calls = 4, 2
    run_session(spec(optim={"micro_batch": 8, "grad_accum": 2}), tmp_path / "oom")
    assert sizes("preflight") == [8] and sizes()[:6] == [8, 8, 4, 4, 4, 4]
    scripted.reset()
    run_session(spec(optim={"micro_batch": 4, "grad_accum": 4}), tmp_path / "plain")
    assert_same_weights(tmp_path / "oom", tmp_path / "plain")


def test_oom_size_is_carried_to_the_next_session(scripted, tmp_path):
    scripted.oom_above = 2
    scripted.sigterm_at = (1, 0)  # stop after step 1
    first = run_session(spec(optim={"micro_batch": 8, "grad_accum": 2}), tmp_path / "w")
    assert first["status"] == "paused" and first["stop_reason"] == "sigterm"
    assert (first["micro_batch"], first["grad_accum"]) == (2, 8)
    progress_file = json.loads((tmp_path / "w" / "progress.json").read_text())
    assert (progress_file["micro_batch"], progress_file["grad_accum"]) == (2, 8)
    # A new session never tries the size that failed, even with the limit lifted.
    scripted.reset()
    second = run_session(spec(optim={"micro_batch": 8, "grad_accum": 2}), tmp_path / "w")
    assert second["status"] == "done" and second["sessions"][-1]["step_start"] == first["global_step"] == 2
    assert set(sizes("preflight")) == set(sizes()) == {2}
    assert (second["micro_batch"], second["grad_accum"]) == (2, 8)


def test_a_run_that_backs_off_mid_run_resumes_exactly_split_before_or_after_the_back_off(scripted, tmp_path):
    """An OOM at step 3 (micro-batch 8 x 2 -> 4 x 4, the step retried with its dropout masks): a run split after
    the back-off, or before it with the OOM met in the second session, ends with the weights and optimizer state
    of the uninterrupted run. The OOM is simulated (a CUDA allocator cannot run here); the ladder is the same."""
    cfg = spec(optim={"micro_batch": 8, "grad_accum": 2})

    def oom_at_step_3(calls_before: int, sigterm_at=None) -> None:
        scripted.reset()
        scripted.oom_above, scripted.oom_skip_calls, scripted.sigterm_at = 4, calls_before, sigterm_at

    oom_at_step_3(1 + 3 * 2)  # the pre-flight's forward, then steps 0-2 at two micro-batches each
    whole = run_session(cfg, tmp_path / "whole")
    assert (whole["micro_batch"], whole["grad_accum"], whole["global_step"]) == (4, 4, 6)

    oom_at_step_3(1 + 3 * 2, sigterm_at=(4, 0))  # split after the back-off
    assert run_session(cfg, tmp_path / "after")["global_step"] == 5
    scripted.reset()
    assert run_session(cfg, tmp_path / "after")["status"] == "done"
    assert_same_weights(tmp_path / "whole", tmp_path / "after")

    oom_at_step_3(0, sigterm_at=(1, 0))  # split before it: session 1 stops after step 1 at 8 x 2
    scripted.oom_above = None
    assert run_session(cfg, tmp_path / "before")["micro_batch"] == 8
    oom_at_step_3(1 + 1 * 2)  # session 2: its pre-flight, step 2, then the OOM at step 3
    second = run_session(cfg, tmp_path / "before")
    assert (second["micro_batch"], second["grad_accum"], second["status"]) == (4, 4, "done")
    assert_same_weights(tmp_path / "whole", tmp_path / "before")


def test_oom_at_micro_batch_one_is_raised(scripted, tmp_path):
    scripted.oom_above = 0
    with pytest.raises(torch.cuda.OutOfMemoryError):
        run_session(spec(optim={"micro_batch": 4, "grad_accum": 1}), tmp_path / "w")
    assert sizes("preflight") == [4, 2, 1] and sizes() == []  # found before training started


def test_other_errors_are_not_mistaken_for_oom(scripted, tmp_path, monkeypatch):
    def broken(self, model, batch):
        raise ValueError("shape mismatch")

    monkeypatch.setattr(ScriptedRecipe, "loss", broken)
    with pytest.raises(ValueError, match="shape mismatch"):
        run_session(spec(), tmp_path / "w")


# -- non-finite guard -------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("nan_gradients", [True, False], ids=["nan-gradients", "finite-gradients"])
def test_nonfinite_steps_are_skipped_without_touching_weights(scripted, tmp_path, monkeypatch, precision,
                                                              nan_gradients):
    """Step 5 (the last) is NaN: the final weights and optimizer moments equal a 5-step run's, whether the NaN
    loss's gradients are NaN too or finite. Under fp16 (a T4's, with a GradScaler; taken here on CPU) the scaler
    skips the step on the device, from its gradients, which a NaN loss poisons when they are finite."""
    if precision == "fp16":
        from relay.kernel import trainer as loop

        monkeypatch.setattr(loop, "resolve_precision", lambda requested, device: "fp16")
    scripted.nan_steps, scripted.nan_gradients = {1, 3, 5}, nan_gradients
    progress = run_session(spec(optim={"max_steps": 6, "precision": precision}), tmp_path / "nan")
    assert progress["status"] == "done" and progress["precision"] == precision
    trainer = final_state(tmp_path / "nan")["relay"]
    assert trainer["skipped_steps"] == 3 and trainer["nonfinite_streak"] == 1
    assert all(torch.isfinite(v).all() for v in final_state(tmp_path / "nan")["objects"]["model"].values())
    losses = [json.loads(line) for line in (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["loss"] == r["loss"] for r in losses if r.get("kind") == "train")  # skipped steps not averaged in
    scripted.reset()
    scripted.nan_steps, scripted.nan_gradients = {1, 3}, nan_gradients
    run_session(spec(optim={"max_steps": 5, "precision": precision}), tmp_path / "ref")
    assert_same_weights(tmp_path / "nan", tmp_path / "ref")


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf")], ids=["inf", "-inf"])
def test_an_infinite_loss_with_finite_gradients_is_skipped_as_a_nan_one(scripted, tmp_path, monkeypatch, precision,
                                                                        bad):
    """loss + inf: the gradients stay finite, so only the loss tells. The step's skip is decided on the device from
    mean * 0 (NaN exactly when the mean is NaN or infinite): the fused AdamW's found_inf in fp32, the gradient
    poison that makes fp16's GradScaler skip. The weights equal a run without that step."""
    if precision == "fp16":
        from relay.kernel import trainer as loop

        monkeypatch.setattr(loop, "resolve_precision", lambda requested, device: "fp16")
    scripted.nan_steps, scripted.nan_gradients, scripted.bad = {2}, False, bad
    run_session(spec(optim={"max_steps": 3, "precision": precision}), tmp_path / "inf")
    assert final_state(tmp_path / "inf")["relay"]["skipped_steps"] == 1
    scripted.reset()
    scripted.nan_steps, scripted.nan_gradients, scripted.bad = {2}, True, float("nan")
    run_session(spec(optim={"max_steps": 3, "precision": precision}), tmp_path / "ref")
    assert_same_weights(tmp_path / "inf", tmp_path / "ref")


def test_k_nonfinite_in_a_row_under_bf16_falls_back_to_fp32(scripted, tmp_path, caplog):
    """The losses are read at log steps (here every 4 steps: right after step 3, the third NaN in a row) and judged
    at the step after (the session's window, as a script's loop has it): step 4 still runs in bf16."""
    scripted.nan_steps = {1, 2, 3}
    with caplog.at_level(logging.WARNING):
        progress = run_session(spec(optim={"precision": "bf16", "nonfinite_patience": 3, "max_steps": 7,
                                           "log_every_steps": 4}), tmp_path / "w")
    assert progress["status"] == "done" and progress["precision"] == "fp32"
    modes = [(s, m) for s, _, m in scripted.calls if s != "preflight"]
    assert modes == [(s, "bfloat16") for s in (0, 0, 1, 1, 2, 2, 3, 3, 4, 4)] + [(s, "fp32") for s in (5, 5, 6, 6)]
    assert "falling back from bf16 to fp32 after 3 non-finite losses" in caplog.text
    trainer = final_state(tmp_path / "w")["relay"]
    assert (trainer["precision"], trainer["skipped_steps"], trainer["nonfinite_streak"]) == ("fp32", 3, 0)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_fallback_comes_after_the_log_step_that_reads_the_streak_and_a_split_run_decides_alike(scripted,
                                                                                                 tmp_path,
                                                                                                 monkeypatch,
                                                                                                 precision):
    """No loss is read between log steps (the skip itself happens on the device): NaN at steps 1-3 with a log
    step every 6 fall back after step 6 (the step after the log step, where the session judges the window), not 3.
    A run cut at step 2, 4 or 6 (inside that window, its losses saved unread, or closed and not yet judged) falls
    back at the same step and ends with the same weights. fp16 takes a GradScaler, which skips the
    NaN steps itself (and lowers its scale, a state the split run saves and restores); it is a CUDA precision,
    run here on CPU, where torch has fp16 autocast and a GradScaler too."""
    if precision == "fp16":
        from relay.kernel import trainer as loop

        monkeypatch.setattr(loop, "resolve_precision", lambda requested, device: "fp16")
    dtype = {"bf16": "bfloat16", "fp16": "float16"}[precision]
    cfg = spec(optim={"precision": precision, "nonfinite_patience": 3, "max_steps": 9, "log_every_steps": 6})
    scripted.nan_steps = {1, 2, 3}
    whole = run_session(cfg, tmp_path / "whole")
    modes = [(s, m) for s, _, m in scripted.calls if s != "preflight"]
    assert modes == [(s, dtype) for s in range(7) for _ in (0, 1)] + [(s, "fp32") for s in (7, 8) for _ in (0, 1)]
    assert (whole["precision"], final_state(tmp_path / "whole")["relay"]["skipped_steps"]) == ("fp32", 3)
    for cut in (2, 4, 6):
        scripted.reset()
        scripted.nan_steps, scripted.sigterm_at = {1, 2, 3}, (cut - 1, 1)
        first = run_session(cfg, tmp_path / f"cut{cut}")
        assert first["global_step"] == cut and first["precision"] == precision
        scripted.nan_steps, scripted.sigterm_at = {1, 2, 3}, None
        assert run_session(cfg, tmp_path / f"cut{cut}")["precision"] == "fp32"
        assert_same_weights(tmp_path / "whole", tmp_path / f"cut{cut}")


def test_fewer_than_k_in_a_row_keeps_bf16(scripted, tmp_path):
    scripted.nan_steps = {1, 2, 4, 5}
    progress = run_session(spec(optim={"precision": "bf16", "nonfinite_patience": 3, "max_steps": 7}),
                           tmp_path / "w")
    assert progress["precision"] == "bf16"
    assert {m for *_, m in scripted.calls} == {"bfloat16"}


def test_k_nonfinite_in_a_row_in_fp32_raises_a_clear_error(scripted, tmp_path):
    scripted.nan_steps = {2, 3, 4}
    with pytest.raises(NonFiniteLossError) as err:
        run_session(spec(optim={"precision": "fp32", "nonfinite_patience": 3}), tmp_path / "w")
    assert str(err.value) == ("loss was non-finite for 3 steps in a row in fp32 at step 4;"
                              " lower optim.lr or check the data")


def test_nonfinite_streak_survives_a_session_boundary(scripted, tmp_path):
    """Two NaN steps, stop, one more NaN step in the next session: that is 3 in a row."""
    scripted.nan_steps = {2, 3}
    scripted.sigterm_at = (3, 1)
    first = run_session(spec(optim={"nonfinite_patience": 3}), tmp_path / "w")
    assert first["stop_reason"] == "sigterm" and first["global_step"] == 4
    scripted.reset()
    scripted.nan_steps = {4}  # the first step of the new session
    with pytest.raises(NonFiniteLossError, match="non-finite for 3 steps in a row in fp32 at step 4"):
        run_session(spec(optim={"nonfinite_patience": 3}), tmp_path / "w")
