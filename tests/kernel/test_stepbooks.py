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


def test_a_closed_window_resumes_unjudged_with_its_metrics_and_whether_its_line_is_written():
    a = books("window")
    for step in range(1, 11):
        a.add_loss(step, torch.tensor(float(step)))
    a.close_window(10, {"acc": torch.tensor(0.5), "note": "x"})
    a.add_loss(11, torch.tensor(11.0))
    a.closed.logged = True  # what a save does first (Session.save)
    saved = {"global_step": 11, **a.state_dict()}
    assert set(KEYS) >= set(saved) - {"global_step"}
    assert (saved["closed_at"], saved["closed_steps"], saved["closed_losses"]) == (10, list(range(1, 11)),
                                                                                   [float(s) for s in range(1, 11)])
    assert saved["closed_metrics"] == {"acc": 0.5, "note": "x"} and saved["closed_logged"] is True
    assert saved["window_losses"] == [11.0] and a.guard.h.n == 0  # nothing judged yet
    b = books("window")
    b.load_state_dict(saved)
    assert b.closed == a.closed and b.steps == [11]
    assert b.take_closed().logged and b.closed is None and b.guard.h.n == 10
    assert a.take_closed() is not None and b.guard.state_dict() == a.guard.state_dict()


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


def test_a_closed_cuda_window_is_read_only_after_its_copy_is_done():
    """On CUDA a log step copies its window into pinned memory behind the step's kernels, with an event after the
    copy; the values may be read only once that event is done. This machine has no CUDA: the event and the pinned
    tensor are stand-ins (mocked because they cannot run here) that record the order of the wait and the read."""
    from relay.kernel.session.stepbooks import ClosedWindow

    order = []

    class Event:
        def synchronize(self):
            order.append("wait")

    class Pinned(torch.Tensor):
        def tolist(self):
            order.append("read")
            return super().tolist()

    window = ClosedWindow(10, list(range(1, 11)), (torch.arange(10.0).as_subclass(Pinned), Event()))
    assert window.read() == [float(k) for k in range(10)] and order == ["wait", "read"]
    assert window.read() == [float(k) for k in range(10)] and order == ["wait", "read"]  # read once, then kept
