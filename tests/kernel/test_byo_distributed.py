"""A user's plain PyTorch loop (examples/byo-plain-ddp: torch DistributedDataParallel + the Session API) trained
by 2 gloo processes per session: split into 4 sessions (a SIGKILL inside a save, a step cap, a SIGTERM to rank 1
alone) it ends bit-identical to one uninterrupted 2-process run; a 2 -> 1 change resumes with the same effective
batch and says from which step exactness is lost; `relay verify-resume` and the relay on the emulator work with
2-process sessions; a batch the ranks cannot split, or an input one rank refuses, is one line and exit 2.
Every stop is triggered by an event (a rank stopped inside a save by the RELAY_TEST_STOP_MID_SAVE seam, a step
cap), never by a sleep."""
from __future__ import annotations

import json
import re
import os
import shutil
import signal
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from relay.kernel.session import checkpoint
from relay_fixtures import wait_for
from process_fixtures import ranks  # the spawned rank processes, rank 0 first

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "byo-plain-ddp"
TOTAL = 60
# every step saves (save_every 1 ms: a step takes longer), so the mid-save seam has a save below and at its step
SETTINGS = {"optim.max_steps": TOTAL, "optim.log_every_steps": 1, "session.max_steps": None,
            "session.save_every": 0.001, "checkpoints.keep_last": 2}


def copy_example(dest: Path, **overrides) -> Path:
    shutil.copytree(EXAMPLE, dest, ignore=shutil.ignore_patterns("relay-run", "__pycache__"))
    spec = dest / "spec.yaml"
    data = yaml.safe_load(spec.read_text())
    for dotted, value in {**SETTINGS, **overrides}.items():
        *parents, leaf = dotted.split(".")
        node = data
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    data["code"]["entry"] += f" --steps {TOTAL}"  # the script's own length agrees with the spec's (no warning)
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    return spec


def load_final(workdir: Path) -> tuple[dict, dict]:
    progress = json.loads((workdir / "progress.json").read_text())
    return progress, torch.load(workdir / progress["checkpoint"] / checkpoint.STATE_FILE, weights_only=True)


def stopped_in_a_save(proc) -> bool:
    """Rank 0 stopped itself (SIGSTOP, state T) inside a save: the RELAY_TEST_STOP_MID_SAVE seam."""
    for p in ranks(proc)[:1]:
        try:
            return p.status() == psutil.STATUS_STOPPED
        except psutil.Error:
            return False
    return False


def start_stopping_mid_save(relay_cli, spec: Path, workdir: Path, at_step: int, log: Path):
    """A 2-process session whose rank 0 stops inside its first save at or past `at_step`; returns the
    process, its ranks and the step of the save in progress (the torn folder's)."""
    proc = relay_cli.popen(*relay_cli.train_args(spec, workdir, None), start_new_session=True,
                           env={**relay_cli.env, "RELAY_TEST_STOP_MID_SAVE": str(at_step)},
                           stdout=open(log.with_suffix(".out"), "w"), stderr=open(log, "w"))
    wait_for(lambda: proc.poll() is not None or stopped_in_a_save(proc), 300, f"rank 0 stopped in save {at_step}")
    assert proc.poll() is None, log.read_text()[-3000:]
    rank_procs = ranks(proc)
    torn = [n for n in os.listdir(workdir / "checkpoints") if n.startswith(".tmp-step-")
            and n.endswith(f"-{rank_procs[0].pid}")]  # .tmp-step-<step>-<pid>
    assert len(torn) == 1, os.listdir(workdir / "checkpoints")
    return proc, rank_procs, int(torn[0].split("-")[2])


@pytest.fixture(scope="module")
def straight_run(relay_cli, tmp_path_factory):
    spec = copy_example(tmp_path_factory.mktemp("ref") / "ex")
    workdir = spec.parent.parent / "w"
    relay_cli.train(spec, workdir, None, "--max-steps", "none")
    progress, state = load_final(workdir)
    assert progress["status"] == "done" and progress["world_size"] == 2 and len(progress["sessions"]) == 1
    assert len(state["rng_ranks"]) == 2 and not torch.equal(state["rng_ranks"][0]["torch"],
                                                           state["rng_ranks"][1]["torch"])
    assert not any(k.startswith("module.") for k in state["objects"]["model"])  # DDP's .module is saved
    return progress, state


