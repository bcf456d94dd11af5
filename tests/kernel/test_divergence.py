"""A session stops itself when its loss blows up (session.stop_on_divergence), saving; the relay hands that
checkpoint over and stops with the reason instead of spending another session on it. The guard's history is
part of the run's exact state: a split run stops, or not, at the step an uninterrupted one does."""
from __future__ import annotations

import json
import math
import random

import pytest
import torch

from byo_fixtures import tiny_session_script
from conftest import load_toy_spec
from relay.kernel.recipes.toy import ToyRecipe
from relay.kernel.run import run_session
from relay.kernel.session.divergence import DivergenceGuard


def healthy_losses(n: int, seed: int = 0) -> list[float]:
    """A run that learns from ~2.0 to ~0.05 with micro-batch noise: single-batch spikes to 0.5-0.8 one step in
    twelve (what stopped legal-tiny's healthy run at step 462 under a 10x-the-median rule)."""
    rng = random.Random(seed)
    out = []
    for step in range(n):
        level = 0.05 + 1.95 * math.exp(-step / 60)
        loss = level * rng.uniform(0.5, 1.5)
        out.append(rng.uniform(0.5, 0.8) if rng.random() < 1 / 12 else loss)
    return out


def decisions(guard: DivergenceGuard, losses, first_step: int = 1, phase=None) -> list:
    return [guard.update(first_step + i, x, phase) for i, x in enumerate(losses)]


def test_noise_near_a_loss_of_zero_is_not_divergence():
    losses = healthy_losses(3000)
    assert sum(1 for x in losses[600:] if x > 10 * 0.05) > 100  # the spikes the old rule stopped on
    assert not any(decisions(DivergenceGuard(), losses))


def test_a_loss_that_jumps_or_grows_without_bound_is_stopped_within_the_stated_steps():
    """The bound docs/benchmarks.md states: within 2 spans (40 steps) of the first loss over the guard's bar,
    when the losses stay over it: the smoothed loss crosses within one span, then stays over for one."""
    for after in ([2.0] * 200, [0.05 * 1.05 ** k for k in range(400)], [50.0] * 200):
        guard = DivergenceGuard()
        assert not any(decisions(guard, healthy_losses(300)))
        bar = guard.bar()
        over = next(i for i, x in enumerate(after) if x > bar)
        stops = [i for i, why in enumerate(decisions(guard, after, 301)) if why]
        assert stops and stops[0] - over <= 2 * guard.span, (after[:3], over, stops[:1])


def test_the_reason_shows_the_smoothed_loss_around_the_stop():
    guard = DivergenceGuard()
    decisions(guard, healthy_losses(300))
    why = next(w for w in decisions(guard, [2.0] * 100, 301) if w)
    assert why.startswith("the loss diverged at step ")
    assert "20-step average was over" in why and "best" in why and "start" in why


def test_non_finite_losses_stop_at_once_and_a_single_one_does_not():
    guard = DivergenceGuard()
    decisions(guard, healthy_losses(100))
    assert guard.update(101, math.nan) is None and guard.update(102, 0.1) is None
    assert guard.update(103, math.inf) is None and guard.update(104, math.nan) is None
    assert "nan for 3 steps in a row at step 105" in guard.update(105, math.nan)


def test_a_new_phase_starts_a_new_history():
    guard = DivergenceGuard()
    decisions(guard, healthy_losses(300), phase="model 1")
    assert not any(decisions(guard, healthy_losses(300, seed=1), 301, phase="model 2"))  # starts at 2.0 again
    assert guard.h.phase == "model 2" and guard.h.n == 300


def test_a_split_anywhere_decides_as_the_uninterrupted_run():
    """Cut at every step (inside the warmup, inside the span over the bar): the saved and loaded history gives
    the same decisions as one guard that saw every loss."""
    losses = healthy_losses(150) + [3.0] * 60 + healthy_losses(100, seed=2)
    whole = decisions(DivergenceGuard(), losses)
    assert any(whole)
    for cut in range(1, len(losses)):
        first = DivergenceGuard()
        head = decisions(first, losses[:cut])
        second = DivergenceGuard()
        second.load_state_dict(json.loads(json.dumps(first.state_dict())))  # through the checkpoint's JSON
        assert head + decisions(second, losses[cut:], cut + 1) == whole, cut


def test_a_checkpoint_written_before_the_history_was_saved_starts_a_new_one():
    guard = DivergenceGuard()
    guard.load_state_dict(None)
    assert guard.state_dict() == DivergenceGuard().state_dict()


