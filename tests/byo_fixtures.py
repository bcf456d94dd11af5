"""Helpers for the bring-your-own-code tests: the examples under examples/byo-* copied out of the repository,
a user script that crashes mid-run, and one example relayed on the emulator with a kill mid-save."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

import prefect_template
from history_checks import check_history
from kaggle_fixtures import FAKE_KEY, KERNEL_ENV, USER
from process_fixtures import run_flow_with_a_kill_mid_save

REPO = Path(__file__).resolve().parents[1]
EXAMPLES_DIR = REPO / "examples"


def copy_example(name: str, dest: Path, **spec_overrides) -> Path:
    """The example folder copied to `dest` (so nothing is written in the repository); returns its spec."""
    shutil.copytree(EXAMPLES_DIR / name, dest, ignore=shutil.ignore_patterns("relay-run", "__pycache__"))
    spec = dest / "spec.yaml"
    data = yaml.safe_load(spec.read_text())
    for dotted, value in spec_overrides.items():
        *parents, leaf = dotted.split(".")
        node = data
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    return spec


def tiny_session_script(before_step: str = "", after_step: str = "", head: str = "", lr: float = 0.1,
                        loss: str = "model(torch.randn(8, 4)).sum()", report_loss: bool = False,
                        train: bool = True) -> str:
    """The smallest Session API loop (a Linear(4, 1) on random batches, 64 steps of 8), with code of the test's
    own at module level (`head`) and before and after each step (one line each, inside the loop). Without
    `train` the loop only steps (and reports `loss` when `report_loss`): no optimizer, no backward."""
    step = [before_step, f"loss = {loss}" if train or report_loss else "",
            "opt.zero_grad(); loss.backward(); opt.step()" if train else "",
            "session.step_done(loss=loss.detach())" if report_loss else "session.step_done()", after_step]
    loop = "".join(f"    {line}\n" for line in step if line)
    optimizer = f"opt = torch.optim.SGD(model.parameters(), lr={lr})\n" if train else ""
    return f'''{head}
import torch, relay
session = relay.open_session()
model = torch.nn.Linear(4, 1)
{optimizer}session.register(model=model{", optimizer=opt" if train else ""})
session.restore()
for idx in session.batches(64, 8):
{loop}session.close()
'''


CRASHING = tiny_session_script(before_step='if session.step == 45: raise ValueError("bad column in my data")')
FINISHING = tiny_session_script()  # CRASHING, fixed


RELAY_SETTINGS = {"kaggle.session_timeout": "5m", "kaggle.startup_overhead": "1s", "kaggle.max_failed_sessions": 2,
                  "session.save_every": "0.02s", "session.safety_margin": "0.5s", "session.threads": 1}


# A save at every step, whatever the machine's speed: an insurance save is due at a step_done once save_every has
# passed since the last save, and one step (a forward, a backward, an optimizer step: tens of microseconds at least)
# is always longer than a nanosecond. What a mid-save kill is bound to (relay_example_with_a_kill_mid_save).
EVERY_STEP = {"session.save_every": 1e-9}


def example_spec(relay_env, example: str, **overrides) -> Path:
    """An example folder copied under the relay's root with RELAY_SETTINGS (`overrides` win); it becomes
    relay_env.spec."""
    spec = copy_example(example, relay_env.root / example, **{**RELAY_SETTINGS, **overrides})
    data = yaml.safe_load(spec.read_text())
    data["code"]["folder"] = str(spec.parent)  # the reference run reads a copy of the spec elsewhere
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    relay_env.spec = spec
    return spec


def relay_example_with_a_kill_mid_save(example: str, lengths: dict, relay_env, reference, monkeypatch) -> None:
    """Relay an example folder on the emulator in step-bounded sessions, the kernel of session 2 SIGKILLed inside a
    save (MidSaveKiller); the final weights equal an uninterrupted `relay train` of the same spec. Two sessions of
    steps are enough: one handed over before the fault, and the fault's own, done again from what it committed."""
    per_session = lengths["session.max_steps"]
    # the kernel of session 2 stops itself inside a save half-way through it (a seam of relay.kernel.session.checkpoint)
    kill_at = per_session + per_session // 2
    relay_env.start(kernel_env={**KERNEL_ENV, "RELAY_TEST_STOP_MID_SAVE": str(kill_at)})
    # The seam stops a process only in a save past one it committed itself below kill_at. Saves every few
    # milliseconds raced the steps for that first save: a session 2 that ran its steps up to kill_at within one
    # save_every of its start took no save below it, never stopped, and the relay ended unkilled. A save at every
    # step binds the kill to steps: the torn save is kill_at's, the step before it committed, on any machine.
    spec = example_spec(relay_env, example, **{**EVERY_STEP, **lengths})
    reference.start(spec)
    summary, killer = run_flow_with_a_kill_mid_save(relay_env, monkeypatch)
    assert summary["state"] == "done" and summary["step"] == lengths["optim.max_steps"], summary
    assert killer.killed["torn"].startswith(f".tmp-step-{kill_at:08d}-"), killer.killed
    assert f"step-{kill_at - 1:08d}" in killer.killed["committed"], killer.killed
    runs = relay_env.kernel_runs()
    killed = [r for r in runs if r.status == "ERROR"]
    assert [r.version for r in killed] == [killer.killed["version"]] and "-9" in killed[0].failure
    progress = relay_env.published_progress()
    steps_per_session = lengths["session.max_steps"]
    assert len(progress["sessions"]) >= 2 and all(
        s["step_end"] - s["step_start"] <= steps_per_session for s in progress["sessions"])
    assert summary["weights_sha256"] == progress["weights_sha256"] == reference.weights(spec)
    # each checkpoint version published only its session's lines (the killed one's past its last save too); the
    # orchestrator's folder holds them all, the curves unchanged
    whole = check_history(relay_env)
    assert {r["session"] for r in whole} == {s["index"] for s in progress["sessions"]}


