"""relay.orchestrator.chain: the relay's next step as a pure function of what Kaggle shows, and its failure policy."""
from __future__ import annotations

import pytest

from dataclasses import dataclass

from relay.orchestrator.chain import (SESSION_LIMIT_MESSAGE, Action, Do, Names, Observation, Recovery, after_handover,
                                      decide, diverged_unchanged, looks_like_code_error, parse_run_id, retry_action,
                                      run_id)

NAME = "price-tiny"


def published(session: int, attempt: int = 1, status: str = "paused", step: int = 100) -> dict:
    return {"run_id": run_id(NAME, session, attempt), "status": status, "global_step": step}


def obs(published_progress=None, kernel_run=None, state=None, failure="") -> Observation:
    return Observation(published_progress, kernel_run, state, failure)


def test_run_ids_round_trip_and_ignore_foreign_kernels():
    assert run_id(NAME, 3, 1) == "price-tiny-s003-a1"
    assert parse_run_id("price-tiny-s003-a1") == (3, 1)
    assert parse_run_id("price-tiny-s1234-a12") == (1234, 12)
    for foreign in (None, "", "my-notebook", "price-tiny-s3-a1", "Price-s001-a1", "price-s001-a"):
        assert parse_run_id(foreign) is None
    names = Names("alice", NAME)
    assert (names.kernel, names.checkpoint_dataset, names.features_dataset, names.model_dataset) == (
        "alice/price-tiny-session", "alice/price-tiny-ckpt", "alice/price-tiny-features", "alice/price-tiny-model")


def test_push_first_session_when_nothing_is_on_kaggle():
    action = decide(NAME, obs())
    assert (action.do, action.run_id, action.session, action.attempt) == (Do.PUSH, "price-tiny-s001-a1", 1, 1)
    # a kernel pushed by hand (no relay run id) is not ours to wait for
    assert decide(NAME, obs(kernel_run="hand-made", state="running")).run_id == "price-tiny-s001-a1"


@pytest.mark.parametrize("state", ["complete", "error", "running"])
def test_push_next_session_once_the_kernel_run_is_handed_over(state):
    # the kernel still shows session 2 (whatever its state): session 2 is published, so push session 3
    action = decide(NAME, obs(published(2), run_id(NAME, 2, 1), state))
    assert (action.do, action.run_id, action.session, action.attempt) == (Do.PUSH, "price-tiny-s003-a1", 3, 1)
    # a retried session, handed over from its second attempt, moves on the same way
    assert decide(NAME, obs(published(2, 2), run_id(NAME, 2, 2), state)).run_id == "price-tiny-s003-a1"


@pytest.mark.parametrize("state", [None, "queued", "running", "new_script"])
def test_wait_while_the_pushed_session_has_not_finished(state):
    action = decide(NAME, obs(published(2), run_id(NAME, 3, 1), state))
    assert (action.do, action.run_id, action.session, action.attempt) == (Do.WAIT, "price-tiny-s003-a1", 3, 1)
    # right after the first push there is no published checkpoint yet
    assert decide(NAME, obs(None, run_id(NAME, 1, 1), state)).do is Do.WAIT


def test_harvest_a_completed_session_not_yet_handed_over():
    action = decide(NAME, obs(published(2), run_id(NAME, 3, 2), "complete"))
    assert (action.do, action.run_id, action.session, action.attempt) == (Do.HARVEST, "price-tiny-s003-a2", 3, 2)
    assert decide(NAME, obs(None, run_id(NAME, 1, 1), "complete")).do is Do.HARVEST


@pytest.mark.parametrize("state", ["error", "cancelled"])
def test_salvage_a_failed_session_with_its_failure_in_the_reason(state):
    action = decide(NAME, obs(published(4), run_id(NAME, 5, 1), state, "Kernel exited with code -9"))
    assert (action.do, action.run_id, action.session, action.attempt) == (Do.SALVAGE, "price-tiny-s005-a1", 5, 1)
    assert "Kernel exited with code -9" in action.reason and state in action.reason


