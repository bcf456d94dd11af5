"""The pre-flight's memory figure and the session's peaks per phase (issue 48), and running as a T4 on a bigger GPU.

Where a session allocates GPU memory, and where the pre-flight counts it (W: the weights' bytes, fp32):
- weights W, always; AdamW's state 2W from the first optimizer step on; gradients W from each backward to
  zero_grad(set_to_none); AMP's GradScaler a scalar; the batch on the device, a few MB.
- training steps after the first run their forward/backward beside AdamW's state (3W + gradients + activations:
  the session's peak). The pre-flight used to run one fresh step, whose state is allocated only after its
  backward (max(2W + activations, 4W)): on the real-size VQA student 4.7 GB said, 7.0 GB trained. It now
  allocates the state first (a zero-gradient step) and measures the next step's forward/backward beside it.
- with grad_accum > 1 the later micro-batches run their forward with every gradient held (the first grows them
  while its activations are freed): the pre-flight holds zero gradients through its forward/backward.
- clip (unscale_ + clip_grad_norm_: per-tensor norms, in place) and the fused AdamW step: in place, counted.
- eval after training: gradients freed, AdamW's state held (3W + generate's beams at full length): the
  pre-flight's eval phase runs after its training phase, with the state held and gradients freed, as training
  leaves them.
- the save: torch.save copies one storage at a time to host memory (no device staging), weights_sha256 likewise;
  measured as the "save" phase. The pre-flight's own restore writes into the tensors the state has (in place):
  load_state_dict built a second 2W beside the first on a resumed session, after the pre-flight's peak was read.
- later stages' longer sequences: Recipe.worst_case (the VQA student: the longest stage's answers).
- the caching allocator: peaks are max_memory_allocated (what tensors held); each phase's max_memory_reserved is
  recorded beside it (fragmentation: what a real OOM is against), and PREFLIGHT_FRACTION leaves 10 % for it.
What only a GPU can check: the magnitudes, the pre-flight's figure within 1.0-1.1x of the trained peak
(bench/gpu_check.sh prints both per phase, also under the T4 cap). Here: the order of what the pre-flight holds
when its forward/backward runs, the in-place restore, the phase accounting and its one line (a scripted reader),
and the T4 mode's settings (torch.cuda replaced).
"""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from relay.kernel.recipes.vqa_student import VQAStudentRecipe
from relay.kernel.run import run_session
from relay.kernel.session import device as device_mod
from relay.kernel import trainer as loop
from relay.kernel.session import memory, preflight
from relay.shared.errors import InputError
from test_vqa_recipe import data_dir, load  # noqa: F401 - the module's data fixture

MB = 2**20


class ScriptedReader:
    """GPU peaks by phase, as if measured: what a phase 'allocates' is the table's value for it."""

    def __init__(self, table: dict[str, float]):
        self.table, self.resets = table, 0

    def read(self, phase: str) -> tuple[int, int]:
        mb = self.table.get(phase, 0.0)
        return int(mb * MB), int(mb * 1.25 * MB)

    def reset(self) -> None:
        self.resets += 1


# -- the book -------------------------------------------------------------------------------------------------
def test_peak_book_keeps_each_phase_and_the_preflight_beside_the_session_peak(caplog):
    table = {"setup": 1200.0, "preflight_train": 6000.0, "preflight_eval": 5000.0, "train": 5900.0}
    reader = ScriptedReader(table)
    book = memory.PeakBook(torch.device("cpu"), reader)
    for phase in ("preflight_train", "preflight_eval", "setup", "train"):
        book.enter(phase)
    with caplog.at_level(logging.WARNING, logger=memory.__name__):
        book.enter("eval", step=12)
    f = book.fields()
    assert f["preflight_mb"] == 6000.0 and f["peak_mem_mb"] == 6000.0
    assert f["phase_peaks_mb"] == {"setup": 1200.0, "preflight_train": 6000.0, "preflight_eval": 5000.0,
                                   "train": 5900.0, "eval": 0.0}
    assert f["phase_reserved_mb"]["train"] == 5900.0 * 1.25
    assert reader.resets == 5 and not caplog.records  # under the pre-flight: nothing said


