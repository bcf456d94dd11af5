"""Exact resume: a run split into sessions by budget, SIGTERM or SIGKILL (at random instants, mid-save too)
ends bit-identical to an uninterrupted run. Every session is a new `python -m relay train` process.

Identity is checked twice: progress.json `weights_sha256`, and every tensor of the final checkpoint's model,
optimizer, scheduler and RNG state loaded with torch.load(weights_only=True) and compared with torch.equal.
"""
from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import torch

from conftest import toy_spec_dict, write_spec
from relay.emulator.mid_save_kill import stopped
from relay.kernel.session import checkpoint, data

# 512 samples / (8 x 2) = 32 optimizer steps per epoch, 5 epochs = 160 steps; dropout 0.2 makes every step
# depend on the RNG; eval at each epoch end (best-checkpoint saves); a periodic save every 0.2 s so a SIGKILL
# lands near (and sometimes inside) a save.
RESUME = dict(
    name="resume-toy", seed=7,
    params={"n_train": 512, "n_eval": 64, "hidden": 128, "dropout": 0.2},
    optim={"epochs": 5, "log_every_steps": 4},
    session={"save_every": 0.2},
    checkpoints={"keep_last": 2},
)
TOTAL = 160
SESSION_LINE = "relay.kernel.run: session "  # logged right before the first training step


def load_final(workdir: Path) -> tuple[dict, dict]:
    progress = json.loads((workdir / "progress.json").read_text())
    state = torch.load(workdir / progress["checkpoint"] / checkpoint.STATE_FILE, weights_only=True)
    return progress, state


def assert_tree_equal(a, b, where: str) -> None:
    if torch.is_tensor(a) or torch.is_tensor(b):
        assert torch.is_tensor(a) and torch.is_tensor(b), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where}: tensors differ (max abs diff {(a.double() - b.double()).abs().max()})"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in a:
            assert_tree_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_tree_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same_as_reference(workdir: Path, reference: tuple[dict, dict]) -> dict:
    progress, state = load_final(workdir)
    ref_progress, ref_state = reference
    assert progress["status"] == "done" and progress["global_step"] == TOTAL
    assert progress["weights_sha256"] == ref_progress["weights_sha256"]
    # The sha in progress.json is over the same tensors that the checkpoint holds.
    assert checkpoint.weights_sha256(state["objects"]["model"]) == progress["weights_sha256"]
    assert_tree_equal(state["objects"], ref_state["objects"], "objects")  # model, optimizer, scheduler, scaler
    assert_tree_equal(state["rng"], ref_state["rng"], "rng")
    for key in ("global_step", "best", "last_eval", "micro_batch", "grad_accum", "skipped_steps", "divergence"):
        assert state["relay"][key] == ref_state["relay"][key], key
    # Killed saves leave .tmp folders; the next save removes them.
    assert not list((workdir / "checkpoints").glob(".tmp-*"))
    return progress


@pytest.fixture(scope="module")
def spec_path(tmp_path_factory) -> Path:
    return write_spec(tmp_path_factory.mktemp("resume-spec"), toy_spec_dict(RESUME))


@pytest.fixture(scope="module")
def reference(spec_path, relay_cli, tmp_path_factory) -> tuple[dict, dict]:
    workdir = tmp_path_factory.mktemp("reference")
    relay_cli.train(spec_path, workdir, "none")
    progress, state = load_final(workdir)
    assert progress["status"] == "done" and progress["global_step"] == TOTAL
    assert len(progress["sessions"]) == 1
    return progress, state


class Session:
    """One `relay train` process whose stderr is drained by a thread (tqdm writes a lot of it).
    Kills are triggered by events (a step reached, the process stopped inside a save), so none depends on
    the machine's speed."""

    def __init__(self, relay_cli, spec: Path, workdir: Path, budget="none", env: Optional[dict] = None):
        self.workdir = workdir
        self.proc = relay_cli.popen(*relay_cli.train_args(spec, workdir, budget), env={**relay_cli.env, **(env or {})})
        self.training = threading.Event()
        self.stderr: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line)
            if SESSION_LINE in line:
                self.training.set()
        self.training.set()  # the process ended (possibly before training)

    def wait_training(self, timeout: float = 120) -> None:
        assert self.training.wait(timeout), "relay train did not start training"

    def kill_at_step(self, step: int, delay: float, sig: int) -> None:
        """Send `sig` `delay` s after metrics.jsonl shows optimizer step >= `step` (logged every 4 steps):
        an instant at random within a step, an eval, a save or a progress write, well before the run's end."""
        while self.proc.poll() is None and _last_step(self.workdir) < step:
            time.sleep(0.001)
        time.sleep(delay)
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill_in_save(self) -> bool:
        """SIGKILL this process once it has stopped itself inside a save (the RELAY_TEST_STOP_MID_SAVE seam of
        relay.kernel.session.checkpoint). Returns whether the save was torn: its .tmp folder there, uncommitted."""
        root, suffix = self.workdir / "checkpoints", f"-{self.proc.pid}"
        while self.proc.poll() is None and not stopped(self.proc.pid):
            time.sleep(0.001)
        tmps = [n for n in os.listdir(root) if n.startswith(".tmp-step-") and n.endswith(suffix)]
        torn = len(tmps) == 1 and not (root / tmps[0][len(".tmp-"):-len(suffix)]).exists()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        return torn and (root / tmps[0]).is_dir()

    def wait(self, timeout: float = 120) -> int:
        rc = self.proc.wait(timeout)
        self._reader.join(10)
        return rc

    def tail(self) -> str:
        return "".join(self.stderr)[-3000:]