# A newcomer's relay: the README's commands in a shell that has only what a user's has. Two sessions of 30 steps: a
# hand-over between them, and a fault a test makes in session 2 is the relay's last.
RELAYED = {"optim.max_steps": 60, "session.max_steps": 30, "session.save_every": "10m",
           "session.safety_margin": "0.5s", "kaggle.session_timeout": "5m", "kaggle.startup_overhead": "1s"}


def relay_in_shell(tmp_path, emulator, cwd, *args, timeout=900, python_code=None, env_extra=None, input=None,
                   fresh_prefect=False):
    """`python -m relay ARGS` (or `python -c PYTHON_CODE ARGS`) in cwd, with only what a user's shell has
    (and `env_extra`); `input`: what the user types. fresh_prefect: see shell_env."""
    command = [sys.executable, "-m", "relay"] if python_code is None else [sys.executable, "-c", python_code]
    return subprocess.run([*command, *args], cwd=cwd, env=shell_env(tmp_path, emulator, env_extra, fresh_prefect),
                          capture_output=True, text=True, timeout=timeout, input=input)


def shell_env(tmp_path, emulator, env_extra=None, fresh_prefect=False) -> dict:
    """What a user's shell has for the README's commands against the emulator (HOME and TMPDIR under tmp_path).
    Its PREFECT_HOME holds a migrated database (tests/prefect_template.py: a user who has run Prefect before);
    fresh_prefect=True leaves it empty, a machine's first run."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path / "home"), "TMPDIR": str(tmp_path / "tmp"),
           "PYTHONPATH": str(REPO), "KAGGLE_USERNAME": USER, "KAGGLE_KEY": FAKE_KEY,
           "RELAY_KAGGLE_ENDPOINT": emulator.url, "PREFECT_HOME": str(tmp_path / "prefect"), "DO_NOT_TRACK": "1",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "MPLCONFIGDIR": str(tmp_path / "mpl")}
    env.update(env_extra or {})
    for d in ("home", "tmp"):
        (tmp_path / d).mkdir(exist_ok=True)
    if not fresh_prefect:
        prefect_template.migrated(Path(env["PREFECT_HOME"]))
    return env
