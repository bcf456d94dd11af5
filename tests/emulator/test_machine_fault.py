"""The emulator's `machine` fault: a session runs on other GPUs or another image than the one asked for (Kaggle
served a P100 for a T4 request; its image changes every few weeks). What the session sees is set per push, in its
environment: the image as Kaggle's image names itself (GIT_COMMIT), the GPUs through RELAY_TEST_HARDWARE (CUDA
cannot run here). Through the relay, a session that got a P100 under `kaggle.on_other_accelerator: stop` stops
at once and is pushed again from the same checkpoint; the relay ends with the weights of one uninterrupted run."""
from __future__ import annotations

import json
import time

import pytest

from kaggle_fixtures import KERNEL_ENV, USER, backend_for, isolated_env, make_emulator, push_script  # noqa: F401
from relay.emulator.faults import FaultPlan
from relay.shared.environment import HARDWARE
from relay.shared.errors import InputError

P100 = "Tesla P100-PCIE-16GB"
SHOW_ENV = f"import json, os\nprint('ENV', json.dumps([os.environ.get('GIT_COMMIT'), os.environ.get({HARDWARE!r})]))\n"


def _env_seen(emu, backend, kernel: str, number: int) -> list:
    deadline = time.monotonic() + 60
    while not backend.kernel_status(kernel, number).state.finished:
        assert time.monotonic() < deadline, f"{kernel} v{number} did not finish"
        time.sleep(0.05)
    log = json.loads((emu.store.kernel_dir(kernel, number) / "log.json").read_text())
    line = next(e["data"] for e in log if e["data"].startswith("ENV "))
    return json.loads(line[4:])


def test_the_machine_fault_tells_the_pushes_it_names_what_they_run_on(make_emulator):
    emu = make_emulator(kernel_env={**KERNEL_ENV, "GIT_COMMIT": "1a2b3c4"},
                        faults={"machine": {"pushes": [2], "gpus": [P100], "image": "9f8e7d6"}})
    backend = backend_for(emu)
    kernel = f"{USER}/machine-probe"
    seen = []
    for number in (1, 2, 3):
        push_script(backend, kernel, SHOW_ENV, gpu=False)
        seen.append(_env_seen(emu, backend, kernel, number))
    assert seen == [["1a2b3c4", None], ["9f8e7d6", json.dumps({"gpus": [P100]})], ["1a2b3c4", None]]
    assert emu.faults.injected["machine"] == 1


@pytest.mark.parametrize("bad", [{"pushes": [2]}, {"gpus": P100}, {"pushes": [0], "image": "x"}, {"disk": 1}])
def test_the_machine_fault_rejects_bad_settings_in_one_line(bad):
    with pytest.raises(InputError, match=r"^faults: machine: expected"):
        FaultPlan({"machine": bad})


def test_a_session_on_another_accelerator_stops_and_is_pushed_again(relay_env, reference):
    emu = relay_env.start(faults={"machine": {"pushes": [2], "gpus": [P100]}})
    spec = relay_env.write_spec(**{"name": "other-gpu", "kaggle.on_other_accelerator": "stop"})
    reference.start(spec)
    flow = relay_env.flow_process()
    assert flow.wait(600) == 0, (relay_env.root / "flow.log").read_text()[-6000:]
    runs = relay_env.kernel_runs()
    # session 2 got a P100 where the spec's NvidiaTeslaT4 asks for 2 x T4: it stopped before training, and the
    # same session was pushed again, once, from session 1's checkpoint
    assert [r.run_id for r in runs] == ["other-gpu-s001-a1", "other-gpu-s002-a1", "other-gpu-s002-a2",
                                        "other-gpu-s003-a1"]
    log = "".join(e["data"] for e in json.loads((emu.store.kernel_dir(relay_env.kernel, 2) / "log.json").read_text()))
    assert f"accelerator: got 1 x {P100} where kaggle.machine_shape NvidiaTeslaT4 asks for 2 x T4" in log
    from prefect.variables import Variable

    assert "failed-other-gpu-s002-a1" in json.loads(Variable.get("relay-notified-other-gpu", default="[]"))
    progress = relay_env.published_progress()
    assert [s["step_start"] for s in progress["sessions"]] == [0, 150, 300]
    assert progress["status"] == "done" and progress["weights_sha256"] == reference.weights(spec)
