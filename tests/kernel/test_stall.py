"""A stuck session ends itself: the stall watchdog (session.stall_after), on both session paths, in real
`relay train` processes, and the orchestrator's reading of what such a session leaves.

The hangs are infinite (an Event that is never set), so the outcome depends on no machine's speed: whatever
the watchdog's bound, the session can only end by it. A short stall_after (3 s: longer than any step of these
toy loops on a loaded machine) keeps the tests short.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from byo_fixtures import copy_example, tiny_session_script
from relay.kernel.session.budget import SessionClock
from relay.kernel.session.watchdog import STALL_FLOOR_S, STALLED_EXIT, StallWatchdog, stall_limit
from relay.orchestrator import chain
from relay.shared.progress_line import PREFIX

# A Session API loop that saves at step 3 and then hangs in step 5 (a deadlock in user code, a hung loader):
# the hang step is read from a file, so the next session of the same spec runs without it.
HANGING_SCRIPT = tiny_session_script(
    head="import threading\nfrom pathlib import Path\n"
         "marker = Path(__file__).with_name('hang-at')\n"
         "hang_at = int(marker.read_text()) if marker.exists() else -1",
    before_step="if session.step == hang_at: threading.Event().wait()  # never set: this step never ends",
    after_step="if session.step == 3: session.save()")

# The built-in runner on a recipe whose data loader hangs when it fetches the batches of step `hang_at`.
HANGING_RECIPE = '''
import threading

from torch.utils.data import Dataset

from mypkg.recipes import ClassifyParams, ClassifyRecipe

NEVER = threading.Event()  # never set


class HangingParams(ClassifyParams):
    hang_at: int = -1


class HangingLoader(Dataset):
    def __init__(self, inner, recipe):
        self.inner, self.recipe = inner, recipe

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        if self.recipe.step == self.recipe.params.hang_at:
            NEVER.wait()
        return self.inner[i]


class HangingRecipe(ClassifyRecipe):
    Params = HangingParams
    step = -1

    def train_dataset(self):
        return HangingLoader(super().train_dataset(), self)

    def on_step(self, step, epoch):
        self.step = step
        return super().on_step(step, epoch)
'''


def _progress(workdir: Path) -> dict:
    return json.loads((workdir / "progress.json").read_text())


def _assert_stalled(proc, workdir: Path, step: int, checkpoint_step: int, where: str) -> dict:
    """The session exited STALLED_EXIT, said where it hung, and left progress.json saying "stalled at step
    N" beside its newest checkpoint, which stands; the orchestrator reads the stall from the log alone."""
    assert proc.returncode == STALLED_EXIT, proc.stderr[-3000:]
    assert where in proc.stderr, proc.stderr[-3000:]  # the threads' stacks show where it hung
    progress = _progress(workdir)
    record = progress["sessions"][-1]
    assert progress["status"] == "paused" and progress["stop_reason"] == "stalled"
    assert progress["global_step"] == checkpoint_step
    assert record["stop_reason"] == "stalled" and record["step_end"] == step
    assert record["stalled"].startswith(f"stalled at step {step} after ")
    assert chain.ended_itself(proc.stdout) == ("stalled", record["stalled"])
    assert proc.stdout.rstrip().splitlines()[-1].startswith(PREFIX)  # the last line the relay reads
    return progress


def test_a_session_api_loop_that_hangs_ends_itself_and_the_next_session_resumes(relay_cli, tmp_path):
    spec = copy_example("byo-plain", tmp_path / "ex", **{
        "code.entry": "hang.py", "optim.max_steps": 12, "session.max_steps": None, "session.stall_after": "3s"})
    (spec.parent / "hang.py").write_text(HANGING_SCRIPT)
    (spec.parent / "hang-at").write_text("5")
    workdir = tmp_path / "w"
    stalled = relay_cli.train(spec, workdir, check=False, timeout=300)
    progress = _assert_stalled(stalled, workdir, step=5, checkpoint_step=3, where="hang.py")
    assert progress["checkpoint"].endswith("step-00000003")

    (spec.parent / "hang-at").unlink()  # the next session: no hang, from the checkpoint that stood
    relay_cli.train(spec, workdir)
    done = _progress(workdir)
    assert done["status"] == "done" and done["global_step"] == 12
    assert [s["step_start"] for s in done["sessions"]][-1] == 3


def test_the_built_in_runner_whose_data_loader_hangs_ends_itself(relay_cli, tmp_path):
    spec = copy_example("byo-recipe", tmp_path / "ex", **{
        "recipe": "mypkg.hanging:HangingRecipe", "params.hang_at": 4, "session.max_steps": None,
        "session.stall_after": "3s"})
    (spec.parent / "mypkg" / "hanging.py").write_text(HANGING_RECIPE)
    workdir = tmp_path / "w"
    stalled = relay_cli.train(spec, workdir, check=False, timeout=300)
    progress = _assert_stalled(stalled, workdir, step=4, checkpoint_step=0, where="hanging.py")
    assert progress["checkpoint"] is None  # nothing saved before the hang: the relay's last checkpoint stands
    assert not list((workdir / "checkpoints").glob("step-*"))


