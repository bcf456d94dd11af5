"""The per-step books of a session, whichever loop drives it (relay.kernel.session.stepbooks.StepBooks): one set
of keys in the checkpoint, which older checkpoints' keys (the Trainer's books of several processes held only
`window_losses` and `divergence`) still read into; a window round-trips through a checkpoint; a loop that skips
non-finite steps keeps them out of the mean and the guard; samples/s and the insurance timer."""
from __future__ import annotations

import math

import torch

from relay.kernel.session.budget import SessionClock
from relay.kernel.session.stepbooks import KEYS, StepBooks


def books(guard: bool = True, save_every: float = 1e9, on_loss=None) -> StepBooks:
    return StepBooks(SessionClock(None, None, 0.0), save_every, guard=guard, on_loss=on_loss)


def test_one_set_of_keys_whatever_the_loop():
    session = books()
    session.add_loss(1, torch.tensor(2.0))
    trainer = books(on_loss=lambda step, loss: None)
    trainer.add_loss(1, torch.tensor(2.0), phase="p")
    assert session.state_dict().keys() == trainer.state_dict().keys() == {
        "window_losses", "window_steps", "window_phases", "divergence"}
    assert books(guard=False).state_dict() == {"window_losses": [], "window_steps": [], "window_phases": [],
                                               "divergence": None}
    session.close_window(1, {})
    assert set(KEYS) == set(session.state_dict())


def test_a_window_cut_by_a_save_resumes_with_its_losses_steps_and_guard_history():
    a = books()
    for step in range(1, 8):
        a.add_loss(step, torch.tensor(float(step)))
    saved = {"global_step": 7, **a.state_dict()}
    assert saved["window_losses"] == [float(s) for s in range(1, 8)] and saved["window_steps"] == list(range(1, 8))
    b = books()
    b.load_state_dict(saved)
    assert b.end_window() == a.end_window() and b.guard.state_dict() == a.guard.state_dict()
    old = books()  # a checkpoint written before window_steps was saved: one loss a step, up to its step
    old.load_state_dict({"global_step": 10, "window_losses": [1.0, 2.0]})
    assert old.steps == [9, 10]


def test_a_closed_window_resumes_unjudged_with_its_metrics_and_whether_its_line_is_written():
    a = books()
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
    b = books()
    b.load_state_dict(saved)
    assert b.closed == a.closed and b.steps == [11]
    assert b.take_closed().logged and b.closed is None and b.guard.h.n == 10
    assert a.take_closed() is not None and b.guard.state_dict() == a.guard.state_dict()
    measured = books()  # what a process measured for the line (samples/s, memory) is not carried: it differs by run
    measured.add_loss(1, 1.0)
    measured.close_window(1, {"lr": 0.1}, {"samples_per_s": 123.0})
    assert measured.state_dict()["closed_metrics"] == {"lr": 0.1} and measured.closed.measured
    old = {k: v for k, v in saved.items() if k != "closed_phases"}  # a closed window saved before phases were
    c = books()
    c.load_state_dict(old)
    assert c.closed.phases == [None] * 10


def test_a_window_is_judged_when_read_and_only_by_a_guard_asked_to():
    window = books()
    for s in range(1, 4):
        window.add_loss(s, torch.tensor(float(s)))
    assert window.guard.h.n == 0
    assert window.end_window() == [1.0, 2.0, 3.0] and window.guard.h.n == 3 and window.losses == []
    unjudged = books()
    unjudged.add_loss(1, 1.0)
    assert unjudged.end_window(judge=False) == [1.0] and unjudged.guard.h.n == 0


def test_a_loop_that_skips_nonfinite_steps_gets_each_loss_and_keeps_the_nonfinite_out_of_mean_and_guard():
    seen = []
    b = books(on_loss=lambda step, loss: seen.append((step, loss)))
    for step, loss in [(1, 2.0), (2, float("nan")), (3, 1.5)]:
        b.add_loss(step, torch.tensor(loss))
    assert b.end_window() == [2.0, 1.5] and b.guard.h.n == 2
    assert [s for s, _ in seen] == [1, 2, 3] and math.isnan(seen[1][1])
    plain = books()  # a script's loop: every loss counts, a NaN too (the guard's own non-finite patience)
    plain.add_loss(1, torch.tensor(float("nan")))
    assert math.isnan(plain.end_window()[0]) and plain.guard.h.nonfinite == 1


def test_samples_per_s_and_the_insurance_timer():
    b = books(save_every=0.0)
    assert b.samples_per_s() is None
    b.count(0.5, None)
    assert b.samples_per_s() is None and b.clock.steps_taken == 1  # the step time is on the clock too
    b.count(0.5, 8)
    assert b.samples_per_s() == 8.0
    assert b.insurance_due()
    later = books(save_every=3600.0)
    assert not later.insurance_due()
    later.last_save -= 3600.0
    assert later.insurance_due()
    later.saved()
    assert not later.insurance_due()


def test_each_losss_step_and_phase_go_through_a_checkpoint_and_the_guard_compares_within_a_phase():
    a = books()
    for step, loss, phase in [(1, 2.0, "A"), (2, 3.0, "A"), (3, 1.5, "B")]:
        a.add_loss(step, torch.tensor(loss), phase=phase)
    saved = {"global_step": 3, **a.state_dict()}
    assert saved["window_phases"] == ["A", "A", "B"]
    b = books()
    b.load_state_dict(saved)
    assert (b.steps, b.phases) == ([1, 2, 3], ["A", "A", "B"])
    b.end_window()
    assert (b.guard.h.phase, b.guard.h.n) == ("B", 1)  # B's loss started a history of its own
    old = books()  # a window saved without phases takes the phase of the loss added next
    old.load_state_dict({"global_step": 2, "window_losses": [1.0, 2.0]})
    assert old.state_dict()["window_phases"] == []  # still unknown: saved as it was read
    old.add_loss(3, 3.0, phase="C")
    assert old.phases == ["C", "C", "C"]
    old.end_window()
    assert (old.guard.h.phase, old.guard.h.n) == ("C", 3)


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