def test_done_when_the_published_checkpoint_says_so_whatever_the_kernel_shows():
    for kernel_run, state in ((run_id(NAME, 7, 1), "complete"), (run_id(NAME, 7, 1), "error"), (None, None)):
        assert decide(NAME, obs(published(7, status="done"), kernel_run, state)).do is Do.DONE


def test_failed_when_the_checkpoint_dataset_was_changed_by_hand():
    # the kernel runs session 5, but the dataset shows only session 2 (a version was deleted or edited)
    action = decide(NAME, obs(published(2), run_id(NAME, 5, 1), "running"))
    assert action.do is Do.FAILED and "changed by hand" in action.reason
    # a progress.json edited to carry no relay run id counts as nothing handed over
    edited = {"run_id": "my-edit", "status": "paused"}
    assert decide(NAME, obs(edited, run_id(NAME, 2, 1), "complete")).do is Do.FAILED
    assert decide(NAME, obs(edited, run_id(NAME, 1, 1), "complete")).do is Do.HARVEST


def test_the_same_observation_gives_the_same_decision():
    # stateless: a restarted orchestrator decides exactly what the killed one would have
    o = obs(published(1), run_id(NAME, 2, 1), "complete")
    assert decide(NAME, o) == decide(NAME, o)


def test_retry_action_pushes_the_same_session_again_then_gives_up():
    failed = Action(Do.SALVAGE, run_id(NAME, 3, 1), 3, 1, "kernel error")
    again = retry_action(NAME, failed, max_attempts=3, why="no progress")
    assert (again.do, again.run_id, again.session, again.attempt) == (Do.PUSH, "price-tiny-s003-a2", 3, 2)
    assert "no progress" in again.reason
    third = retry_action(NAME, Action(Do.SALVAGE, again.run_id, 3, 2), 3, "stale output")
    assert third.run_id == "price-tiny-s003-a3"
    gave_up = retry_action(NAME, Action(Do.SALVAGE, third.run_id, 3, 3), 3, "stale output")
    assert gave_up.do is Do.FAILED and "3 times" in gave_up.reason and "stale output" in gave_up.reason
    assert retry_action(NAME, failed, max_attempts=1, why="x").do is Do.FAILED


TRACEBACK = "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"


@pytest.mark.parametrize("last_line, expected", [
    ("ValueError: optim.micro_batch x optim.grad_accum (32) is larger than the training set (16 samples)",
     "ValueError: optim.micro_batch x optim.grad_accum (32) is larger than the training set (16 samples)"),
    ("ModuleNotFoundError: No module named 'transformers'", "ModuleNotFoundError: No module named 'transformers'"),
    ("relay.kernel.session.loop.NonFiniteLossError: loss was non-finite", "relay.kernel.session.loop.NonFiniteLossError: loss was non-finite"),
    ("KeyError: 'price'", "KeyError: 'price'"),
    ("relay.shared.spec.SpecError: spec.yaml: optim.lr: must be greater than 0", "relay.shared.spec.SpecError: spec.yaml: optim.lr: must be greater than 0"),
])
def test_code_errors_are_recognised_by_their_exception(last_line, expected):
    assert looks_like_code_error(TRACEBACK + "    boom()\n" + last_line + "\n") == expected
    # the last exception counts: a chained traceback ending in a code error is a code error
    chained = TRACEBACK + "OSError: disk\n\nDuring handling of the above exception, another exception occurred:\n\n"
    assert looks_like_code_error(chained + TRACEBACK + last_line) == expected


