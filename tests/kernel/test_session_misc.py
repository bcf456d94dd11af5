"""The rest of the session runtime: the deadline clock, SIGTERM handling, progress.json / metrics.jsonl,
resuming from a mounted checkpoint, reading only unconsumed data, memory monitor, user errors."""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import stat
import time

import pytest
import torch

from conftest import load_toy_spec, toy_spec_dict, write_spec
from relay.cli import main as relay_main
from relay.kernel.recipes.toy import ToyRecipe
from relay.kernel.run import run_session
from relay.kernel.session import checkpoint, data, memory
from relay.kernel.session.budget import SAVE_SAFETY_FACTOR, SessionClock
from relay.shared.errors import InputError
from relay.shared.session_plan import SessionPlan


# -- the clock --------------------------------------------------------------------------------------
def aged(clock: SessionClock, seconds: float) -> SessionClock:
    clock._t0 -= seconds  # as if `seconds` had passed since the session started
    return clock


def test_clock_stops_when_next_step_plus_save_would_pass_the_deadline():
    clock = aged(SessionClock(budget=100, safety_margin=10), 80)
    clock.record_step(2.0)
    clock.record_save(4.0)
    assert clock.time_needed() == pytest.approx(2.0 + SAVE_SAFETY_FACTOR * 4.0 + 10)
    assert clock.should_stop() is None  # 20 s left, 18 needed
    clock.record_step(1.0)
    clock.record_step(3.0)  # the slowest recent step counts
    assert clock.step_estimate() == 3.0 and clock.should_stop() is None  # 19 needed
    aged(clock, 1.5)
    assert clock.should_stop() == "budget"


def test_clock_reserves_eval_time_when_an_eval_is_due():
    clock = aged(SessionClock(budget=100, safety_margin=0), 90)
    clock.record_save(1.0)
    clock.eval_seconds = 9.0
    assert clock.should_stop(eval_due=False) is None
    assert clock.should_stop(eval_due=True) == "budget"


def test_clock_earlier_of_budget_and_deadline_wins():
    now = time.time()
    assert SessionClock(budget=100, deadline=now + 50, now=now).limit == pytest.approx(50)
    assert SessionClock(budget=30, deadline=now + 50, now=now).limit == pytest.approx(30)
    assert SessionClock(deadline=now + 70, now=now).limit == pytest.approx(70)
    unlimited = aged(SessionClock(), 10**6)
    unlimited.record_step(10.0)
    assert unlimited.should_stop() is None


def test_clock_before_any_save_uses_the_estimate():
    clock = aged(SessionClock(budget=10, safety_margin=0), 4)
    clock.estimated_save_seconds = 4.0
    assert clock.should_stop() == "budget"  # 6 s left < 1.5 x 4 s
    clock.record_save(1.0)
    assert clock.should_stop() is None


def test_sigterm_sets_the_stop_flag_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    clock = SessionClock()
    clock.install_signal_handlers()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while clock.stop_signal is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert clock.stop_signal == "SIGTERM" and clock.should_stop() == "sigterm"
    finally:
        clock.restore_signal_handlers()
    assert signal.getsignal(signal.SIGTERM) == before


# -- a recipe that counts what it reads and can stop its own session --------------------------------
class Counter:
    def reset(self):
        self.train_reads = 0
        self.loss_calls = 0
        self.sigterm_at_call = None


COUNT = Counter()
COUNT.reset()


class _Counting(torch.utils.data.Dataset):
    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        COUNT.train_reads += 1
        return self.ds[i]


class CountingRecipe(ToyRecipe):
    name = "counting-toy"

    def prepare(self):
        super().prepare()
        self._train = _Counting(self._train)

    def loss(self, model, batch):
        if COUNT.sigterm_at_call is not None and COUNT.loss_calls == COUNT.sigterm_at_call:
            os.kill(os.getpid(), signal.SIGTERM)
        COUNT.loss_calls += 1
        return super().loss(model, batch)


@pytest.fixture
def counting(register_recipe):
    register_recipe(CountingRecipe.name, CountingRecipe)
    COUNT.reset()
    yield COUNT
    COUNT.reset()


def counting_spec(**overrides):
    return load_toy_spec(toy_spec_dict(recipe=CountingRecipe.name, optim={"epochs": 3}), **overrides)


def test_resume_reads_only_unconsumed_samples(counting, tmp_path):
    """256 samples / 16 per step = 16 steps per epoch, 48 steps. Stop after step 20 (mid-epoch 2)."""
    counting.sigterm_at_call = 39  # call 0 is the pre-flight: this is in step 19, the session stops at step 20
    first = run_session(counting_spec(), tmp_path)
    assert (first["status"], first["global_step"]) == ("paused", 20)
    preflight = 8  # the pre-flight reads one micro-batch: the first of the step training starts at
    assert counting.train_reads == preflight + 20 * 16
    counting.reset()
    second = run_session(counting_spec(), tmp_path)
    assert (second["status"], second["global_step"]) == ("done", 48)
    assert counting.train_reads == preflight + (48 - 20) * 16  # nothing consumed before step 20 is read again