def test_a_phase_past_the_preflight_is_one_line_naming_it_and_the_step(caplog):
    reader = ScriptedReader({"preflight_train": 4684.0, "preflight_eval": 4731.0, "train": 7050.0, "eval": 7100.0})
    book = memory.PeakBook(torch.device("cpu"), reader)
    with caplog.at_level(logging.WARNING, logger=memory.__name__):
        for phase in ("preflight_train", "preflight_eval", "train"):
            book.enter(phase, step=0)
        book.enter("eval", step=2)  # closes train at step 2
        book.enter("train", step=3)  # eval passes it too: still one line
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert "7050 MB (train at step 2) passed its pre-flight's 4731 MB by 2319.0 MB (49.0%)" in lines[0]
    assert book.session_peak_mb() == 7100.0


def test_a_retried_preflight_phase_forgets_the_attempt_that_ran_out():
    reader = ScriptedReader({"preflight_train": 9000.0})
    book = memory.PeakBook(torch.device("cpu"), reader)
    book.enter("preflight_train", fresh=True)
    reader.table["preflight_train"] = 5000.0  # micro-batch halved
    book.enter("preflight_train", fresh=True)
    book.enter("setup")
    assert book.preflight_mb() == 5000.0


def test_off_cuda_the_book_records_nothing():
    book = memory.PeakBook(torch.device("cpu"))
    book.enter("train")
    assert not book.active and book.fields() == {} and book.preflight_mb() is None


# -- a session's record -----------------------------------------------------------------------------------------
def _session(data_dir, tmp_path, monkeypatch, table):
    readers = []
    monkeypatch.setattr(memory, "peak_reader", lambda device: readers.append(ScriptedReader(table)) or readers[-1])
    progress = run_session(load(data_dir, **{"session.max_steps": 3, "optim.eval_every_steps": 2}), tmp_path / "w")
    return progress["sessions"][-1]


def test_the_session_record_has_each_phase_and_the_preflight_figure(data_dir, tmp_path, monkeypatch, caplog):
    table = {"setup": 300.0, "preflight_train": 900.0, "preflight_eval": 700.0, "train": 880.0, "eval": 650.0,
             "save": 400.0}
    with caplog.at_level(logging.WARNING, logger=memory.__name__):
        record = _session(data_dir, tmp_path, monkeypatch, table)
    assert record["phase_peaks_mb"] == table  # the final save's phase included: recorded after it
    assert record["preflight_mb"] == 900.0 and record["peak_mem_mb"] == 900.0
    assert not [r for r in caplog.records if "pre-flight" in r.getMessage()]


def test_a_session_past_its_preflight_says_so_once(data_dir, tmp_path, monkeypatch, caplog):
    table = {"setup": 300.0, "preflight_train": 900.0, "preflight_eval": 700.0, "train": 1350.0, "eval": 650.0,
             "save": 400.0}
    with caplog.at_level(logging.WARNING, logger=memory.__name__):
        record = _session(data_dir, tmp_path, monkeypatch, table)
    lines = [r.getMessage() for r in caplog.records if "pre-flight" in r.getMessage()]
    # the scripted train peak shows as training begins (a real one grows over the first steps)
    assert len(lines) == 1 and "1350 MB (train at step 0) passed its pre-flight's 900 MB by 450.0 MB (50.0%)" in lines[0]
    assert record["peak_mem_mb"] == 1350.0 and record["preflight_mb"] == 900.0


# -- what the pre-flight's forward/backward runs beside ------------------------------------------------------------
class ProbeVQA(VQAStudentRecipe):
    name = "probe-vqa"
    optimizers: list = []
    seen: list = []

    def loss(self, model, batch):
        opt = ProbeVQA.optimizers[-1]
        params = [p for g in opt.param_groups for p in g["params"]]
        # most, not all: a parameter no loss reaches (T5's unused encoder norm, 64 of 325k) has neither
        ProbeVQA.seen.append((sum(p in opt.state for p in params) > 0.9 * len(params),
                              sum(p.grad is not None for p in params) > 0.9 * len(params)))
        return super().loss(model, batch)


