"""verify-resume's `why:` from what happened (issue 58): each step's batch recorded as it is drawn after restore(),
through session.batch_sampler as through session.batches, so a difference in state is named (object and field)
and never blamed on a data order that was the same.

Sessions are bounded by step counts (`--cut-at`), never by time.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

# A DataLoader over session.batch_sampler (the way in of the loops that own their loader). The script writes
# where it resumed into the optimizer's param group after restore(): the one difference between the runs, a
# field that shapes no update (the model, the RNG and every batch stay the same).
SAMPLER_LOOP = '''
import torch, relay
from torch.utils.data import DataLoader, TensorDataset
session = relay.open_session()
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(60, 4, generator=g), torch.randn(60, 1, generator=g))
model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
session.register(model=model, optimizer=opt)
loader = DataLoader(data, batch_sampler=session.batch_sampler(len(data), 8),
                    generator=torch.Generator().manual_seed(0))
start = session.restore()
MARK
for x, y in loader:
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    session.step_done(loss=loss.detach())
    if session.should_stop():
        break
session.close()
'''


def _spec(folder: Path, script: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.py").write_text(script)
    spec = folder / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "why", "code": {"folder": ".", "entry": "train.py"}, "seed": 0,
        "optim": {"max_steps": 24, "log_every_steps": 4},
        "session": {"threads": 1, "save_every": "0.001s"}}, sort_keys=False))
    return spec


def test_an_optimizer_field_set_after_restore_is_named_not_the_batches(relay_cli, tmp_path):
    """The why names the field; the traces hold, at every step, that step's own batch in both runs (the split
    run's first steps after a resume included, where the batch the loader was built at used to be recorded)."""
    from relay.kernel.session import trace

    spec = _spec(tmp_path / "code", SAMPLER_LOOP.replace("MARK", 'opt.param_groups[0]["resumed_at"] = start'))
    out = relay_cli.run("verify-resume", str(spec), "--steps", "16", "--cut-at", "7",
                        "--workdir", str(tmp_path / "v"), timeout=600)
    assert out.returncode == 1, out.stdout + out.stderr[-3000:]
    first = out.stdout.splitlines()[0]
    assert first.startswith("differs: objects.optimizer.param_groups[0].resumed_at: 0 vs "), out.stdout
    assert "(and " not in first, out.stdout  # the only difference
    why = out.stdout.split("why: ", 1)[1]
    assert why.startswith("step 7 (the first after a resume): optimizer (param_groups[0].resumed_at) differs at"
                          " the step's start, although restore() brought back the straight run's"), why
    assert "batch" not in why, why
    straight, split = (trace.read(tmp_path / "v" / f"{run}.trace.jsonl") for run in ("straight", "split"))
    assert sorted(straight) == sorted(split) == list(range(16))
    assert all(straight[s]["batch"] is not None and straight[s]["batch"] == split[s]["batch"] for s in straight)
    assert split[7]["resumed"]


# The seeding rule (docs/your-code.md): a seed before restore() is replaced by the restored RNG in a resumed
# session and starts both runs alike in a fresh one; a seed after restore() replaces the restored RNG.
SEEDED_LOOP = '''
import torch, relay
session = relay.open_session()
BEFORE
g = torch.Generator().manual_seed(0)
x, y = torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)
model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
session.register(model=model, optimizer=opt)
session.restore()
AFTER
for idx in session.batches(len(x), 8):
    loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
    opt.zero_grad(); loss.backward(); opt.step()
    session.step_done(loss=loss.detach())
session.close()
'''


def test_a_seed_between_open_session_and_restore_resumes_identically(relay_cli, tmp_path):
    spec = _spec(tmp_path / "code", SEEDED_LOOP.replace("BEFORE", "torch.manual_seed(1234)").replace("AFTER", ""))
    out = relay_cli.run("verify-resume", str(spec), "--steps", "16", "--cut-at", "7",
                        "--workdir", str(tmp_path / "v"), timeout=600)
    assert out.returncode == 0 and out.stdout.startswith("identical"), out.stdout + out.stderr[-3000:]


def test_a_seed_after_restore_breaks_resume_and_the_why_says_so(relay_cli, tmp_path):
    spec = _spec(tmp_path / "code", SEEDED_LOOP.replace("BEFORE", "").replace("AFTER", "torch.manual_seed(1234)"))
    out = relay_cli.run("verify-resume", str(spec), "--steps", "16", "--cut-at", "7",
                        "--workdir", str(tmp_path / "v"), timeout=600)
    assert out.returncode == 1, out.stdout + out.stderr[-3000:]
    why = out.stdout.split("why: ", 1)[1]
    assert why.startswith("step 7 (the first after a resume): the RNG state at the step's start differs, although"
                          " restore() brought back the straight run's: the script seeds"), why


def test_an_hf_trainers_batches_are_recorded_as_its_loaders_draw_them(relay_cli, tmp_path):
    """HF's Trainer makes its own loaders (and a skipping one on a resume): under verify-resume the batches its
    iterators draw over the train set, gradient_accumulation_steps of them a step, are each step's in both runs."""
    pytest.importorskip("transformers")
    from byo_fixtures import copy_example
    from kaggle_fixtures import HF_MODULES, verify_warm
    from relay.kernel.session import trace

    spec = copy_example("byo-hf", tmp_path / "ex")
    script = tmp_path / "ex" / "train.py"
    script.write_text(script.read_text().replace(  # 128 samples, 8 a micro-batch, 2 a step: 8 steps an epoch
        "per_device_train_batch_size=16,", "per_device_train_batch_size=8, gradient_accumulation_steps=2,").replace(
        "Reviews(tokenizer, 512, seed=0)", "Reviews(tokenizer, 128, seed=0)"))
    out = relay_cli.run("verify-resume", str(spec), "--steps", "20", "--cut-at", "7,16",
                        "--workdir", str(tmp_path / "v"), timeout=900,
                        env=verify_warm(*HF_MODULES, "transformers.trainer"))
    assert out.returncode == 0 and out.stdout.startswith("identical"), out.stdout + out.stderr[-3000:]
    straight, split = (trace.read(tmp_path / "v" / f"{run}.trace.jsonl") for run in ("straight", "split"))
    assert sorted(straight) == sorted(split) == list(range(20))
    assert all(straight[s]["batch"] is not None and straight[s]["batch"] == split[s]["batch"] for s in straight)
    assert len({straight[s]["batch"] for s in straight}) == 20  # each step its own, across 3 epochs
