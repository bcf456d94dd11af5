"""Data-parallel sessions (both GPUs of a Kaggle T4 x2), proved on CPU with gloo and 2 processes: a run split
into sessions by step caps, a SIGKILL in the middle of a save and a SIGTERM sent to rank 1 alone ends
bit-identical to an uninterrupted 2-process run; a 2 -> 1 change of world size resumes with the same effective
batch and says from which step exactness is lost; and the relay on the emulator completes with 2-process
sessions. Every stop is triggered by an event (a save folder appearing, a logged step), never by a sleep."""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import psutil
import pytest
import torch

from conftest import toy_spec_dict, write_spec
from relay.kernel.session import checkpoint
from relay.kernel.session.distributed import split_batch
from relay_fixtures import wait_for

# 256 samples / 16 = 16 steps per epoch; 64 steps; eval every 16 (the first is a best save); periodic saves
# every 0.2 s
DDP = dict(name="ddp-toy", seed=5, params={"n_train": 256, "n_eval": 64, "hidden": 512, "dropout": 0.2},
           optim={"epochs": None, "max_steps": 64, "eval_every_steps": 16, "log_every_steps": 1},
           session={"devices": 2, "save_every": 0.2}, checkpoints={"keep_last": 2})
TOTAL = 64


from process_fixtures import ranks  # noqa: E402


def load_final(workdir: Path) -> tuple[dict, dict]:
    progress = json.loads((workdir / "progress.json").read_text())
    return progress, torch.load(workdir / progress["checkpoint"] / checkpoint.STATE_FILE, weights_only=True)


@pytest.fixture(scope="module")
def spec_path(tmp_path_factory) -> Path:
    return write_spec(tmp_path_factory.mktemp("ddp-spec"), toy_spec_dict(DDP))


