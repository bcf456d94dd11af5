"""Images and accelerators that drift: what each session records it ran on, the accelerator check of
kaggle.on_other_accelerator, and a change between sessions (flagged, exact resume unproven from there).

CUDA and Kaggle's images cannot run here: the sessions are told what they "run on" through
RELAY_TEST_HARDWARE (relay.shared.environment.HARDWARE), which replaces what they see; everything after that
(the record, the check, the stop, the comparison, the table) is the real code in real `relay train` processes.
"""
from __future__ import annotations

import json
import subprocess
from typing import Optional

import pytest
import torch

from byo_fixtures import copy_example
from relay import launch
from relay.kernel.session import hardware
from relay.orchestrator import chain, policy, report
from relay.shared import accelerators, runtime
from relay.shared.environment import HARDWARE, SessionEnvironment

SHORT = {"optim.max_steps": 40, "session.max_steps": 20}
P100 = "Tesla P100-PCIE-16GB"


def _train(relay_cli, spec, workdir, told: Optional[dict]) -> subprocess.CompletedProcess:
    told_env = {HARDWARE: json.dumps(told)} if told is not None else {}  # None: what this machine is
    proc = relay_cli.run(*relay_cli.train_args(spec, workdir), timeout=300, env=told_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _progress(workdir) -> dict:
    return json.loads((workdir / "progress.json").read_text())


@pytest.mark.parametrize("example", ["byo-plain", "byo-recipe"])  # the Session API and the built-in runner
def test_another_accelerator_stops_the_session_at_once_when_the_spec_says_so(example, relay_cli, tmp_path):
    spec = copy_example(example, tmp_path / "ex", **SHORT, **{"kaggle.on_other_accelerator": "stop"})
    workdir = tmp_path / "w"
    proc = _train(relay_cli, spec, workdir, {"gpus": [P100]})
    progress = _progress(workdir)
    record = progress["sessions"][-1]
    why = f"got 1 x {P100} where kaggle.machine_shape NvidiaTeslaT4 asks for 2 x T4"
    assert progress["stop_reason"] == record["stop_reason"] == "wrong_accelerator"
    assert progress["global_step"] == 0 and record["step_end"] == 0  # not one step trained
    assert record["accelerator"] == why and record["gpus"] == {"count": 1, "names": [P100]}
    assert f"accelerator: {why}: stopping at once" in proc.stderr
    assert chain.ended_itself(proc.stdout) == ("wrong_accelerator", why)


def test_another_accelerator_is_said_and_training_goes_on_by_default(relay_cli, tmp_path):
    spec = copy_example("byo-plain", tmp_path / "ex", **SHORT)
    workdir = tmp_path / "w"
    proc = _train(relay_cli, spec, workdir, {"gpus": ["Tesla T4"]})  # one T4 of the two asked for
    record = _progress(workdir)["sessions"][-1]
    assert record["stop_reason"] == "steps" and record["step_end"] == 20
    assert record["accelerator"] == "got 1 x Tesla T4 where kaggle.machine_shape NvidiaTeslaT4 asks for 2 x T4"
    assert "training on at the speed it measures" in proc.stderr
    assert chain.ended_itself(proc.stdout) is None


@pytest.mark.parametrize("example", ["byo-plain", "byo-recipe"])
def test_a_new_image_between_sessions_is_flagged_and_exactness_unproven_from_there(example, relay_cli, tmp_path):
    spec = copy_example(example, tmp_path / "ex", **SHORT)
    workdir = tmp_path / "w"
    t4x2 = ["Tesla T4", "Tesla T4"]
    _train(relay_cli, spec, workdir, {"gpus": t4x2, "torch": "2.4.0", "image": "aaaaaaa1"})
    assert _progress(workdir).get("exactness_lost") is None
    proc = _train(relay_cli, spec, workdir, {"gpus": t4x2, "torch": "2.5.1", "image": "bbbbbbb2"})
    progress = _progress(workdir)
    changed = "torch 2.4.0 -> 2.5.1, image aaaaaaa1 -> bbbbbbb2"
    why = f"session 2 ran on another environment than session 1: {changed}"
    assert progress["exactness_lost"] == {"step": 20, "why": why}
    assert f"{why}: exact resume is unproven from step 20" in proc.stderr
    first, second = progress["sessions"]
    assert first["runtime"]["torch"] == "2.4.0" and second["runtime"]["image"] == "bbbbbbb2"

    rows = report.session_table(progress)
    assert "changed" not in rows[0] and rows[1]["changed"] == changed
    assert rows[1]["runtime"].startswith("py ") and "torch 2.5.1" in rows[1]["runtime"]
    table = report.format_table(rows)
    assert "changed since the session before" in table.splitlines()[0] and changed in table
    assert policy.environment_change(progress) == (
        f"{progress['name']}: session 2 ran on another environment than session 1: {changed}; bit-identity with an"
        " uninterrupted run is not promised across them (from step 20)")


def test_a_session_on_another_cpu_is_named_in_the_status_the_summary_and_the_final_check(relay_cli, tmp_path):
    """Session 1 records this machine's CPU and the instruction set torch's CPU kernels use here. A different CPU
    can never run here, so session 2 is told (RELAY_TEST_HARDWARE) it runs on another CPU whose kernels are
    another instruction set: what it records and what is said of it is the real code; its floats are still this
    CPU's, so its weights here are those of an uninterrupted run (on another CPU they would not be)."""
    from tasks.artifacts import summary_markdown

    spec = copy_example("byo-plain", tmp_path / "ex", **SHORT)
    workdir = tmp_path / "w"
    _train(relay_cli, spec, workdir, None)  # this machine, as it is
    here = _progress(workdir)["sessions"][0]["runtime"]
    assert here["cpu"] == hardware.cpu_model() and here["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    other = {"cpu": "Another CPU (told by the test)", "cpu_capability": "AVX2" if here["cpu_capability"] != "AVX2"
             else "AVX512"}
    proc = _train(relay_cli, spec, workdir, other)
    progress = _progress(workdir)
    changed = (f"CPU {here['cpu']} -> {other['cpu']}, CPU kernels {here['cpu_capability']} ->"
               f" {other['cpu_capability']}")
    why = f"session 2 ran on another environment than session 1: {changed}"
    note = f"{why}; bit-identity with an uninterrupted run is not promised across them (from step 20)"
    assert progress["exactness_lost"] == {"step": 20, "why": why} and f"{why}: exact resume is unproven" in proc.stderr
    assert runtime.change_notes(progress["sessions"]) == [note]
    assert report.session_table(progress)[1]["changed"] == changed
    status = relay_cli.run("status", str(workdir))  # `relay status DIR`; `relay status NAME`: test_relay_status_remote
    assert status.returncode == 0 and f"warning: {note}" in status.stdout, status.stdout + status.stderr[-2000:]
    assert f"**warning**: {note}" in summary_markdown(progress["name"], progress, {})  # the flow's summary artifact
    (tmp_path / "local" / "published").mkdir(parents=True)  # what `relay run` says when the relay ends
    (tmp_path / "local" / "published" / "progress.json").write_text(json.dumps(progress))
    said = []
    launch._outputs(said.append, progress["name"], tmp_path / "local", None, account="someone")
    assert f"warning: {note}" in said, said

    # a final check against an uninterrupted run (make demo's): weights that differ across CPUs are not a bug
    straight = {**_progress(workdir), "sessions": progress["sessions"][:1]}
    assert runtime.exact_resume(progress, straight) == (True, "identical (2 sessions vs 1 uninterrupted; weights"
                                                               f" sha256 {progress['weights_sha256'][:16]})")
    other_bits = {**straight, "weights_sha256": "0" * 64}
    ok, verdict = runtime.exact_resume(progress, other_bits)
    assert ok and verdict.startswith("not comparable: the weights differ") and f"session 2: {changed}" in verdict
    same_cpu = {**progress, "sessions": progress["sessions"][:1] * 2}
    assert runtime.exact_resume(same_cpu, other_bits) == (
        False, f"DIFFERENT: relay {progress['weights_sha256']} vs uninterrupted {'0' * 64}")


# -- the pieces, without processes ---------------------------------------------------------------------------
@pytest.mark.parametrize("shape, names, expected", [
    ("NvidiaTeslaT4", ["Tesla T4", "Tesla T4"], None),
    ("NvidiaTeslaT4", [P100], f"got 1 x {P100} where kaggle.machine_shape NvidiaTeslaT4 asks for 2 x T4"),
    ("NvidiaTeslaT4", ["Tesla T4"], "got 1 x Tesla T4 where kaggle.machine_shape NvidiaTeslaT4 asks for 2 x T4"),
    ("NvidiaTeslaT4", [], "got no GPU where kaggle.machine_shape NvidiaTeslaT4 asks for 2 x T4"),
    ("NvidiaTeslaP100", [P100], None),
    ("NvidiaL4", ["NVIDIA L4"] * 4, None),  # a count Kaggle does not document: the name alone is checked
    ("NvidiaL4", ["Tesla T4"], "got 1 x Tesla T4 where kaggle.machine_shape NvidiaL4 asks for L4"),
    ("TpuV38", [], None),  # not a GPU shape this relay knows: not checked
    (None, [P100], None),
])
def test_accelerator_mismatch(shape, names, expected):
    assert accelerators.mismatch(shape, names) == expected


def test_the_check_applies_in_a_kaggle_kernel_or_when_told_never_on_a_laptop_or_the_emulators_cpu():
    def env(**values):
        return SessionEnvironment.read({k: v for k, v in values.items()})

    gpus = {"count": 0, "names": []}
    assert hardware.accelerator_mismatch("NvidiaTeslaT4", gpus, env()) is None  # a laptop, CI
    assert hardware.accelerator_mismatch("NvidiaTeslaT4", gpus, env(KAGGLE_KERNEL_RUN_TYPE="Batch")) is not None
    assert hardware.accelerator_mismatch("NvidiaTeslaT4", gpus, env(KAGGLE_KERNEL_RUN_TYPE="Batch",
                                                                     KAGGLE_EMULATOR="1")) is None
    assert hardware.accelerator_mismatch("NvidiaTeslaT4", gpus, env(**{HARDWARE: "{}"})) is not None
    assert hardware.accelerator_mismatch(None, gpus, env(KAGGLE_KERNEL_RUN_TYPE="Batch")) is None


def test_what_a_session_runs_on_and_kaggles_image_from_its_environment():
    seen = hardware.observe(SessionEnvironment.read({"KAGGLE_KERNEL_RUN_TYPE": "Batch", "GIT_COMMIT": "1a2b3c4d5e",
                                                     "BUILD_DATE": "20261101-000000"}))
    assert seen["runtime"]["image"] == "1a2b3c4d5e" and seen["runtime"]["image_built"] == "20261101-000000"
    assert type(seen["runtime"]["torch"]) is str  # not a TorchVersion: the books load weights_only
    assert runtime.describe(seen).endswith("image 1a2b3c4")
    outside = hardware.observe(SessionEnvironment.read({"GIT_COMMIT": "not-an-image"}))  # a CI's own variable
    assert outside["runtime"]["image"] is None
    here = seen["runtime"]  # what decides this machine's float results
    assert here["cpu"] == hardware.cpu_model() and here["cpu"]
    assert here["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert (here["gpu_capability"] is None) == (not torch.cuda.is_available())
    assert runtime.machine(seen).startswith(f"CPU {here['cpu']} ({here['cpu_capability']}), ")
    told = hardware.observe(SessionEnvironment.read({HARDWARE: json.dumps({"gpus": [P100], "cuda": "12.8"})}))
    assert told["gpus"] == {"count": 1, "names": [P100]} and told["runtime"]["cuda"] == "12.8"


def test_changes_compare_only_what_both_sessions_recorded():
    old = {"runtime": {"python": "3.11.9", "torch": "2.4.0", "cuda": "12.1", "image": "a"},
           "gpus": {"count": 2, "names": ["Tesla T4"] * 2}}
    assert runtime.changes(old, old) == []
    new = {"runtime": {**old["runtime"], "cuda": "12.8"}, "gpus": {"count": 1, "names": [P100]}}
    assert runtime.changes(old, new) == ["CUDA 12.1 -> 12.8", f"GPUs 2 x Tesla T4 -> 1 x {P100}"]
    assert runtime.changes({"index": 1}, new) == []  # a record from before `runtime` existed claims nothing
    assert policy.environment_change({"sessions": [old]}) is None


def test_the_sessions_that_ran_on_another_fingerprint_are_named_with_what_changed():
    """Records as sessions on other machines would write them (none of these CPUs or GPUs runs here)."""
    t4 = {"index": 1, "step_start": 0, "gpus": {"count": 1, "names": ["Tesla T4"]},
          "runtime": {"python": "3.11.9", "torch": "2.5.1", "cuda": "12.4", "cudnn": "90100", "image": "a",
                      "cpu": "Intel(R) Xeon(R) CPU @ 2.20GHz", "cpu_capability": "AVX512", "gpu_capability": "7.5"}}
    same = {**t4, "index": 2, "step_start": 100}
    avx2 = {**t4, "index": 3, "step_start": 200,
            "runtime": {**t4["runtime"], "cpu": "AMD EPYC 7B12", "cpu_capability": "AVX2"}}
    p100 = {**avx2, "index": 4, "step_start": 300, "gpus": {"count": 1, "names": [P100]},
            "runtime": {**avx2["runtime"], "cudnn": "90300", "gpu_capability": "6.0"}}
    assert runtime.change_notes([t4, same]) == []  # equal fingerprints say nothing
    assert runtime.change_notes([t4, same, avx2, p100]) == [
        "session 3 ran on another environment than session 2: CPU Intel(R) Xeon(R) CPU @ 2.20GHz -> AMD EPYC 7B12,"
        " CPU kernels AVX512 -> AVX2; bit-identity with an uninterrupted run is not promised across them (from step"
        " 200)",
        "session 4 ran on another environment than session 3: cuDNN 90100 -> 90300, GPU compute capability 7.5 ->"
        f" 6.0, GPUs 1 x Tesla T4 -> 1 x {P100}; bit-identity with an uninterrupted run is not promised across them"
        " (from step 300)"]
    assert runtime.machine(p100) == (f"CPU AMD EPYC 7B12 (AVX2), 1 x {P100} (compute capability 6.0), torch 2.5.1,"
                                     " CUDA 12.4, cuDNN 90300")


def test_sessions_are_pushed_pinned_to_the_first_sessions_image_unless_the_spec_says_latest():
    from relay.orchestrator.kaggle.backend import ClientBackend
    from relay.orchestrator.kaggle.types import SessionKernel
    from relay.shared.spec_sections import KaggleConfig

    def meta(**kwargs):
        return ClientBackend._metadata(SessionKernel(kernel="u/k", title="Title", spec_text="", run_id="r", **kwargs))

    assert KaggleConfig().pin_image is True
    assert meta()["docker_image_pinning_type"] == "original"  # the kernel's first version's image
    assert meta(pin_image=False)["docker_image_pinning_type"] == "latest"
