"""The per-step books both loops keep alike (relay.kernel.session.stepbooks.StepBooks): each mode's keys in the
checkpoint stay what that loop saved before the books were one, a window round-trips through a checkpoint, and
samples/s and the insurance timer read the same for both."""
from __future__ import annotations

import torch

from relay.kernel.session.budget import SessionClock
from relay.kernel.session.stepbooks import KEYS, StepBooks


def books(mode: str, guard: bool = True, save_every: float = 1e9) -> StepBooks:
    return StepBooks(SessionClock(None, None, 0.0), save_every, guard=guard, mode=mode)


def test_each_mode_saves_the_keys_its_loop_saved():
    trainer = books("step")
    trainer.add_loss(1, 2.0, phase="p")
    assert trainer.state_dict().keys() == {"window_losses", "divergence"}  # the Trainer's, divergence None or not
    assert books("step", guard=False).state_dict() == {"window_losses": [], "divergence": None}
    session = books("window")
    session.add_loss(1, torch.tensor(2.0))
    assert session.state_dict().keys() == {"window_losses", "window_steps", "divergence"}
    assert books("window", guard=False).state_dict() == {"window_losses": [], "window_steps": []}
    assert set(KEYS) >= set(session.state_dict())


def test_a_window_cut_by_a_save_resumes_with_its_losses_steps_and_guard_history():
    a = books("window")
    for step in range(1, 8):
        a.add_loss(step, torch.tensor(float(step)))
    saved = {"global_step": 7, **a.state_dict()}
    assert saved["window_losses"] == [float(s) for s in range(1, 8)] and saved["window_steps"] == list(range(1, 8))
    b = books("window")
    b.load_state_dict(saved)
    assert b.end_window() == a.end_window() and b.guard.state_dict() == a.guard.state_dict()
    old = books("window")  # a checkpoint written before window_steps was saved: one loss a step, up to its step
    old.load_state_dict({"global_step": 10, "window_losses": [1.0, 2.0]})
    assert old.steps == [9, 10]


def test_step_mode_judges_each_loss_and_window_mode_at_the_window_end():
    step, window = books("step"), books("window")
    for s in range(1, 4):
        step.add_loss(s, float(s))
        window.add_loss(s, torch.tensor(float(s)))
    assert step.guard.h.n == 3 and window.guard.h.n == 0
    assert window.end_window() == [1.0, 2.0, 3.0] and window.guard.h.n == 3
    assert step.end_window() == [1.0, 2.0, 3.0] and step.losses == []
    unjudged = books("window")
    unjudged.add_loss(1, 1.0)
    assert unjudged.end_window(judge=False) == [1.0] and unjudged.guard.h.n == 0


def test_samples_per_s_and_the_insurance_timer():
    b = books("window", save_every=0.0)
    assert b.samples_per_s() is None
    b.count(0.5, None)
    assert b.samples_per_s() is None and b.clock.steps_taken == 1  # the step time is on the clock too
    b.count(0.5, 8)
    assert b.samples_per_s() == 8.0
    assert b.insurance_due()
    later = books("window", save_every=3600.0)
    assert not later.insurance_due()
    later.last_save -= 3600.0
    assert later.insurance_due()
    later.saved()
    assert not later.insurance_due()


def test_the_trainers_window_keeps_each_losss_step_and_phase_through_a_checkpoint():
    a = books("window")
    for step, loss, phase in [(1, 2.0, "A"), (2, float("nan"), "A"), (3, 1.5, "B")]:
        a.add_loss(step, torch.tensor(loss), phase=phase)
    saved = {"global_step": 3, **a.state_dict()}
    assert saved["window_phases"] == ["A", "A", "B"]
    b = books("window")
    b.load_state_dict(saved)
    window = b.take_window()
    assert [(s, p) for s, _, p in window] == [(1, "A"), (2, "A"), (3, "B")] and window[1][1] != window[1][1]
    assert b.take_window() == [] and "window_phases" not in b.state_dict()
    old = books("window")  # a window saved without phases takes the phase it is read in
    old.load_state_dict({"global_step": 2, "window_losses": [1.0, 2.0]})
    assert [p for *_, p in old.take_window("C")] == ["C", "C"]