@pytest.mark.parametrize("log_tail", [
    "",
    "relay: paused at step 120/400 (stop: sigterm)\n",                     # killed: no traceback at all
    "Session exceeded its time limit of 43200 seconds.",
    TRACEBACK + "RuntimeError: CUDA error: an illegal memory access was encountered\n",
    TRACEBACK + "torch.OutOfMemoryError: CUDA out of memory.\n",
    TRACEBACK + "ConnectionResetError: [Errno 104] Connection reset by peer\n",
    "ValueError: printed by the recipe as a warning, no traceback\n",
])
def test_transient_failures_are_not_code_errors(log_tail):
    assert looks_like_code_error(log_tail) is None


def test_an_input_error_reported_by_relay_train_is_a_code_error():
    # `relay train` prints InputErrors (SpecError, DiskBudgetError, ...) as one line, exit 2, no traceback
    tail = ("relay: code 0df9bb2ad73a run price-tiny-s002-a1\n"
            "relay: error: checkpoints.disk_budget_gb: a new checkpoint (~0.01 GB) does not fit\n")
    assert looks_like_code_error(tail) == \
        "relay: error: checkpoints.disk_budget_gb: a new checkpoint (~0.01 GB) does not fit"
    assert looks_like_code_error("relay: checkpoint dataset a/b is not mounted; starting without it\n") is None


# -- after a hand-over: the same decision for one relay and for several (flows/ carry it out) ---------------------
@dataclass
class Result:  # the fields of relay.orchestrator.handoff.HandOver that the decision reads
    ok: bool
    reason: str = ""
    step: int = 0
    log_tail: str = ""
    stale: bool = False


HARVEST = Action(Do.HARVEST, run_id(NAME, 2, 1), 2, 1, "kernel complete")
SALVAGE = Action(Do.SALVAGE, run_id(NAME, 2, 1), 2, 1, "kernel error")
FACTS = Recovery(max_attempts=3, limit_advice="session 2 was stopped by Kaggle at its session limit")
CODE_ERROR = "relay: error: code.entry train.py raised ValueError: a bug at step 150\n"
CORRUPT = "relay: error: the mounted checkpoint /kaggle/input/x is corrupt: state.pt crc32 mismatch\n"


def after(action=SALVAGE, result=Result(False, "the session left no valid checkpoint"), state="error", failure="",
          **facts) -> Action:
    return after_handover(NAME, action, result, obs(published(1), action.run_id, state, failure),
                          Recovery(**{**FACTS.__dict__, **facts}))


def test_a_handed_over_session_means_look_again():
    action = after(HARVEST, Result(True, "handed over", step=300), "complete")
    assert (action.do, action.run_id, action.failed) == (Do.HANDED_OVER, HARVEST.run_id, "")


def test_a_code_error_stops_the_relay_until_the_code_changed_then_pushes_a_new_attempt():
    result = Result(False, "no progress", log_tail=CODE_ERROR)
    stopped = after(result=result)
    assert stopped.do is Do.FAILED and stopped.reason.startswith(
        "session 2 failed with a code error: relay: error: code.entry train.py raised ValueError: a bug at step 150"
        " (the code and spec are unchanged since that push")
    assert stopped.reason.endswith("--- log tail ---\n" + CODE_ERROR)
    assert stopped.failed == f"session 2 ({SALVAGE.run_id}) failed: " + CODE_ERROR.strip()
    fixed = after(result=result, code_changed=True)
    # a new attempt of the same session, which does not count against the retries (the 3rd of at most 3 here)
    assert (fixed.do, fixed.run_id) == (Do.PUSH, run_id(NAME, 2, 2)) and "the code changed since" in fixed.reason
    third = after(Action(Do.SALVAGE, run_id(NAME, 2, 3), 2, 3), result, code_changed=True)
    assert (third.do, third.run_id) == (Do.PUSH, run_id(NAME, 2, 4)) and third.failed
    # a harvested (complete) kernel's log is not read for code errors: it is retried
    assert after(HARVEST, result, "complete").do is Do.PUSH


