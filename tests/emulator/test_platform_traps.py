"""What real Kaggle does that a relay must survive, in the emulator and through the real client
(docs/kaggle.md, "Platform traps the relay handles"):

- status lag: after a push, the unpinned status and output still answer the previous version; pinned
  (versionLabel "v<N>") they answer the version asked for; the relay observes the pinned one and never
  pushes while the current version could still run;
- a push answered `versionNumber: 0` with an error is a refusal;
- the session limit ends a run CANCEL_ACKNOWLEDGED with "exceeded the max allowed execution duration", and
  the relay classifies that as a budget set too long;
- mounts in both layouts (`<input>/<slug>`; `<input>/datasets|notebooks/<owner>/<slug>`), found by the
  session kernel's search;
- enable_gpu without a machine shape would get a P100: the spec defaults the shape, the backend always sends one;
  a retired or unknown shape is refused by the spec.
Every wait is for an event (a file the kernel writes, a state reached), never a sleep tuned to a machine.
"""
from __future__ import annotations

import inspect
import json
import time
from pathlib import Path

import pytest

from kaggle_fixtures import USER, backend_for, isolated_env, make_emulator, push_script, wait_state  # noqa: F401
from relay.orchestrator import chain, handoff
from relay.orchestrator.kaggle import KernelState, Refusal, SessionKernel
from relay.orchestrator.kaggle.backend import ClientBackend
from relay.kernel.session import mounts
from relay.shared.errors import InputError
from relay.shared.spec import DEFAULT_GPU_SHAPE, KaggleConfig

LAG_FOREVER = {"status_lag": {"calls": 10 ** 9}}  # unpinned status/output never see the newest version
SESSION_LIMIT = "Your notebook was stopped because it exceeded the max allowed execution duration"


def script(run_id: str, text: str, wait_for_go: bool = False) -> str:
    """A kernel that carries a relay run id marker, writes relay-kernel.json and out.txt, optionally after
    a `go` file appears in its working folder (the test's event)."""
    wait = "while not os.path.exists('go'): time.sleep(0.02)\n" if wait_for_go else ""
    return (f"# relay-run-id: {run_id}\nimport json, os, time\n"
            f"json.dump({{'run_id': {run_id!r}}}, open('relay-kernel.json', 'w'))\n"
            f"open('started', 'w').write('1')\n{wait}open('out.txt', 'w').write({text!r})\n")


