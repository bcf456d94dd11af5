"""Hugging Face Accelerate through `relay.accelerate.RelayAccelerate`: Accelerate's own save_state carried in the
relay checkpoint and restored with load_state, a session step counted per optimizer step under
`accelerator.accumulate`, the train loader's position derived from the step, and the example
(examples/byo-accelerate, Accelerate's nlp_example offline) bit-identical under `relay verify-resume`.

The in-process tests run real Accelerators, optimizers and schedulers (tiny models, a dozen steps); sessions end
on their step cap, never on time.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

TOTAL, ACCUM, BATCH = 12, 2, 8  # 12 optimizer steps of 8 samples, each 2 micro-batches of 4


class Counter:
    """An object given to accelerator.register_for_checkpointing: its state must come back too."""

    def __init__(self):
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


CUDA = torch.cuda.is_available()


def _fresh_accelerator(**kwargs):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # one Accelerator per "session", as in a new process
    GradientState._reset_state()
    return Accelerator(cpu=not CUDA, gradient_accumulation_steps=ACCUM, **kwargs)


def _session(workdir: Path, max_steps=None, step_done: bool = True, mixed_precision: str = "no") -> dict:
    """One session of a small accumulate() loop; what it ends with."""
    import relay
    from relay.accelerate import RelayAccelerate

    session = relay.open_session(total_steps=TOTAL, workdir=str(workdir), max_steps=max_steps, save_every=3600)
    try:
        accelerator = _fresh_accelerator(mixed_precision=mixed_precision)
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
        model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / TOTAL)
        counter = Counter()
        model, opt, sched = accelerator.prepare(model, opt, sched)
        accelerator.register_for_checkpointing(counter)
        relay_acc = RelayAccelerate(accelerator, session)
        loader = relay_acc.train_dataloader(data, batch_size=BATCH)
        start = relay_acc.restore()
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            if step_done:
                counter.n += relay_acc.step_done(loss)
        progress = session.close()
    finally:
        session.clock.restore_signal_handlers()
    return {"start": start, "progress": progress, "counter": counter.n, "accelerator_step": accelerator.step,
            "scaler": accelerator.scaler.state_dict() if accelerator.scaler is not None else None,
            "model": {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()},
            "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}


@pytest.mark.parametrize("mixed_precision", ["no", pytest.param("fp16", marks=pytest.mark.skipif(
    not CUDA, reason="Accelerate makes a GradScaler for fp16 on a GPU only"))])
def test_accelerate_state_travels_in_the_relay_checkpoint_and_a_split_run_ends_as_one(mixed_precision, tmp_path):
    from relay.kernel.session import checkpoint

    straight = _session(tmp_path / "straight", mixed_precision=mixed_precision)
    first = _session(tmp_path / "split", max_steps=5, mixed_precision=mixed_precision)
    assert first["progress"]["status"] == "paused" and first["progress"]["global_step"] == 5
    assert first["accelerator_step"] == 5 * ACCUM  # accumulate() counts micro-batches: the session counted steps
    packed = checkpoint.load_latest(tmp_path / "split" / "checkpoints")[1]["objects"]["accelerate"]
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "custom_checkpoint_0.pkl",
            "random_states_0.pkl"} <= set(packed), sorted(packed)  # Accelerate's own save_state files
    assert ("scaler.pt" in packed) == (mixed_precision == "fp16")  # accelerator.scaler, when there is one
    second = _session(tmp_path / "split", mixed_precision=mixed_precision)
    assert second["start"] == 5 and second["progress"]["status"] == "done"
    assert second["accelerator_step"] == straight["accelerator_step"] == TOTAL * ACCUM  # restored as it was saved
    assert second["counter"] == straight["counter"] == TOTAL  # register_for_checkpointing's object came back
    assert second["scheduler"] == straight["scheduler"] and second["scaler"] == straight["scaler"]
    for name, value in straight["model"].items():
        assert torch.equal(value, second["model"][name]), name
    for a, b in zip(straight["optimizer"]["state"].values(), second["optimizer"]["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert not (tmp_path / "split" / "accelerate-resume" / "rank-0").exists()  # loaded, not left on the disk budget


def test_a_loop_that_never_calls_step_done_fails_in_one_line(tmp_path):
    from relay.shared.errors import InputError

    with pytest.raises(InputError) as err:
        _session(tmp_path / "w", step_done=False)
    assert str(err.value).startswith("RelayAccelerate: 2 micro-batches trained but the session counted 0 steps")
    assert "\n" not in str(err.value)


def test_an_effective_batch_the_accumulation_does_not_divide_names_batch_size(tmp_path):
    import relay
    from relay.accelerate import RelayAccelerate
    from relay.shared.errors import InputError

    session = relay.open_session(total_steps=TOTAL, workdir=str(tmp_path / "w"))
    try:
        relay_acc = RelayAccelerate(_fresh_accelerator(), session)
        with pytest.raises(InputError, match=r"^RelayAccelerate.train_dataloader\(batch_size=9\): the effective batch"):
            relay_acc.train_dataloader(torch.utils.data.TensorDataset(torch.zeros(64, 1)), batch_size=9)
    finally:
        session.clock.restore_signal_handlers()


def test_the_accelerate_example_resumes_bit_identically(relay_cli, tmp_path):
    """Accelerate's nlp_example shape (tiny BERT, accumulation 2, an eval at each epoch's end) with a kill mid-save."""
    from byo_fixtures import copy_example
    from kaggle_fixtures import HF_MODULES, verify_warm

    spec = copy_example("byo-accelerate", tmp_path / "ex")
    out = relay_cli.run("verify-resume", str(spec), "--steps", "24", "--workdir", str(tmp_path / "v"), timeout=600,
                        env=verify_warm(*HF_MODULES))
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert out.stdout.startswith("identical") and "(killed mid-save)" in out.stdout, out.stdout


def test_two_gloo_processes_split_into_sessions_end_as_one_run(relay_cli, tmp_path):
    """`session.devices: 2`: the relay starts both ranks; rank 0 packs Accelerate's state, every rank restores it
    and its own RNG. Two step-capped sessions end with the checkpoint of one uninterrupted 2-process run."""
    from byo_fixtures import copy_example
    from relay.kernel.session import checkpoint
    from relay.kernel.verify import compare

    spec = copy_example("byo-accelerate", tmp_path / "ex", **{"session.devices": 2, "optim.max_steps": 24,
                                                               "session.max_steps": 12})
    split, straight = tmp_path / "split", tmp_path / "straight"
    relay_cli.train(spec, split, None, timeout=300)
    relay_cli.train(spec, split, None, timeout=300)
    relay_cli.train(spec, straight, None, "--max-steps", "none", timeout=300)
    a = checkpoint.load_latest(split / "checkpoints")[1]
    b = checkpoint.load_latest(straight / "checkpoints")[1]
    assert a["relay"]["global_step"] == b["relay"]["global_step"] == 24 and len(a["relay"]["sessions"]) == 2
    assert len(a["rng_ranks"]) == 2  # each rank's RNG, restored per rank
    assert list(compare(a, b)) == []