@pytest.fixture(scope="module")
def ddp_reference(spec_path, relay_cli, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("ddp-reference")
    relay_cli.train(spec_path, workdir, "none", "--max-steps", "none")
    progress, state = load_final(workdir)
    assert progress["status"] == "done" and progress["world_size"] == 2 and len(progress["sessions"]) == 1
    assert len(state["rng_ranks"]) == 2 and not torch.equal(state["rng_ranks"][0]["torch"],
                                                           state["rng_ranks"][1]["torch"])
    return progress, state


def _stopped_rank(proc) -> bool:
    """Whether a rank of `proc` is stopped by a signal (state T)."""
    for p in ranks(proc):
        try:
            if p.status() == psutil.STATUS_STOPPED:
                return True
        except psutil.Error:
            continue
    return False


def metrics_steps(workdir: Path, session: int) -> int:
    """The last step session `session` logged (metrics.jsonl also holds the steps of killed sessions, which a
    resumed run trains again)."""
    try:
        lines = (workdir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    records = [json.loads(l) for l in lines if l.strip().endswith("}")]
    return max((r.get("step", 0) for r in records if r.get("session") == session), default=0)


def test_split_by_steps_sigkill_mid_save_and_sigterm_to_rank_1_is_bit_identical(spec_path, relay_cli,
                                                                                  ddp_reference, tmp_path):
    workdir, ckpts = tmp_path / "w", tmp_path / "w" / "checkpoints"

    # session 1: rank 0 saves at step 16 (the first eval is a best save), then stops itself inside its next save
    # (the RELAY_TEST_STOP_MID_SAVE seam of relay.kernel.session.checkpoint); every process is then SIGKILLed
    proc = relay_cli.popen(*relay_cli.train_args(spec_path, workdir, "none"), start_new_session=True,
                           env={**relay_cli.env, "RELAY_TEST_STOP_MID_SAVE": "17"},
                           stdout=open(tmp_path / "s1.log", "w"), stderr=open(tmp_path / "s1.err", "w"))
    stopped = wait_for(lambda: proc.poll() is not None or _stopped_rank(proc), 300, "rank 0 stopped in a save")
    assert proc.poll() is None, (tmp_path / "s1.err").read_text()[-2000:]
    tmps = [n for n in os.listdir(ckpts) if n.startswith(".tmp-")]
    assert tmps and stopped, os.listdir(ckpts)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert all((ckpts / t).exists() for t in tmps)  # the save was torn
    killed_at = max(c.step for c in checkpoint.list_valid(ckpts))
    assert 16 <= killed_at < TOTAL

    # session 2: ends after 12 steps (session.max_steps, any machine speed)
    relay_cli.train(spec_path, workdir, "none", "--max-steps", "12")
    progress = json.loads((workdir / "progress.json").read_text())
    assert progress["global_step"] == killed_at + 12 and progress["sessions"][-1]["stop_reason"] == "steps"

    # session 3: SIGTERM to rank 1 only, once training is under way: both ranks stop at the same step
    proc = relay_cli.popen(*relay_cli.train_args(spec_path, workdir, "none"), start_new_session=True,
                           stdout=open(tmp_path / "s3.log", "w"), stderr=open(tmp_path / "s3.err", "w"))
    start = progress["global_step"]
    session = len(progress["sessions"]) + 1
    wait_for(lambda: (metrics_steps(workdir, session) >= start + 2 and len(ranks(proc)) == 2) or proc.poll() is not None,
             300, "session 3 training")
    assert proc.poll() is None, (tmp_path / "s3.err").read_text()[-2000:]
    ranks(proc)[1].send_signal(signal.SIGTERM)
    assert proc.wait(120) == 0, (tmp_path / "s3.err").read_text()[-3000:]
    progress = json.loads((workdir / "progress.json").read_text())
    assert progress["sessions"][-1]["stop_reason"] == "sigterm" and progress["global_step"] < TOTAL

    # session 4: to the end
    relay_cli.train(spec_path, workdir, "none", "--max-steps", "none")
    progress, state = load_final(workdir)
    ref_progress, ref_state = ddp_reference
    assert progress["status"] == "done" and len(progress["sessions"]) == 4
    assert progress["weights_sha256"] == ref_progress["weights_sha256"]
    for part in ("model", "optimizer", "scheduler"):
        for key, value in _flat(ref_state["objects"][part]).items():
            assert torch.equal(_flat(state["objects"][part])[key], value) if torch.is_tensor(value) else True, \
                f"{part}.{key}"
    assert all(torch.equal(a["torch"], b["torch"]) for a, b in zip(state["rng_ranks"], ref_state["rng_ranks"]))
    assert progress["exactness_lost"] is None and progress["world_size"] == 2


def test_world_size_2_to_1_keeps_the_effective_batch_and_says_exactness_is_lost(relay_cli, tmp_path):
    two = write_spec(tmp_path, toy_spec_dict(DDP, session={"save_every": "1h"}), "two.yaml")
    one = write_spec(tmp_path, toy_spec_dict(DDP, session={"devices": 1, "save_every": "1h"}), "one.yaml")
    workdir = tmp_path / "w"
    relay_cli.train(two, workdir, "none", "--max-steps", "20")
    first = json.loads((workdir / "progress.json").read_text())
    assert (first["micro_batch"], first["grad_accum"], first["world_size"]) == (8, 1, 2)  # 8 x 1 x 2 = 16
    relay_cli.train(one, workdir, "none", "--max-steps", "none")
    progress = json.loads((workdir / "progress.json").read_text())
    assert progress["status"] == "done" and progress["global_step"] == TOTAL
    assert (progress["micro_batch"], progress["grad_accum"], progress["world_size"]) == (8, 2, 1)  # 8 x 2 x 1
    assert progress["exactness_lost"] == {"step": 20, "why": "world size changed from 2 to 1 processes"}
    assert [s["world_size"] for s in progress["sessions"]] == [2, 1]


def test_split_batch_keeps_the_effective_batch():
    assert split_batch(16, 2, 8) == (8, 1)
    assert split_batch(16, 1, 8) == (8, 2)
    assert split_batch(8, 2, 8) == (4, 1)   # the micro-batch shrinks when one rank's share is smaller
    assert split_batch(36, 2, 8) == (6, 3)  # the largest micro-batch <= 8 that divides a rank's 18
    from relay.shared.errors import InputError

    with pytest.raises(InputError, match="divisible by the number of processes"):
        split_batch(9, 2, 3)


def test_relay_on_the_emulator_with_two_process_sessions(relay_env, reference, monkeypatch):
    relay_env.start()
    # two sessions: one hand-over of a two-process session is the property; each session is 3 processes
    spec = relay_env.write_spec(**{"name": "toy-ddp-relay", "optim.max_steps": 40, "session.max_steps": 20,
                                   "session.devices": 2})
    reference.start(spec)
    done = relay_env.run_flow(monkeypatch, mode="watch")
    assert done["state"] == "done" and done["sessions"] == 2, done
    progress = relay_env.published_progress()
    assert [s["world_size"] for s in progress["sessions"]] == [2, 2]
    assert done["weights_sha256"] == reference.weights(spec)


def _flat(tree, prefix="") -> dict:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    if isinstance(tree, (list, tuple)):
        out = {}
        for i, v in enumerate(tree):
            out.update(_flat(v, f"{prefix}{i}."))
        return out
    return {prefix.rstrip("."): tree}


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_an_oom_on_one_rank_backs_off_every_rank_together(start, tmp_path, monkeypatch, spawns_processes):
    """Rank 1 alone runs out of memory mid-run: both ranks halve the micro-batch at the same step (no rank is
    left waiting in a collective), the effective batch is kept, and the run finishes. Both ways ranks start: forked
    from the launcher (CPU, every other test here) and from a forkserver (what a GPU session uses), each launched
    from this process, whose Prefect and threads a forked rank inherits."""
    import ddp_oom_worker
    from conftest import load_toy_spec
    from relay.kernel.session import distributed

    from relay.kernel import recipes
    from relay.shared import params

    monkeypatch.setitem(recipes._REGISTRY, ddp_oom_worker.NAME, ddp_oom_worker.PATH)
    monkeypatch.setitem(params.BUILT_IN, ddp_oom_worker.NAME, ddp_oom_worker.OomOnRank1.Params)
    spec = load_toy_spec(DDP, recipe=ddp_oom_worker.NAME, session={"save_every": "1h"})
    monkeypatch.setattr(distributed, "start_method", lambda: start)
    distributed.launch(ddp_oom_worker.worker, 2, (spec, str(tmp_path / "w")))
    progress = json.loads((tmp_path / "w" / "progress.json").read_text())
    assert progress["status"] == "done" and progress["global_step"] == TOTAL
    assert (progress["micro_batch"], progress["grad_accum"], progress["world_size"]) == (4, 2, 2)  # rank 0 too
    records = [json.loads(l) for l in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
    micro = [(r["step"], r["micro_batch"]) for r in records if r.get("kind") == "train"]
    assert micro[0][1] == 8 and micro[-1][1] == 4


def test_a_refused_input_in_a_two_process_session_is_one_line_and_writes_nothing(relay_cli, tmp_path):
    spec = write_spec(tmp_path, toy_spec_dict(DDP, params={"n_train": 16}, optim={"grad_accum": 4}))
    proc = relay_cli.train(spec, tmp_path / "w", "none", check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == ("relay: error: optim.micro_batch x optim.grad_accum (32) is"
                                                    " larger than the training set (16 samples)")
    assert "Traceback" not in proc.stderr and not (tmp_path / "w").exists()