def wait_file(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def test_pinned_observations_see_the_pushed_version_while_the_unpinned_ones_lag(make_emulator, tmp_path):
    emu = make_emulator(faults=LAG_FOREVER)
    backend = backend_for(emu)
    names = chain.Names(USER, "lagtest")
    # attempt 1 of session 1 ran (say its output was unusable); attempt 2 is pushed
    push_script(backend, names.kernel, script("lagtest-s001-a1", "first"), title="Lagtest Session")
    assert wait_state(backend, names.kernel).state is KernelState.COMPLETE
    push_script(backend, names.kernel, script("lagtest-s001-a2", "second", wait_for_go=True), title="Lagtest Session")
    working = emu.store.kernel_dir(names.kernel, 2) / "working"
    wait_file(working / "started")

    # unpinned, Kaggle still answers version 1: finished, with version 1's files
    assert backend.kernel_status(names.kernel).state is KernelState.COMPLETE
    lagged = backend.download_output(names.kernel, tmp_path / "lagged", "lagtest-s001-a2")
    assert lagged.stale and lagged.found_run_id == "lagtest-s001-a1"
    # pinned, version 2 is running; the relay's observation is the pinned one, so it waits
    assert backend.kernel_status(names.kernel, 2).state is KernelState.RUNNING
    obs = handoff.observe(backend, names, tmp_path / "local")
    assert (obs.kernel_run, obs.kernel_version, obs.kernel_state) == ("lagtest-s001-a2", 2, "running")
    assert chain.decide("lagtest", obs).do is chain.Do.WAIT

    # no other attempt is pushed while version 2 could still run: refused before anything is sent
    retry = SessionKernel(kernel=names.kernel, title="Lagtest Session", spec_text="name: lagtest\n",
                          run_id="lagtest-s001-a3", enable_gpu=False)
    refused = backend.push_session(retry)
    assert not refused.pushed and refused.refusal is Refusal.BUSY and "version 2" in refused.message
    assert len(emu.store.kernels[names.kernel]["versions"]) == 2

    (working / "go").write_text("1")
    assert wait_state_pinned(backend, names.kernel, 2) is KernelState.COMPLETE
    fresh = backend.download_output(names.kernel, tmp_path / "fresh", "lagtest-s001-a2", version=2)
    assert fresh.fresh and (fresh.directory / "out.txt").read_text() == "second"
    assert backend.kernel_status(names.kernel).state is KernelState.COMPLETE  # (still version 1's, lagging)
    assert emu.faults.injected["status_lag"] >= 3
    obs = handoff.observe(backend, names, tmp_path / "local")
    assert chain.decide("lagtest", obs).do is chain.Do.HARVEST and obs.kernel_version == 2


def wait_state_pinned(backend: ClientBackend, kernel: str, version: int, timeout: float = 60) -> KernelState:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = backend.kernel_status(kernel, version).state
        if state.finished:
            return state
        time.sleep(0.05)
    raise AssertionError(f"{kernel} v{version} did not finish")


def test_lag_by_seconds_ends_and_a_version_label_is_honoured(make_emulator):
    emu = make_emulator(faults={"status_lag": {"seconds": 3600}})
    backend = backend_for(emu)
    kernel = f"{USER}/lag-seconds"
    push_script(backend, kernel, script("x-s001-a1", "one"))
    wait_state_pinned(backend, kernel, 1)
    push_script(backend, kernel, "import sys; sys.exit(3)\n")
    assert wait_state_pinned(backend, kernel, 2) is KernelState.ERROR
    assert backend.kernel_status(kernel).state is KernelState.COMPLETE  # within the hour: version 1's
    with emu.store.lock:  # an hour later (moved, not waited for)
        emu.store.kernels[kernel]["versions"][-1]["pushed"] -= 3600
    assert backend.kernel_status(kernel).state is KernelState.ERROR
    with pytest.raises(Exception, match="not found"):
        backend.kernel_status(kernel, 9)


def test_a_push_answered_version_zero_with_an_error_is_a_refusal(make_emulator):
    emu = make_emulator(faults={"methods": {"SaveKernel": {"script": ["refused"]}}})
    backend = backend_for(emu)
    session = SessionKernel(kernel=f"{USER}/refused-push", title="Refused Push", spec_text="name: refused\n",
                            run_id="refused-s001-a1", enable_gpu=False)
    first = backend.push_session(session)
    assert not first.pushed and first.refusal is Refusal.OTHER and first.version is None
    assert "push failed" in first.message.lower() and f"{USER}/refused-push" not in emu.store.kernels
    second = backend.push_session(session)  # the relay waits, then pushes the same run id again
    assert second.pushed and second.version == 1 and not second.already_pushed


def test_the_session_limit_ends_cancel_acknowledged_and_is_classified_as_a_budget_too_long(make_emulator):
    emu = make_emulator(sigterm_grace=30.0)
    backend = backend_for(emu)
    kernel = f"{USER}/limit-hit"
    trap = ("import os, signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *_: (open('saved.txt', 'w').write('saved'), sys.exit(0)))\n"
            "open('started', 'w').write('1')\nwhile True: time.sleep(0.02)\n")
    push_script(backend, kernel, "# relay-run-id: limit-s001-a1\n" + trap)
    wait_file(emu.store.kernel_dir(kernel, 1) / "working" / "started")
    emu.runner.expire_now(kernel, 1)  # the session's time is up (an event, not a wait)
    status = wait_state_pinned(backend, kernel, 1)
    assert status is KernelState.CANCELLED
    observed = backend.kernel_status(kernel, 1)
    assert observed.failure_message == SESSION_LIMIT
    assert emu.store.kernel_version(kernel)["status"] == "CANCEL_ACKNOWLEDGED"
    assert (emu.store.kernel_dir(kernel, 1) / "working" / "saved.txt").read_text() == "saved"  # SIGTERM, then grace

    obs = chain.Observation(None, "limit-s001-a1", "cancelled", observed.failure_message, kernel_version=1)
    action = chain.decide("limit", obs)
    assert action.do is chain.Do.SALVAGE and "session limit" in action.reason
    assert chain.hit_session_limit("cancelled", SESSION_LIMIT)
    assert not chain.hit_session_limit("error", SESSION_LIMIT)
    assert not chain.hit_session_limit("cancelled", "Kernel exited with code -9")
    advice = chain.session_limit_advice(1, 3000, 3600, 120)
    assert "not a transient failure" in advice and "session.budget" in advice and "3600" in advice


# -- mounts -------------------------------------------------------------------------------------------------
# the session's own search (relay/kernel/session/mounts.py), run inside an emulator kernel as it is
MOUNTED_SOURCE = inspect.getsource(mounts.mounted)
FINDER = ("import json, os\nfrom typing import Optional\n" + MOUNTED_SOURCE + "inp = os.environ['KAGGLE_INPUT_DIR']\n"
          "found = {ref: mounted(ref, inp) for ref in ('alice/mnt-data', 'alice/producer', 'alice/absent')}\n"
          "json.dump({k: v and os.path.relpath(v, inp) for k, v in found.items()}, open('found.json', 'w'))\n"
          "json.dump(sorted(os.listdir(found['alice/mnt-data'])), open('files.json', 'w'))\n")


@pytest.mark.parametrize("layout, expected", [
    ("flat", {"alice/mnt-data": "mnt-data", "alice/producer": "producer", "alice/absent": None}),
    ("nested", {"alice/mnt-data": "datasets/alice/mnt-data", "alice/producer": "notebooks/alice/producer",
                "alice/absent": None}),
])
def test_mounts_are_found_in_each_layout(make_emulator, tmp_path, layout, expected):
    emu = make_emulator(mount_layout=layout)
    backend = backend_for(emu)
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "train.csv").write_text("a,b\n1,2\n")
    backend.publish_folder(folder, f"{USER}/mnt-data", "Mount data", "v1")
    push_script(backend, f"{USER}/producer", "open('model.txt', 'w').write('weights')\n", gpu=False)
    assert wait_state(backend, f"{USER}/producer").state is KernelState.COMPLETE

    push = tmp_path / "push"
    push.mkdir()
    (push / "run.py").write_text(FINDER)
    (push / "kernel-metadata.json").write_text(json.dumps({
        "id": f"{USER}/consumer", "title": "Consumer", "code_file": "run.py", "language": "python",
        "kernel_type": "script", "enable_gpu": False, "enable_internet": False,
        "dataset_sources": [f"{USER}/mnt-data"], "kernel_sources": [f"{USER}/producer"]}))
    backend.client.run("push", lambda api: api.kernels_push(str(push)))
    assert wait_state(backend, f"{USER}/consumer").state is KernelState.COMPLETE
    working = emu.store.kernel_dir(f"{USER}/consumer", 1) / "working"
    assert json.loads((working / "found.json").read_text()) == expected
    assert "train.csv" in json.loads((working / "files.json").read_text())