def test_progress_and_metrics_files(counting, tmp_path):
    counting.sigterm_at_call = 20  # in step 9: the first session stops at step 10
    run_session(counting_spec(), tmp_path, SessionPlan(run_id="run-42"))
    counting.reset()
    progress = run_session(counting_spec(), tmp_path)
    on_disk = json.loads((tmp_path / "progress.json").read_text())
    assert on_disk == json.loads(json.dumps(progress))
    assert {"status", "global_step", "total_steps", "epoch", "run_id", "code_version", "metrics", "best",
            "weights_sha256", "checkpoint", "stop_reason", "sessions"} <= set(progress)
    assert (progress["status"], progress["stop_reason"], progress["global_step"], progress["total_steps"],
            progress["epoch"]) == ("done", "done", 48, 48, 2)
    assert progress["run_id"] == "run-42"  # carried from the first session
    assert set(progress["metrics"]) >= {"step", "loss", "mse"} and progress["metrics"]["step"] == 48
    assert progress["best"]["metric"] == "mse" and progress["best"]["step"] in (16, 32, 48)
    s1, s2 = progress["sessions"]
    assert (s1["index"], s1["stop_reason"], s1["step_start"], s1["step_end"]) == (1, "sigterm", 0, 10)
    assert (s2["index"], s2["stop_reason"], s2["step_start"], s2["step_end"]) == (2, "done", 10, 48)
    for s in (s1, s2):
        assert {"run_id", "started", "ended", "seconds", "samples_per_s", "peak_mem_mb", "loss_end"} <= set(s)
    assert s2["save_seconds"] >= 0  # (an earlier session's entry is stored in its checkpoint before its save ends)
    final = torch.load(tmp_path / progress["checkpoint"] / "state.pt", weights_only=True)
    assert checkpoint.weights_sha256(final["objects"]["model"]) == progress["weights_sha256"]
    manifest = json.loads((tmp_path / progress["checkpoint"] / "manifest.json").read_text())
    assert manifest["run_id"] == "run-42" and manifest["step"] == 48
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [16, 32, 48]
    assert {r["session"] for r in train} == {1, 2}
    assert all({"loss", "lr", "samples_per_s", "micro_batch", "grad_accum", "time"} <= set(r) for r in train)
    assert (tmp_path / "export" / "model.safetensors").is_file()


def test_resume_from_a_read_only_mounted_checkpoint(counting, tmp_path):
    counting.sigterm_at_call = 13
    first = run_session(counting_spec(), tmp_path / "kaggle-1")
    mounted = tmp_path / "input" / "ckpt"
    shutil.copytree(tmp_path / "kaggle-1" / first["checkpoint"], mounted)  # a single checkpoint folder
    for p in [mounted, *mounted.iterdir()]:
        p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        counting.reset()
        second = run_session(counting_spec(), tmp_path / "kaggle-2", SessionPlan(resume_from=(str(mounted),)))
    finally:
        for p in [mounted, *mounted.iterdir()]:
            p.chmod(p.stat().st_mode | stat.S_IWUSR)
    assert second["sessions"][-1]["step_start"] == first["global_step"] == 7
    assert second["status"] == "done"
    # And it equals the run that stayed in one workdir.
    counting.reset()
    counting.sigterm_at_call = 13
    run_session(counting_spec(), tmp_path / "same")
    counting.reset()
    same = run_session(counting_spec(), tmp_path / "same")
    assert same["weights_sha256"] == second["weights_sha256"]


def test_session_on_a_finished_run_changes_nothing(counting, tmp_path):
    done = run_session(counting_spec(), tmp_path)
    counting.reset()
    again = run_session(counting_spec(), tmp_path)
    assert counting.loss_calls == 0
    assert (again["status"], again["global_step"], again["weights_sha256"]) == ("done", 48, done["weights_sha256"])


def test_batch_larger_than_the_data_is_a_user_error(tmp_path, capsys):
    spec = write_spec(tmp_path, toy_spec_dict(params={"n_train": 16}, optim={"micro_batch": 16, "grad_accum": 2}))
    assert relay_main(["train", str(spec), "--workdir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert err == ("relay: error: optim.micro_batch x optim.grad_accum (32) is larger than the training set"
                   " (16 samples)\n")
    with pytest.raises(InputError):
        data.StepSchedule(16, 32, 0)


# -- memory ----------------------------------------------------------------------------------------
def test_memory_monitor_samples_and_warns_once_past_80_percent(monkeypatch, caplog):
    monitor = memory.MemoryMonitor(torch.device("cpu"))
    sample = monitor.sample()
    assert sample["rss_mb"] > 0 and 0 <= sample["ram_pct"] <= 100 and monitor.peak_mb() >= sample["rss_mb"] - 0.1

    class VM:
        percent = 91.0

    monkeypatch.setattr(memory.psutil, "virtual_memory", lambda: VM)
    with caplog.at_level(logging.WARNING):
        monitor.sample()
        monitor.sample()
    assert caplog.text.count("memory: ram_pct at 91% (over 80%)") == 1


@pytest.mark.parametrize("micro,accum,expected", [(8, 2, (4, 4)), (6, 1, (3, 2)), (9, 1, (3, 3)), (7, 2, (1, 14)),
                                                  (1, 4, None)])
def test_back_off_keeps_the_effective_batch(micro, accum, expected):
    got = memory.back_off(micro, accum)
    assert got == expected
    if got:
        assert got[0] * got[1] == micro * accum and got[0] < micro


def test_a_recipe_with_the_older_predict_signature_still_gets_called():
    from relay.kernel.run import _predict

    calls = []

    class Old:
        def predict(self, model, out_dir):
            calls.append((model, out_dir))

    class New:
        def predict(self, model, out_dir, *, batch_size=None, autocast=None):
            calls.append(batch_size)

    _predict(Old(), "m", "out", batch_size=4, autocast=None)
    _predict(New(), "m", "out", batch_size=4, autocast=None)
    assert calls == [("m", "out"), 4]