def _last_step(workdir: Path) -> int:
    try:
        lines = (workdir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return -1
    steps = [json.loads(line).get("step", -1) for line in lines[-3:] if line.endswith("}")]
    return max(steps, default=-1)


def _step_of(workdir: Path) -> int:
    return progress_of(workdir)["global_step"] if (workdir / "progress.json").exists() else 0


def progress_of(workdir: Path) -> dict:
    return json.loads((workdir / "progress.json").read_text())


# -- split by budget ----------------------------------------------------------------------------------
def test_budget_split_into_five_or_more_sessions_is_bit_identical(relay_cli, reference, tmp_path):
    """Five sessions stopped by their budget, then one that runs to the end. Each budget is sized for a share
    of the remaining steps from the in-clock start-up and the fastest step rate seen so far.
    torch._dynamo (imported by AdamW's first construction, 2-4 s here) is imported before `relay` runs so the
    in-clock start-up is small and steady; the entry point is still `-m relay`. No periodic or best saves:
    the clock's save reserve stays at its initial estimate (0.3 s for this model), so the steps a budget buys
    are predictable. Session and checkpoint settings do not change the training math: same reference.
    A machine much faster than the first estimate may finish the run in one session: the split then starts
    again with the rate it saw, so the outcome does not depend on the machine's speed."""
    spec = write_spec(tmp_path, toy_spec_dict(RESUME, session={"save_every": "1h"},
                                              checkpoints={"keep_best": False}))
    rate = reference[0]["sessions"][0]["samples_per_s"] / 16  # optimizer steps per second, a first estimate
    for attempt in range(4):
        workdir = tmp_path / f"w{attempt}"
        done_early = _split_by_budget(relay_cli, spec, workdir, rate)
        if done_early is None:
            break
        # The machine ran faster than estimated (the reference's rate was measured under another load) and a
        # session finished the run: start again, planning with the rate just seen.
        rate = max(rate, done_early)
    else:
        raise AssertionError("four attempts could not split the run into 5 budget-stopped sessions")
    relay_cli.train(spec, workdir, "none")
    progress = assert_same_as_reference(workdir, reference)
    stops = [s["stop_reason"] for s in progress["sessions"] if s["step_end"] > s["step_start"]]
    assert stops[-1] == "done" and stops.count("budget") >= 5, stops
    steps = [(s["step_start"], s["step_end"]) for s in progress["sessions"]]
    assert steps[0][0] == 0 and all(a[1] == b[0] for a, b in zip(steps, steps[1:])), steps  # no step lost or redone
    assert [s["index"] for s in progress["sessions"]] == list(range(1, len(steps) + 1))


def _split_by_budget(relay_cli, spec: Path, workdir: Path, rate: float) -> Optional[float]:
    """Five sessions stopped by their budget, each meant to take about a twentieth of the steps left. The part of
    a budget no step can use (start-up and the save reserve, both in the clock) is found by feedback: it grows
    after a session that had no time for a step and shrinks after one that took far more than its share, in
    steps of 20 ms (~10 toy steps here). Returns None, or the step rate seen if a session ran to the end."""
    base, step, budget_stops = 0.3, 0, 0
    for _ in range(40):
        if budget_stops == 5:
            return None
        share = (TOTAL - step) / (20 - budget_stops)
        budget = base + share / rate
        proc = relay_cli.train(spec, workdir, f"{budget:.3f}", preimport=["torch._dynamo"])
        progress = progress_of(workdir)
        s = progress["sessions"][-1]
        if progress["status"] == "done":
            return s["samples_per_s"] / 16
        assert s["stop_reason"] == "budget" and "paused at step" in proc.stdout, proc.stderr[-2000:]
        steps = s["step_end"] - s["step_start"]
        if steps == 0:
            base += 0.02  # a session that only saved
            continue
        budget_stops += 1
        step = s["step_end"]
        rate = max(rate, s["samples_per_s"] / 16)
        if steps > 2 * share:
            base = max(0.0, base - 0.02 * min(5, steps // share))
    raise AssertionError(f"40 sessions gave only {budget_stops} budget stops with steps")


# -- SIGTERM -----------------------------------------------------------------------------------------
def test_sigterm_at_random_instants_with_0_and_2_workers_is_bit_identical(spec_path, relay_cli, reference,
                                                                         tmp_path):
    """Three sessions stopped by SIGTERM at random instants, then one to the end. Sessions 1 and 3 load data
    with 2 DataLoader workers (a resume with workers still matches; data settings do not change the math)."""
    workers = write_spec(tmp_path, toy_spec_dict(RESUME, data={"num_workers": 2}), "workers.yaml")
    rng = random.Random(20261121)
    workdir, reasons = tmp_path / "w", []
    for i in range(3):
        session = Session(relay_cli, workers if i % 2 == 0 else spec_path, workdir)
        at = _step_of(workdir) + 4 * rng.randint(1, 6)  # <= 3 x 24 steps + a few ms of 160
        session.wait_training()
        session.kill_at_step(at, rng.uniform(0.0, 0.003), signal.SIGTERM)
        rc = session.wait()
        assert rc == 0, f"SIGTERM must end the session cleanly (exit 0), got {rc}\n{session.tail()}"
        progress = progress_of(workdir)
        assert progress["status"] == "paused", "the session finished before its SIGTERM"
        reasons.append(progress["sessions"][-1]["stop_reason"])
    assert reasons == ["sigterm"] * 3
    relay_cli.train(spec_path, workdir, "none")
    progress = assert_same_as_reference(workdir, reference)
    assert [s["stop_reason"] for s in progress["sessions"]] == ["sigterm"] * 3 + ["done"]


# -- SIGKILL -----------------------------------------------------------------------------------------
def test_sigkill_at_random_instants_and_mid_save_is_bit_identical(spec_path, relay_cli, reference, tmp_path):
    """Four sessions SIGKILLed: two inside a save (a save after every step, and the process stops itself
    inside the save of a random step through the RELAY_TEST_STOP_MID_SAVE seam), two at a random instant
    after a random step (a step, an eval, a save, the progress.json write); then one session to the end."""
    rng = random.Random(1121)
    every_step = write_spec(tmp_path, toy_spec_dict(RESUME, session={"save_every": 0.001}), "every-step.yaml")
    workdir, mid_save = tmp_path / "w", 0
    for i in range(4):
        at = _step_of(workdir) + 4 * rng.randint(1, 6)
        if i % 2 == 1:
            session = Session(relay_cli, every_step, workdir, env={"RELAY_TEST_STOP_MID_SAVE": str(at)})
            mid_save += session.kill_in_save()
        else:
            session = Session(relay_cli, spec_path, workdir)
            session.wait_training()
            session.kill_at_step(at, rng.uniform(0.0, 0.003), signal.SIGKILL)
        rc = session.wait()
        assert rc == -signal.SIGKILL, f"the session ended before its SIGKILL (exit {rc})\n{session.tail()}"
    assert mid_save == 2, "a kill did not land inside a save"
    relay_cli.train(spec_path, workdir, "none")
    progress = assert_same_as_reference(workdir, reference)
    assert progress["sessions"][-1]["stop_reason"] == "done"


# -- the data position is derived, not replayed ------------------------------------------------------
def naive_replay(n: int, eff: int, seed: int, steps: int) -> list[list[int]]:
    """Epoch by epoch, batch by batch, as a plain loader would walk through the data from step 0."""
    out, epoch = [], 0
    while len(out) < steps:
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()
        out += [perm[b * eff:(b + 1) * eff] for b in range(n // eff)]
        epoch += 1
    return out[:steps]


@pytest.mark.parametrize("n,eff,seed", [(50, 8, 0), (64, 16, 3), (37, 5, 11)])
def test_step_schedule_matches_naive_replay(n, eff, seed):
    schedule = data.StepSchedule(n, eff, seed)
    replay = naive_replay(n, eff, seed, 5 * schedule.steps_per_epoch + 3)
    assert [schedule.indices(s).tolist() for s in range(len(replay))] == replay
    for e in range(5):  # an epoch visits distinct samples
        epoch = sum(replay[e * schedule.steps_per_epoch:(e + 1) * schedule.steps_per_epoch], [])
        assert len(set(epoch)) == len(epoch) == schedule.steps_per_epoch * eff
    # A sampler started at step k yields exactly the tail of the replay, in micro-batches.
    for micro in (1, eff):
        if eff % micro == 0:
            k = schedule.steps_per_epoch + 1
            got = list(data.MicroBatchSampler(schedule, k, len(replay), micro))
            want = [b[i:i + micro] for b in replay[k:] for i in range(0, eff, micro)]
            assert got == want


def test_step_schedule_skip_is_o1(monkeypatch):
    """indices(10**7) builds one permutation (that step's epoch), not the 10**7 batches before it."""
    schedule = data.StepSchedule(1000, 10, 5)
    calls = []
    real = torch.randperm
    monkeypatch.setattr(torch, "randperm", lambda *a, **k: calls.append(a) or real(*a, **k))
    step = 10**7 + 37
    got = schedule.indices(step).tolist()
    assert len(calls) == 1
    monkeypatch.setattr(torch, "randperm", real)
    epoch, pos = divmod(step, schedule.steps_per_epoch)
    perm = torch.randperm(1000, generator=torch.Generator().manual_seed(5 * 1_000_003 + epoch)).tolist()
    assert got == perm[pos * 10:(pos + 1) * 10]
    sampler = data.MicroBatchSampler(schedule, step, step + 2, 5)
    assert next(iter(sampler)) == got[:5]


def test_a_steps_indices_are_an_array_the_caller_may_change():
    """batches() gives int64 arrays (a tensor indexed by one costs what a tensor slice does; by a list, ~30 us more
    at 512 samples): each a copy, so a script that sorts or edits its indices in place cannot reorder the cached
    epoch behind later steps."""
    schedule = data.StepSchedule(64, 8, 0)
    first = schedule.indices(3)
    assert first.dtype == np.int64 and first.flags.writeable
    want = first.tolist()
    first.sort()
    first[:] = 0
    assert schedule.indices(3).tolist() == want
    assert schedule.indices(4).tolist() == data.epoch_order(64, 0, 0)[32:40].tolist()


def test_a_checkpoint_written_in_the_built_in_runners_old_layout_resumes_to_the_same_weights(tmp_path):
    """tests/data/old-layout-toy holds a session of 10 steps written by the relay before both session paths saved
    one layout ({model, optimizer, scheduler, scaler, trainer, rng}) and before the divergence guard's history was
    saved. Its float values are those of the CPU that wrote it (another CPU's kernels round differently), so the
    bits compared here are written on this machine: this machine's step-10 state, put in the old layout beside the
    fixture's progress and manifest, resumes to the weights of this machine's uninterrupted run. The fixture
    itself must still read and run to the end."""
    import shutil

    from relay.kernel.run import run_session
    from relay.shared import spec as spec_mod
    from relay.shared.manifest import file_digest

    old = Path(__file__).parents[1] / "data" / "old-layout-toy"
    old_ckpt = Path("checkpoints") / "step-00000010"
    saved = torch.load(old / "workdir" / old_ckpt / "state.pt", weights_only=True)
    assert "trainer" in saved and "objects" not in saved and "divergence" not in saved["trainer"]
    spec = spec_mod.load(old / "spec.yaml")
    whole = run_session(spec.model_copy(update={"session": spec.session.model_copy(update={"max_steps": None})}),
                        tmp_path / "whole")

    # This machine's first session, saved in today's layout, rewritten in the old one.
    run_session(spec, tmp_path / "here")
    _, state = checkpoint.load_latest(tmp_path / "here" / "checkpoints")
    books = {key: value for key, value in state["relay"].items() if key in saved["trainer"]}
    old_state = {**state["objects"], "trainer": books, "rng": state["rng"]}
    assert set(old_state) == set(saved) and set(books) == set(saved["trainer"])
    shutil.copytree(old / "workdir", tmp_path / "resumed")
    torch.save(old_state, tmp_path / "resumed" / old_ckpt / "state.pt")
    manifest_path = tmp_path / "resumed" / old_ckpt / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    state_file = tmp_path / "resumed" / old_ckpt / "state.pt"
    manifest["files"]["state.pt"] = {"bytes": state_file.stat().st_size, "crc32": file_digest(state_file, "crc32")}
    manifest_path.write_text(json.dumps(manifest))

    shutil.copytree(old / "workdir", tmp_path / "fixture")
    for workdir in ("resumed", "fixture"):
        while (progress := run_session(spec, tmp_path / workdir))["status"] != "done":
            pass
        assert progress["sessions"][0]["step_end"] == 10 and len(progress["sessions"]) == 3
        state = checkpoint.load_latest(tmp_path / workdir / "checkpoints")[1]
        assert set(state) >= {"objects", "relay", "rng"} and "trainer" not in state  # saved in the one layout now
        if workdir == "resumed":  # the fixture's own bits are another CPU's: compared with nothing here
            assert progress["weights_sha256"] == whole["weights_sha256"]