def test_the_kernel_search_prefers_the_owner_layouts_and_falls_back_to_the_slug(tmp_path):
    def mounted(root, ref):
        return mounts.mounted(ref, root)

    (tmp_path / "ckpt").mkdir()
    assert mounted(str(tmp_path), "bob/ckpt") == str(tmp_path / "ckpt")                 # /kaggle/input/<slug>
    (tmp_path / "notebooks" / "bob" / "ckpt").mkdir(parents=True)
    assert mounted(str(tmp_path), "bob/ckpt") == str(tmp_path / "notebooks" / "bob" / "ckpt")
    (tmp_path / "datasets" / "bob" / "ckpt").mkdir(parents=True)
    assert mounted(str(tmp_path), "bob/ckpt") == str(tmp_path / "datasets" / "bob" / "ckpt")
    assert mounted(str(tmp_path), "carol/ckpt") == str(tmp_path / "ckpt")  # another owner: only the slug matches
    assert mounted(str(tmp_path), "bob/none") is None


# -- accelerators -------------------------------------------------------------------------------------------
def test_gpu_without_a_shape_gets_t4_x2_and_a_retired_or_unknown_shape_is_refused():
    assert DEFAULT_GPU_SHAPE == "NvidiaTeslaT4"
    assert KaggleConfig().machine_shape == "NvidiaTeslaT4"
    assert KaggleConfig(machine_shape=None).machine_shape == "NvidiaTeslaT4"
    assert KaggleConfig(enable_gpu=False).machine_shape is None
    assert KaggleConfig(machine_shape="NvidiaL4").machine_shape == "NvidiaL4"
    # Kaggle runs a retired shape on another without a word (kaggle-cli PR #1192): the spec refuses it, one line
    with pytest.raises(ValueError, match="kaggle.machine_shape: NvidiaTeslaP100 is retired: Kaggle runs it on"
                                         " NvidiaTeslaT4 instead"):
        KaggleConfig(machine_shape="NvidiaTeslaP100")
    with pytest.raises(ValueError, match="kaggle.machine_shape: expected one of NvidiaTeslaT4, .*got 'T4x2'"):
        KaggleConfig(machine_shape="T4x2")
    # the backend never pushes a GPU kernel without a shape, whoever built the SessionKernel
    meta = ClientBackend._metadata(SessionKernel(kernel="u/k", title="Title", spec_text="", run_id="r",
                                                 machine_shape=None))
    assert meta["enable_gpu"] is True and meta["machine_shape"] == "NvidiaTeslaT4"
    assert "machine_shape" not in ClientBackend._metadata(
        SessionKernel(kernel="u/k", title="Title", spec_text="", run_id="r", enable_gpu=False))
    with pytest.raises(InputError, match="^kernel u/k: machine shape NvidiaTeslaP100 is retired"):  # however built
        ClientBackend._metadata(SessionKernel(kernel="u/k", title="Title", spec_text="", run_id="r",
                                              machine_shape="NvidiaTeslaP100"))


def test_gpus_are_recorded_per_session_and_shown_in_the_table():
    from relay.kernel.session import hardware
    from relay.orchestrator import report

    import torch

    found = hardware.gpu_inventory()
    assert found["count"] == len(found["names"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    sessions = [{"index": 1, "run_id": "r1", "gpus": {"count": 2, "names": ["Tesla T4", "Tesla T4"]}},
                {"index": 2, "run_id": "r2", "gpus": {"count": 1, "names": ["Tesla P100-PCIE-16GB"]}},
                {"index": 3, "run_id": "r3", "gpus": {"count": 0, "names": []}},
                {"index": 4, "run_id": "r4"}]
    rows = report.session_table({"sessions": sessions})
    assert [r["gpus"] for r in rows] == ["2 x Tesla T4", "1 x Tesla P100-PCIE-16GB", "no GPU", None]
    table = report.format_table(rows)
    assert "GPUs" in table.splitlines()[0] and "2 x Tesla T4" in table and "P100" in table
