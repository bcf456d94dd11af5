"""`relay run SPEC --tick`, as cron or GitHub Actions runs it: each tick does what needs no waiting (a hand-over,
then the next session's push). A tick whose relay is only
waiting for a running session looks at Kaggle once and returns, without Prefect; no tick, waiting or acting,
needs the training stack (torch, transformers): the orchestrator-only install is enough. The session is held
running by a gate file the test opens (an event, never a sleep)."""
from __future__ import annotations

import json
import re

from kaggle_fixtures import KERNEL_ENV, isolated_env, make_emulator  # noqa: F401
from byo_fixtures import RELAYED, copy_example, relay_in_shell

GATE_LINE = "        session.step_done(loss=loss.detach())  # relay\n"
# the blocked modules: importing one raises ImportError in the tick's process
BLOCK = "import sys; sys.modules.update(dict.fromkeys({mods!r})); import runpy; runpy.run_module('relay', run_name='__main__')"
TRAINING_STACK = ("torch", "transformers", "tokenizers", "safetensors", "pyarrow")


def _tick(tmp_path, emulator, project, blocked):
    return relay_in_shell(tmp_path, emulator, project, "run", "spec.yaml", "--tick", "--poll", "0.3",
                  python_code=BLOCK.format(mods=tuple(blocked)))


def _wait_for_the_newest_session(emulator, kernel: str) -> None:
    """Until the newest version of `kernel` has ended: the emulator runs each on a thread of its own."""
    newest = emulator.store.kernels[kernel]["versions"][-1]["number"]
    runner = emulator.runner.threads[f"{kernel}/v{newest}"]
    runner.join(timeout=600)  # a hang guard: a toy session ends in seconds
    assert not runner.is_alive(), f"{kernel} v{newest} still runs after 600 s"


def test_ticks_run_a_relay_without_the_training_stack_and_a_waiting_tick_without_prefect(
        make_emulator, tmp_path, spawns_processes):
    emulator = make_emulator(kernel_env=dict(KERNEL_ENV))
    project = tmp_path / "my-project"
    copy_example("byo-plain", project, **RELAYED)
    gate = tmp_path / "gate"
    script = project / "train.py"
    # session 1 stops at step 15 until the test opens the gate: the kernel is "running" for as long as needed
    script.write_text(script.read_text().replace(GATE_LINE, GATE_LINE + (
        f"        while session.step == 15 and not __import__('os').path.exists({str(gate)!r}):\n"
        "            __import__('time').sleep(0.05)\n")))

    first = _tick(tmp_path, emulator, project, TRAINING_STACK)
    assert first.returncode == 0 and "pushed: step 0/?" in first.stdout, first.stdout + first.stderr[-3000:]
    kernel = emulator.store.kernels["alice/byo-plain-session"]
    waiting = _tick(tmp_path, emulator, project, TRAINING_STACK + ("prefect",))
    assert waiting.returncode == 0, waiting.stdout + waiting.stderr[-3000:]
    assert waiting.stdout.startswith("relay byo-plain: session 1 (byo-plain-s001-a1) ") and \
        "nothing to do" in waiting.stdout, waiting.stdout
    assert len(kernel["versions"]) == 1

    gate.touch()
    states = []
    for _ in range(12):  # two acting ticks are needed; the count only guards a stuck relay
        _wait_for_the_newest_session(emulator, "alice/byo-plain-session")  # a tick now has something to do
        tick = _tick(tmp_path, emulator, project, TRAINING_STACK)
        assert tick.returncode == 0, tick.stdout + tick.stderr[-3000:]
        summary = re.search(r"^([a-z-]+): step \d+/", tick.stdout, re.M)
        states.append(summary.group(1) if summary else "wait" if "nothing to do" in tick.stdout else tick.stdout)
        if "done: step 60/60" in tick.stdout:
            break
    assert states[-1] == "done", states
    acting = [s for s in states if s != "wait"]
    assert acting == ["pushed", "done"], states  # a hand-over and the next push in one tick; the last, the end
    published = json.loads((project / "relay-runs" / "byo-plain" / "published" / "progress.json").read_text())
    assert published["global_step"] == 60 and len(published["sessions"]) == 2
    assert [v["number"] for v in kernel["versions"]] == [1, 2]  # each session pushed once