def test_three_sessions_sigkill_mid_save_and_sigterm_to_rank_1_are_bit_identical(relay_cli, straight_run, tmp_path):
    spec = copy_example(tmp_path / "ex")
    workdir = tmp_path / "w"

    # session 1: rank 0 stops inside the save of step 20 (rank 1 waits at the barrier); every process is killed
    proc, _, torn_step = start_stopping_mid_save(relay_cli, spec, workdir, 20, tmp_path / "s1.err")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = max(c.step for c in checkpoint.list_valid(workdir / "checkpoints"))
    assert killed_at < torn_step and torn_step >= 20

    # session 2: while rank 0 is held inside a save, SIGTERM to rank 1 alone (waiting at the save's barrier);
    # rank 0 then goes on: the next step's agreement stops both ranks at the same step
    proc, (rank0, rank1), held_at = start_stopping_mid_save(relay_cli, spec, workdir, killed_at + 3,
                                                            tmp_path / "s2.err")
    rank1.send_signal(signal.SIGTERM)
    rank0.send_signal(signal.SIGCONT)
    assert proc.wait(120) == 0, (tmp_path / "s2.err").read_text()[-3000:]
    progress = json.loads((workdir / "progress.json").read_text())
    assert progress["sessions"][-1]["stop_reason"] == "sigterm"
    assert progress["global_step"] == held_at + 1 < TOTAL

    # session 3: to the end
    relay_cli.train(spec, workdir, None, "--max-steps", "none")
    progress, state = load_final(workdir)
    ref_progress, ref_state = straight_run
    assert progress["status"] == "done" and len(progress["sessions"]) == 3
    assert progress["weights_sha256"] == ref_progress["weights_sha256"]
    for name in ("optimizer", "scheduler"):
        assert _equal(state["objects"][name], ref_state["objects"][name]), name
    assert all(torch.equal(a["torch"], b["torch"]) for a, b in zip(state["rng_ranks"], ref_state["rng_ranks"]))
    assert progress["exactness_lost"] is None and progress["world_size"] == 2
    assert [s["world_size"] for s in progress["sessions"]] == [2, 2, 2]
    # rank 0 alone writes metrics.jsonl: one mean-loss record per step of the last session
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    last = [r["step"] for r in records if r["session"] == 3 and r["kind"] == "train"]
    assert last == list(range(progress["sessions"][-1]["step_start"] + 1, TOTAL + 1))
    assert (workdir / "export" / "model.safetensors").is_file()


