"""verify-resume's sessions forked warm (RELAY_WARM_MODULES, relay/kernel/verify.py) are the sessions it starts
cold: the same process (its own session and process group, stdin, cwd, argv, environment, exit status, the
SIGKILL of its group), the same generators (Python's `random` seeded anew from the OS as a fresh interpreter
seeds it, torch's default generator as `import torch` leaves it: torch 2.13 seeds it from the OS at load), and
so the same verdicts: a script that uses a number its interpreter drew before open_session() reaches the same
verdict warm as cold, and a correct one is identical, with its session killed mid-save.

These tests name their warm modules themselves (their subject is the warm start: they run warm under
RELAY_TEST_WARM=0 too). Sessions are bounded by step counts (`--cut-at`), never by time.
"""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import yaml

# What a session sees of its process; it leaves with status 3.
PROBE = '''
import json, os, sys
print(json.dumps({"own session": os.getsid(0) == os.getpid(), "own group": os.getpgid(0) == os.getpid(),
                  "stdin": sys.stdin.read(), "cwd": os.getcwd(), "argv": sys.argv, "path0": sys.path[0],
                  "marker": os.environ.get("PROBE_MARK")}))
sys.stderr.write("to the log too\\n")
sys.exit(3)
'''


def test_a_warm_session_is_the_process_a_cold_one_is(tmp_path, monkeypatch, spawns_processes):
    """verify._start cold and warm (a zygote of `json` alone: the process, not the imports, is the subject)."""
    from relay.kernel import verify

    monkeypatch.chdir(tmp_path)
    env = {**verify._sessions_env(), "PROBE_MARK": "set"}
    seen = {}
    for name, warm in (("cold", ()), ("warm", ("json",))):
        with open(tmp_path / f"{name}.log", "w") as out:
            proc = verify._start(["-c", PROBE, "train", "x"], env, out, warm)
            assert proc.wait(timeout=60) == 3
        seen[name] = (tmp_path / f"{name}.log").read_text()
    assert seen["warm"] == seen["cold"], seen
    assert json.loads(seen["cold"].splitlines()[0]) == {
        "own session": True, "own group": True, "stdin": "", "cwd": str(tmp_path), "argv": ["-c", "train", "x"],
        "path0": "", "marker": "set"}
    assert seen["cold"].splitlines()[1] == "to the log too"

    # the kill verify-resume makes mid-save: SIGKILL to the session's process group
    with open(tmp_path / "killed.log", "w") as out:
        proc = verify._start(["-c", "import os, time; os.fork() or time.sleep(60); time.sleep(60)"], env, out,
                             ("json",))
        os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL


# A loop whose learning rate is scaled by a number its interpreter drew before open_session() seeded anything
# (LR_FROM: random, numpy or torch), or not (none). Each session appends what it drew to DRAWN_LOG.
SCRIPT = '''
import json, os, random
import numpy, torch, relay
drawn = {"random": random.random(), "numpy": numpy.random.random(), "torch": torch.rand(1).item()}
with open(os.environ["DRAWN_LOG"], "a") as log:
    log.write(json.dumps(drawn) + "\\n")
session = relay.open_session()
g = torch.Generator().manual_seed(0)
x, y = torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01 * (1 + drawn.get(os.environ["LR_FROM"], 0)))
session.register(model=model, optimizer=opt)
session.restore()
for idx in session.batches(len(x), 8):
    loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
    opt.zero_grad(); loss.backward(); opt.step()
    session.step_done(loss=loss.detach())
session.close()
'''
WARM = "torch,torch._dynamo,yaml,pydantic.main,psutil,safetensors.torch,tqdm.auto"  # the tests' WARM_MODULES


def _verify(relay_cli, tmp_path: Path, name: str, lr_from: str, warm: str) -> tuple[str, list]:
    folder = tmp_path / "code"
    if not folder.exists():
        folder.mkdir()
        (folder / "train.py").write_text(SCRIPT)
        (folder / "spec.yaml").write_text(yaml.safe_dump({
            "name": "warm", "code": {"folder": ".", "entry": "train.py"}, "seed": 0,
            "optim": {"max_steps": 8}, "session": {"threads": 1, "save_every": "0.001s"}}, sort_keys=False))
    drawn = tmp_path / f"{name}.drawn"
    out = relay_cli.run("verify-resume", str(folder / "spec.yaml"), "--steps", "8", "--cut-at", "3",
                        "--workdir", str(tmp_path / name), timeout=600,
                        env={"RELAY_WARM_MODULES": warm, "LR_FROM": lr_from, "DRAWN_LOG": str(drawn)})
    assert out.returncode in (0, 1), out.stdout + out.stderr[-3000:]
    assert "(killed mid-save)" in out.stdout and (tmp_path / name / "killed").is_file(), out.stdout
    return out.stdout, [json.loads(line) for line in drawn.read_text().splitlines()]


def test_warm_sessions_reach_the_verdicts_of_cold_ones(relay_cli, tmp_path):
    cold, cold_drawn = _verify(relay_cli, tmp_path, "cold", "torch", "")
    warm, warm_drawn = _verify(relay_cli, tmp_path, "warm", "torch", WARM)
    drawn = cold_drawn + warm_drawn
    assert len(cold_drawn) >= 4 and len(warm_drawn) >= 4, drawn  # the straight run and three split sessions
    # random, numpy: each session its own seed; torch: each session its own if a fresh interpreter's is (torch
    # 2.13), else the built-in one in every session (the zygote drew nothing)
    assert len({d["random"] for d in drawn}) == len({d["numpy"] for d in drawn}) == len(drawn), drawn
    own_seed = len({d["torch"] for d in cold_drawn}) > 1
    assert len({d["torch"] for d in drawn}) == (len(drawn) if own_seed else 1), drawn
    assert cold.split(":")[:2] == warm.split(":")[:2], (cold, warm)  # the same verdict, at the same tensor
    assert cold.startswith("differs: " if own_seed else "identical"), cold

    same, _ = _verify(relay_cli, tmp_path, "warm-none", "none", WARM)
    assert same.startswith("identical"), same


def test_a_bad_warm_module_is_one_line_and_runs_nothing(relay_cli, tmp_path):
    from byo_fixtures import copy_example

    spec = copy_example("byo-plain", tmp_path / "ex")
    for bad, named in (("torch,no_such_module_here", "'no_such_module_here'"), ("torch, ,a b", "'a b'")):
        out = relay_cli.run("verify-resume", str(spec), "--steps", "8", "--workdir", str(tmp_path / "v"),
                            env={"RELAY_WARM_MODULES": bad})
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert "relay verify-resume: RELAY_WARM_MODULES=" in out.stderr and named in out.stderr, out.stderr
        assert not (tmp_path / "v").exists()
    # a module whose import fails: the zygote's own message, then one line; no session ran
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "fails_on_import.py").write_text("raise RuntimeError('fails on purpose')\n")
    out = relay_cli.run("verify-resume", str(spec), "--steps", "8", "--workdir", str(tmp_path / "v"),
                        env={"RELAY_WARM_MODULES": "fails_on_import",
                             "PYTHONPATH": os.pathsep.join([relay_cli.env["PYTHONPATH"], str(tmp_path / "mods")])})
    assert out.returncode == 2 and "RuntimeError: fails on purpose" in out.stderr, out.stderr
    assert out.stderr.splitlines()[-1].endswith("RELAY_WARM_MODULES=fails_on_import: the process importing them"
                                                " ended (exit 1; its message above): leave out the module that"
                                                " fails, or unset it"), out.stderr
    assert not (tmp_path / "v" / "straight").exists()  # no session ran