def test_the_preflight_runs_its_forward_backward_beside_adamw_state_and_held_gradients(data_dir, tmp_path,
                                                                                      monkeypatch, register_recipe):
    register_recipe(ProbeVQA.name, ProbeVQA)
    ProbeVQA.optimizers, ProbeVQA.seen = [], []
    build = loop.build_optimizer
    monkeypatch.setattr(loop, "build_optimizer", lambda *a: ProbeVQA.optimizers.append(build(*a)) or
                        ProbeVQA.optimizers[-1])
    run_session(load(data_dir, recipe=ProbeVQA.name, **{"session.max_steps": 2}), tmp_path / "w")
    # (AdamW state for every parameter, every gradient held) at each loss: grad_accum 2 in vqa-tiny.yaml
    preflight, step1, step2 = ProbeVQA.seen[:1], ProbeVQA.seen[1:3], ProbeVQA.seen[3:5]
    assert preflight == [(True, True)]  # the worst of any step: what the second micro-batch of step 2 meets
    assert step1 == [(False, False), (False, True)]  # a fresh run: the pre-flight's state was dropped
    assert step2 == [(True, False), (True, True)]


def test_the_optimizer_is_restored_in_place_and_state_it_created_is_dropped():
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 2)
    opt = torch.optim.AdamW([*a.parameters(), *b.parameters()], lr=0.1, fused=True)
    a(torch.randn(3, 4)).sum().backward()
    opt.step()  # state for a only
    saved = preflight._optimizer_snapshot(opt)
    ptrs = {id(p): opt.state[p]["exp_avg"].data_ptr() for p in a.parameters()}
    values = {id(p): opt.state[p]["exp_avg_sq"].clone() for p in a.parameters()}
    b(a(torch.randn(3, 4))).sum().backward()
    opt.step()  # moves a's state, creates b's
    preflight._restore_optimizer(opt, saved)
    assert all(p not in opt.state for p in b.parameters())
    for p in a.parameters():
        assert opt.state[p]["exp_avg"].data_ptr() == ptrs[id(p)]  # the same tensors: no second copy on the device
        assert torch.equal(opt.state[p]["exp_avg_sq"], values[id(p)]) and float(opt.state[p]["step"]) == 1.0


# -- a T4 on a bigger GPU ----------------------------------------------------------------------------------------
@pytest.fixture
def fake_h100(monkeypatch):
    """torch.cuda as an 80 GiB GPU without bf16 questions asked: what emulation sets is recorded."""
    calls = []
    monkeypatch.setattr(memory, "_emulating", {})
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * 2**30))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: calls.append((f, d)))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: 14000 * MB)
    monkeypatch.delenv("RELAY_EMULATE_GPU", raising=False)
    return calls


def test_t4_mode_caps_memory_at_the_t4s_and_trains_in_fp16(fake_h100, data_dir):
    cuda = torch.device("cuda", 0)
    assert loop.resolve_precision("auto", cuda) == "bf16"  # the H100 as itself
    profile = device_mod.emulate_gpu(load(data_dir, **{"session.emulate": "t4"}), cuda)
    assert profile.name == "Tesla T4" and fake_h100 == [(15102 / (80 * 1024), 0)]
    assert memory.device_total(cuda) == 15102 * MB
    assert loop.resolve_precision("auto", cuda) == "fp16"  # no native bf16 on a T4: fp16 + GradScaler
    assert loop.resolve_precision("fp32", cuda) == "fp32"
    assert memory.peak_fraction(cuda) == pytest.approx(14000 / 15102)  # the pre-flight's 90 % is of the T4
    assert memory.describe_device(cuda) == "NVIDIA H100 80GB HBM3 as a Tesla T4, 14.7 of 80.0 GiB"


def test_the_environment_overrides_the_spec_and_an_unknown_gpu_is_one_line(fake_h100, data_dir, monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setenv("RELAY_EMULATE_GPU", "none")
    assert device_mod.emulate_gpu(load(data_dir, **{"session.emulate": "t4"}), cuda) is None and not fake_h100
    monkeypatch.setenv("RELAY_EMULATE_GPU", "T4")
    assert device_mod.emulate_gpu(load(data_dir), cuda).name == "Tesla T4"
    monkeypatch.setenv("RELAY_EMULATE_GPU", "a100")
    with pytest.raises(InputError, match=r"^RELAY_EMULATE_GPU: unknown GPU 'a100' to emulate \(known: t4\)$"):
        device_mod.emulate_gpu(load(data_dir), cuda)
    with pytest.raises(ValueError, match="session.emulate"):
        load(data_dir, **{"session.emulate": "a100"})


def test_t4_mode_off_cuda_caps_nothing(fake_h100, data_dir):
    assert device_mod.emulate_gpu(load(data_dir, **{"session.emulate": "t4"}), torch.device("cpu")) is None
    assert not fake_h100 and loop.resolve_precision("auto", torch.device("cpu")) == "fp32"