def test_verify_resume_kills_rank_0_mid_save_and_says_identical(relay_cli, tmp_path):
    """`relay verify-resume` on a 2-process spec: its kill hook is armed in the spawned rank that saves."""
    spec = copy_example(tmp_path / "ex", **{"session.save_every": "1h"})
    out = relay_cli.run("verify-resume", str(spec), "--steps", "16", "--workdir", str(tmp_path / "v"), timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert out.stdout.startswith("identical") and "(killed mid-save)" in out.stdout, out.stdout
    assert (tmp_path / "v" / "killed").is_file()
    state = checkpoint.load_latest(tmp_path / "v" / "split" / "checkpoints")[1]
    assert len(state["rng_ranks"]) == 2  # compared too: every rank's RNG


def test_relayed_on_the_emulator_with_two_process_sessions(relay_env, reference, monkeypatch):
    """Prefect flow -> Kaggle emulator -> session kernels running the user's folder with 2 ranks each; two
    sessions (one hand-over is the property; each session is 3 processes)."""
    spec = copy_example(relay_env.root / "ex", **{"session.max_steps": TOTAL // 2, "session.save_every": "1h",
                                                  "session.safety_margin": "0.5s", "kaggle.session_timeout": "5m",
                                                  "kaggle.startup_overhead": "1s"})
    data = yaml.safe_load(spec.read_text())
    data["code"]["folder"] = str(spec.parent)  # the reference run reads a copy of the spec elsewhere
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    relay_env.start()
    relay_env.spec = spec
    reference.start(spec)
    done = relay_env.run_flow(monkeypatch)
    assert done["state"] == "done" and done["sessions"] == 2, done
    assert [s["world_size"] for s in relay_env.published_progress()["sessions"]] == [2, 2]
    assert done["weights_sha256"] == reference.weights(spec)


def test_world_size_2_to_1_keeps_the_effective_batch_and_says_exactness_is_lost(relay_cli, tmp_path):
    two = copy_example(tmp_path / "two", **{"session.save_every": "1h"})
    one = copy_example(tmp_path / "one", **{"session.save_every": "1h", "session.devices": 1})
    workdir = tmp_path / "w"
    relay_cli.train(two, workdir, None, "--max-steps", "20")
    first = json.loads((workdir / "progress.json").read_text())
    # 8 x 2 = 16; the accumulation is the script's own, unknown to the relay
    assert (first["micro_batch"], first["grad_accum"], first["world_size"]) == (8, None, 2)
    relay_cli.train(one, workdir, None, "--max-steps", "none")  # a bare model loads the DDP run's checkpoint
    progress = json.loads((workdir / "progress.json").read_text())
    assert progress["status"] == "done" and progress["global_step"] == TOTAL
    assert (progress["micro_batch"], progress["grad_accum"], progress["world_size"]) == (16, None, 1)
    assert progress["exactness_lost"] == {"step": 20, "why": "world size changed from 2 to 1 processes"}
    assert [s["world_size"] for s in progress["sessions"]] == [2, 1]


def test_the_ranks_slices_make_up_the_steps_effective_batch(tmp_path):
    """What batches() gives rank r is the r-th half of the one-process batch of the same step."""
    from relay.kernel.session.api import Session
    from relay.kernel.session.distributed import World
    from relay.kernel.session.settings import SessionSettings

    def indices(world: World, step: int) -> list[int]:
        session = Session(SessionSettings(workdir=str(tmp_path), total_steps=100, seed=3, save_every=1e9,
                                          safety_margin=0.0), world)
        session.clock.restore_signal_handlers()
        session.step = step
        return session.batch_indices(100, 16).tolist()

    for step in (0, 7, 70):  # 6 steps per epoch: epochs 0, 1 and 11
        whole = indices(World(0, 1), step)
        assert len(whole) == 16 and indices(World(0, 2), step) + indices(World(1, 2), step) == whole


def test_a_batch_the_ranks_cannot_split_is_one_line_exit_2_and_writes_nothing(relay_cli, tmp_path):
    spec = copy_example(tmp_path / "ex")
    spec.write_text(spec.read_text().replace("--batch 16", "--batch 15"))
    proc = relay_cli.train(spec, tmp_path / "w", None, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    logged = re.compile(r"\d\d:\d\d:\d\d (DEBUG|INFO) ")  # the relay's own progress log (what the session runs on)
    assert [line for line in proc.stderr.strip().splitlines() if not logged.match(line)] == [  # one line: every
        # rank refuses it, the launcher reports it once
        "relay: error: session.batches(batch_size=15): the effective batch must be divisible by the 2 processes"
        " of session.devices, so every rank takes an equal slice"]
    assert "Traceback" not in proc.stderr and not (tmp_path / "w").exists()


def test_an_input_refused_by_rank_1_alone_stops_rank_0_and_is_one_line_exit_2(relay_cli, tmp_path):
    """Rank 0 is already waiting in the step's all-reduce when rank 1 refuses: the launcher stops rank 0
    (it never returns from the collective on its own) and reports rank 1's line."""
    spec = copy_example(tmp_path / "ex")
    script = spec.parent / "train.py"
    script.write_text(script.read_text().replace(
        "    session.restore()  # relay: every rank's own RNG\n",
        "    session.restore()  # relay: every rank's own RNG\n"
        "    if session.rank == 1:\n"
        "        from relay.shared.errors import InputError\n"
        "        raise InputError('data/shard-1.csv: line 3: expected 33 columns, got 2')\n"))
    proc = relay_cli.train(spec, tmp_path / "w", None, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == ("relay: error: data/shard-1.csv: line 3: expected 33 columns,"
                                                    " got 2")
    assert "Traceback" not in proc.stderr and not (tmp_path / "w").exists()


@pytest.mark.parametrize("callback", ["relay.hf:RelayCallback", "relay.lightning:RelayLightningCallback"])
def test_the_trainer_callbacks_refuse_several_processes_in_one_line(callback, tmp_path):
    """HF Trainer and Lightning under several processes are not proved: refused, never half-supported."""
    import importlib

    from relay.kernel.session.api import Session
    from relay.kernel.session.distributed import World
    from relay.kernel.session.settings import SessionSettings
    from relay.shared.errors import InputError

    module, name = callback.split(":")
    cls = getattr(importlib.import_module(module), name)
    session = Session(SessionSettings(workdir=str(tmp_path), total_steps=10, save_every=1e9, safety_margin=0.0),
                      World(1, 2))
    session.clock.restore_signal_handlers()
    with pytest.raises(InputError) as err:
        cls(session)
    assert str(err.value) == (f"{name}: session.devices gives 2 processes; the callback trains in one process"
                              " only: set session.devices: 1 (a plain loop with the Session API can use several)")


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if torch.is_tensor(a) else a == b