def test_a_transient_failure_is_retried_until_the_attempts_are_used_up():
    retried = after()
    assert (retried.do, retried.run_id) == (Do.PUSH, run_id(NAME, 2, 2)) and "no valid checkpoint" in retried.failed
    last = after(Action(Do.SALVAGE, run_id(NAME, 2, 3), 2, 3), Result(False, "no valid", log_tail="killed"))
    assert last.do is Do.FAILED and "3 times" in last.reason and last.reason.endswith("--- log tail ---\nkilled")


def test_a_corrupt_mounted_checkpoint_is_restored_not_retried():
    action = after(result=Result(False, "no valid checkpoint", log_tail=CORRUPT))
    assert action.do is Do.RESTORE and action.run_id == SALVAGE.run_id
    assert action.reason == "the mounted checkpoint /kaggle/input/x is corrupt: state.pt crc32 mismatch"


def test_stale_output_soon_after_a_push_is_the_status_lag_not_a_failure():
    stale = Result(False, "stale output: it belongs to run x, not y", stale=True)
    waiting = after(HARVEST, stale, "complete", lagging=True)
    assert waiting.do is Do.WAIT and "status lag" in waiting.reason and not waiting.failed
    assert after(HARVEST, stale, "complete", lagging=False).do is Do.PUSH  # long after the push: a retry


def test_the_session_limit_stops_the_relay_unless_nothing_was_saved_and_the_budget_was_lowered():
    limit = dict(state="cancelled", failure=f"Your notebook was stopped because it {SESSION_LIMIT_MESSAGE}")
    saved = after(result=Result(True, "handed over", step=120, log_tail="tail"), **limit)
    assert saved.do is Do.FAILED and saved.reason == (
        "session 2 was stopped by Kaggle at its session limit. Its checkpoint at step 120 is handed over.\n"
        "--- log tail ---\ntail")
    nothing = Result(False, "the session left no valid checkpoint")
    assert "Nothing was handed over (the session left no valid checkpoint)" in after(result=nothing, **limit).reason
    lowered = after(result=nothing, budget_lowered=True, **limit)
    assert (lowered.do, lowered.run_id) == (Do.PUSH, run_id(NAME, 2, 2))


def test_a_diverged_session_stops_the_relay_until_something_changed():
    diverged = dict(published(1), stop_reason="diverged", sessions=[{"diverged": "the loss diverged at step 43"}])
    stopped = diverged_unchanged(obs(diverged, run_id(NAME, 1, 1), "complete"), code_changed=False)
    assert stopped.do is Do.FAILED and stopped.reason.startswith(
        "session 1 stopped itself: the loss diverged at step 43. Its checkpoint at step 100 is handed over.")
    assert diverged_unchanged(obs(diverged, run_id(NAME, 1, 1), "complete"), code_changed=True) is None
    assert diverged_unchanged(obs(published(1), run_id(NAME, 1, 1), "complete"), code_changed=False) is None


def test_a_stalled_session_is_a_failed_attempt_retried_then_the_relay_stops_saying_it():
    """A session that ended itself (stalled; another accelerator) is retried with its own words, never read as a
    code error, and the relay stops with them once the attempts are used up."""
    import json

    from relay.shared.progress_line import PREFIX

    tail = ("Traceback (most recent call last):\nKeyError: 'x'\n" + PREFIX +
            json.dumps({"kind": "end", "step": 5, "status": "paused", "stop_reason": "stalled",
                        "why": "stalled at step 5 after 10m"}))
    result = Result(False, "no progress", log_tail=tail)
    retry = after(result=result)
    assert retry.do is Do.PUSH and "stalled at step 5 after 10m" in retry.reason
    assert retry.failed.endswith("failed: stalled at step 5 after 10m")
    last = after(Action(Do.SALVAGE, run_id(NAME, 2, 3), 2, 3), result)
    assert last.do is Do.FAILED and "last: stalled at step 5 after 10m" in last.reason