def _rank_that_stalls(rank, world_size, port, errors) -> None:
    """A rank as session/core.py's watchdog ends it; the other waits forever (as on a collective)."""
    import os

    if rank == 0:
        os._exit(STALLED_EXIT)
    threading.Event().wait()


def test_a_rank_that_stalls_ends_relay_train_with_the_same_status(spawns_processes):
    from relay.kernel.session import distributed

    with pytest.raises(SystemExit) as ended:
        distributed.launch(_rank_that_stalls, 2, ())
    assert ended.value.code == STALLED_EXIT


# -- the watchdog's bound and thread ------------------------------------------------------------------------
def test_auto_stall_limit_grows_with_the_slowest_step_and_the_save():
    clock = SessionClock()
    assert stall_limit("auto", clock) == STALL_FLOOR_S
    clock.record_step(45.0)
    clock.record_step(1.0)
    assert stall_limit("auto", clock) == 20 * 45.0  # the slowest step, not the latest
    clock.record_save(400.0)
    assert stall_limit("auto", clock) == 3 * 400.0
    assert stall_limit(2.5, clock) == 2.5 and stall_limit(None, clock) is None


def test_the_watchdog_fires_once_on_no_progress_and_never_after_stop():
    clock = SessionClock()
    fired: list = []
    stalled = threading.Event()
    StallWatchdog(clock, 0.05, lambda idle: (fired.append(idle), stalled.set())).start()
    clock.record_step(0.01)  # before a first step STALL_FLOOR_S holds; after it, stall_after (not 600 s later)
    assert stalled.wait(60)  # an infinite lack of progress: only the watchdog ends the wait
    assert len(fired) == 1 and fired[0] >= 0.05

    quiet = StallWatchdog(SessionClock(), 3600.0, lambda idle: fired.append(idle)).start()
    quiet.stop()
    quiet._thread.join(60)
    assert not quiet._thread.is_alive() and len(fired) == 1
    off = StallWatchdog(SessionClock(), None, lambda idle: fired.append(idle)).start()
    assert not off._thread.is_alive()  # stall_after: none starts no thread


# -- what the orchestrator reads ----------------------------------------------------------------------------
def _end(**fields) -> str:
    return PREFIX + json.dumps({"kind": "end", "step": 5, "status": "paused", **fields})


@pytest.mark.parametrize("tail, expected", [
    (f"step 1\n{_end(stop_reason='stalled', why='stalled at step 5 after 10m')}\n",
     ("stalled", "stalled at step 5 after 10m")),
    (_end(stop_reason="wrong_accelerator", why="got 1 x Tesla P100-PCIE-16GB where ..."),
     ("wrong_accelerator", "got 1 x Tesla P100-PCIE-16GB where ...")),
    (_end(stop_reason="budget"), None),
    (f"{_end(stop_reason='stalled', why='old')}\n{_end(stop_reason='steps')}", None),  # the last end decides
    ("Traceback (most recent call last):\nRuntimeError: CUDA error", None),
    ("", None),
])
def test_the_orchestrator_tells_a_session_that_ended_itself(tail, expected):
    assert chain.ended_itself(tail) == expected


def test_a_stall_is_a_failed_attempt_retried_then_the_relay_stops_saying_it():
    """How the flow uses it: the stall's words are the retry's reason, and the failure's after the last try."""
    why = chain.ended_itself(_end(stop_reason="stalled", why="stalled at step 5 after 10m"))[1]
    first = chain.Action(chain.Do.SALVAGE, "r-s002-a1", 2, 1)
    retry = chain.retry_action("r", first, max_attempts=2, why=why)
    assert retry.do is chain.Do.PUSH and retry.run_id == "r-s002-a2" and "stalled at step 5" in retry.reason
    failed = chain.retry_action("r", chain.Action(chain.Do.SALVAGE, retry.run_id, 2, 2), max_attempts=2, why=why)
    assert failed.do is chain.Do.FAILED and failed.reason.endswith("last: stalled at step 5 after 10m")


def test_stall_after_in_the_spec():
    from relay.shared.spec_sections import SessionConfig

    assert SessionConfig().stall_after == "auto"
    assert SessionConfig(stall_after="90s").stall_after == 90.0
    assert SessionConfig(stall_after="none").stall_after is None
    with pytest.raises(ValueError, match="must be `auto`, a duration > 0 or none"):
        SessionConfig(stall_after="0s")