# -- the built-in runner: a run split inside the guard's judging span stops where the whole one does ----------
class BlowUp(ToyRecipe):
    """The toy recipe whose loss is multiplied by 1000 from optimizer step 40 on (a poisoned data stream)."""

    name = "blow-up-toy"

    def on_step(self, step, epoch):
        self.step = step

    def loss(self, model, batch):
        return super().loss(model, batch) * (1000.0 if self.step >= 40 else 1.0)


def _blow_up_run(workdir, cuts):
    done, progress = 0, None
    for cut in [*cuts, None]:
        spec = load_toy_spec(recipe=BlowUp.name, optim={"epochs": None, "max_steps": 200, "warmup_steps": 0},
                             session={"max_steps": None if cut is None else cut - done})
        progress = run_session(spec, workdir)
        done = progress["global_step"]
        if progress["stop_reason"] == "diverged":
            return progress
    return progress


@pytest.mark.parametrize("cuts", [[10], [50], [30, 55]], ids=["in-warmup", "over-the-bar", "twice"])
def test_the_built_in_runner_split_inside_the_judging_span_stops_at_the_same_step(register_recipe, tmp_path,
                                                                                   cuts):
    register_recipe(BlowUp.name, BlowUp)
    whole = _blow_up_run(tmp_path / "whole", [])
    split = _blow_up_run(tmp_path / "split", cuts)
    assert whole["stop_reason"] == split["stop_reason"] == "diverged"
    assert split["global_step"] == whole["global_step"] < 100
    assert split["weights_sha256"] == whole["weights_sha256"]
    assert split["sessions"][-1]["diverged"] == whole["sessions"][-1]["diverged"]


BLOWING_UP = tiny_session_script(  # the loss blows up at step 40
    train=False, report_loss=True, loss="torch.tensor(1.0 if session.step < 40 else 1000.0)")


def test_a_session_stops_itself_on_divergence_and_the_relay_says_why(relay_env, monkeypatch):
    import yaml

    import flows.one_relay as one_relay

    relay_env.start()
    folder = relay_env.root / "diverge"
    folder.mkdir()
    (folder / "train.py").write_text(BLOWING_UP)
    spec = folder / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "diverge", "code": {"folder": ".", "entry": "train.py"}, "optim": {"max_steps": 200, "log_every_steps": 10},
        "session": {"threads": 1, "max_steps": 100, "safety_margin": "0.5s"},
        "kaggle": {"session_timeout": "5m", "startup_overhead": "1s"}}))
    relay_env.spec = spec
    with pytest.raises(one_relay.RelayFailed) as failed:
        relay_env.run_flow(monkeypatch)
    # 1.0 for 40 steps, then 1000: the 20-step average is over the bar from step 41, for 20 steps in a row
    assert "session 1 stopped itself: the loss diverged at step 60: its 20-step average was over 1" in str(failed.value)
    # judged the step after the log step 60 (the window's read started at 60): the session stops after 61
    assert "Its checkpoint at step 61 is handed over" in str(failed.value)
    assert len(relay_env.kernel_runs()) == 1  # no second session spent on it
    progress = relay_env.published_progress()
    assert progress["stop_reason"] == "diverged" and progress["global_step"] == 61
    assert json.dumps(progress["sessions"][-1]["diverged"])


@pytest.mark.parametrize("cut", [10, 50, 60], ids=["in-warmup", "over-the-bar", "at-the-log-step"])
def test_the_session_api_split_inside_the_judging_span_stops_at_the_same_step(relay_cli, tmp_path, cut):
    import yaml

    (tmp_path / "train.py").write_text(BLOWING_UP)
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"name": "diverge", "code": {"folder": ".", "entry": "train.py"},
                                    "optim": {"max_steps": 200, "log_every_steps": 10},
                                    "session": {"threads": 1, "safety_margin": "0.5s"}}))
    relay_cli.train(spec, tmp_path / "whole", "none", "--max-steps", "none")
    relay_cli.train(spec, tmp_path / "split", "none", "--max-steps", str(cut))
    relay_cli.train(spec, tmp_path / "split", "none", "--max-steps", "none")
    whole, split = (json.loads((tmp_path / w / "progress.json").read_text()) for w in ("whole", "split"))
    assert whole["stop_reason"] == split["stop_reason"] == "diverged"
    assert split["global_step"] == whole["global_step"] == 61  # judged the step after the log step 60
    assert split["weights_sha256"] == whole["weights_sha256"]
