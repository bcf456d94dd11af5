"""The user in control of a relay from the command line: `relay stop`, `relay stop --now`, `relay resume` and
`relay logs`, run as the README shows them (a shell with only a user's environment) against the emulator.

Events, not sleeps: the user's script blocks at a given step until a gate file appears (the kernel's environment
names both; the reference run has no gate), so a session is still training whenever the test needs it to be,
whatever the machine's speed; sessions are step-bounded (session.max_steps), so their number is a fact.

`relay run` reports to the worker's Prefect server (the `prefect_server` fixture: PREFECT_API_URL, as a user with a
server exports it) instead of starting an embedded one each run: the subject here is the control commands; `relay
run` on its embedded Prefect is the front door's (tests/e2e/test_front_door.py).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from byo_fixtures import RELAYED, copy_example, relay_in_shell, shell_env
from kaggle_fixtures import KERNEL_ENV, USER, isolated_env, make_emulator  # noqa: F401
from relay.orchestrator import chain
from relay.orchestrator.chain import Do, Observation
from relay.shared import progress_line
from relay_fixtures import wait_for

NAME = "byo-plain"
KERNEL = f"{USER}/{NAME}-session"
CKPT = f"{USER}/{NAME}-ckpt"
LOOP = "    for idx in session.batches(len(x), args.batch):  # relay: this step's samples, until it must stop\n"
# TEST-ONLY: the session blocks at the top of step GATE_STEP's iteration until the file GATE_PATH exists
GATE = '''        gate = os.environ.get("CONTROL_TEST_GATE", "")
        if gate and session.step == int(gate.split(":", 1)[0]):
            while not os.path.exists(gate.split(":", 1)[1]):
                time.sleep(0.05)
'''


# -- the decision (pure) --------------------------------------------------------------------------------------
def _obs(**fields) -> Observation:
    base = dict(published={"run_id": "r-s001-a1", "global_step": 30, "status": "paused"}, kernel_run="r-s001-a1",
                kernel_state="complete")
    base.update(fields)
    return Observation(**base)


def test_a_stopped_relay_hands_its_running_session_over_and_pushes_nothing():
    stop = "by alice@laptop at 2026-11-26 03:00:00 UTC"
    running = _obs(published=None, kernel_state="running")
    assert chain.decide("r", running).do is Do.WAIT
    assert chain.decide("r", _obs(published=None, kernel_state="running", stopped_by_user=stop)).do is Do.WAIT
    finished = _obs(published=None, kernel_state="complete", stopped_by_user=stop)
    assert chain.decide("r", finished).do is Do.HARVEST  # handed over as usual
    after = chain.decide("r", _obs(stopped_by_user=stop))
    assert after.do is Do.STOPPED and after.run_id is None
    assert after.reason == (f"stopped by the user (relay stop) at step 30, {stop}; `relay resume r` to go on")
    assert chain.decide("r", _obs()).do is Do.PUSH  # resumed: the next session
    done = _obs(published={"run_id": "r-s003-a1", "status": "done"}, stopped_by_user=stop)
    assert chain.decide("r", done).do is Do.DONE
    retry = chain.Action(Do.PUSH, "r-s002-a2", 2, 2, "retry")
    assert chain.unless_stopped("r", _obs(stopped_by_user=stop), retry).do is Do.STOPPED


def test_a_session_ended_by_stop_now_is_pushed_again_as_a_new_attempt():
    ended = _obs(kernel_run=None, kernel_state=None, ended_by_user="r-s002-a1")
    action = chain.decide("r", ended)
    assert (action.do, action.run_id) == (Do.PUSH, "r-s002-a2")
    assert "ended by the user" in action.reason
    # an ended run of an earlier session, or a kernel that exists again, changes nothing
    assert chain.decide("r", _obs(kernel_run=None, kernel_state=None, ended_by_user="r-s001-a1")).run_id == "r-s002-a1"
    assert chain.decide("r", _obs(ended_by_user="r-s002-a1")).run_id == "r-s002-a1"


# -- through the CLI, against the emulator -------------------------------------------------------------------
def _project(tmp_path: Path) -> Path:
    project = tmp_path / "my-project"
    spec = copy_example("byo-plain", project, **RELAYED)
    train = project / "train.py"
    text = train.read_text()
    assert LOOP in text
    train.write_text("import os\nimport time\n" + text.replace(LOOP, LOOP + GATE))
    data = yaml.safe_load(spec.read_text())
    data["code"]["folder"] = str(project)  # the reference run reads a copy of the spec elsewhere
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    return project


def _start_relay(tmp_path, emulator, project, log_name: str, server: dict) -> subprocess.Popen:
    """`relay run spec.yaml` (to the end) in the background, its output to a file; `server`: PREFECT_API_URL."""
    log = open(tmp_path / log_name, "w")
    return subprocess.Popen([sys.executable, "-m", "relay", "run", "spec.yaml", "--poll", "0.3"], cwd=project,
                            env=shell_env(tmp_path, emulator, server), stdout=log, stderr=subprocess.STDOUT,
                            text=True)


def _finished(proc: subprocess.Popen, tmp_path: Path, log_name: str) -> str:
    proc.wait(timeout=900)  # a hang guard, not a speed bound
    return (tmp_path / log_name).read_text()


def _version(emulator, number: int):
    with emulator.store.lock:
        return emulator.store.kernel_version(KERNEL, f"v{number}")


def _runs(emulator) -> list:
    from relay.orchestrator.kaggle.kernel_source import find_run_id

    kernel = emulator.store.kernels.get(KERNEL) or {"versions": []}
    return [find_run_id((emulator.store.kernel_dir(KERNEL, v["number"]) / "source.py").read_text())
            for v in kernel["versions"]]


def _published(emulator) -> dict:
    versions = emulator.store.datasets[CKPT]["versions"]
    return json.loads((emulator.store.dataset_dir(CKPT, versions[-1]["number"]) / "progress.json").read_text())


def _ok(ran: subprocess.CompletedProcess) -> str:
    assert ran.returncode == 0, ran.stdout + ran.stderr[-3000:]
    assert "Traceback" not in ran.stdout + ran.stderr
    return ran.stdout


def test_stop_hands_the_session_over_every_orchestrator_obeys_and_resume_ends_identical(
        make_emulator, tmp_path, reference, prefect_server):  # noqa: F811
    gate = tmp_path / "gate-1"
    emulator = make_emulator(kernel_env={**KERNEL_ENV, "CONTROL_TEST_GATE": f"5:{gate}"},
                             faults={"stream_drop": {"after_events": 4}})  # `relay logs` reconnects
    project = _project(tmp_path)
    reference.start(project / "spec.yaml")
    relay = _start_relay(tmp_path, emulator, project, "run-1.log", prefect_server)
    wait_for(lambda: (_version(emulator, 1) or {}).get("status") == "RUNNING", 900, "session 1 to run")
    follow = subprocess.Popen([sys.executable, "-m", "relay", "logs", NAME, "--follow"], cwd=project,
                              env=shell_env(tmp_path, emulator), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)

    out = _ok(relay_in_shell(tmp_path, emulator, project, "stop", NAME, "--why", "checking the data"))
    assert f"relay {NAME}: stopped; session 1 ({NAME}-s001-a1) trains on and is handed over as usual" in out
    out = _ok(relay_in_shell(tmp_path, emulator, project, "status", NAME))
    assert "stopped by the user (relay stop) by alice@" in out and "checking the data" in out
    gate.touch()  # session 1 trains on to its step cap

    out = _finished(relay, tmp_path, "run-1.log")
    assert relay.returncode == 0, out[-3000:]
    assert f"stopped by the user (relay stop) at step 30, by alice@" in out, out[-3000:]
    assert f"`relay resume {NAME}` to go on" in out
    assert _runs(emulator) == [f"{NAME}-s001-a1"]  # handed over, and no session 2 pushed
    assert _published(emulator)["global_step"] == 30

    printed, err = follow.communicate(timeout=300)
    assert follow.returncode == 0, err[-3000:]
    stored = json.loads((emulator.store.kernel_dir(KERNEL, 1) / "log.json").read_text())
    assert printed.splitlines() == [e["data"].rstrip("\n") for e in stored]  # every line, once, in order
    assert any(progress_line.parse(e["data"]) for e in stored)
    assert emulator.faults.injected["stream_drop"] >= 1  # across a reconnect

    out = _ok(relay_in_shell(tmp_path, emulator, project, "run", "spec.yaml", "--tick"))  # another orchestrator
    assert "stopped by the user (relay stop) at step 30" in out and "nothing to do" in out
    assert _runs(emulator) == [f"{NAME}-s001-a1"]

    out = _ok(relay_in_shell(tmp_path, emulator, project, "resume", NAME))
    assert f"relay {NAME}: resumed; the next `relay run` or tick goes on from the last published checkpoint" \
           f" (step 30)" in out
    out = _ok(relay_in_shell(tmp_path, emulator, project, "run", "spec.yaml", "--poll", "0.3",
                             env_extra=prefect_server))
    assert "done: step 60/60, 2 session(s) handed over" in out, out[-3000:]
    assert _runs(emulator) == [f"{NAME}-s001-a1", f"{NAME}-s002-a1"]
    assert _published(emulator)["weights_sha256"] == reference.weights(project / "spec.yaml")

    for args, version in ((["--session", "1"], 1), ([], 2)):  # an earlier session's stored log; the last one's
        out = _ok(relay_in_shell(tmp_path, emulator, project, "logs", NAME, *args))
        stored = json.loads((emulator.store.kernel_dir(KERNEL, version) / "log.json").read_text())
        assert out.splitlines() == [e["data"].rstrip("\n") for e in stored], args


def test_stop_now_deletes_the_kernel_after_asking_and_resume_goes_on_from_the_published_checkpoint(
        make_emulator, tmp_path, reference, prefect_server):  # noqa: F811
    gate = tmp_path / "gate-2"
    # held after step 41: the line of the log step 40 is written at the step after it. One GPU session allowed, and
    # the deleted session holds it for 100 more requests (Kaggle goes on counting a deleted kernel's session:
    # kaggle-cli #185, #937): more than the stopped relay, the resume and the next run's first look make, so the
    # next attempt's first push is refused and must be waited through
    emulator = make_emulator(kernel_env={**KERNEL_ENV, "CONTROL_TEST_GATE": f"41:{gate}"}, max_gpu_sessions=1,
                             faults={"delete_lag": {"calls": 100}})
    project = _project(tmp_path)
    reference.start(project / "spec.yaml")
    relay = _start_relay(tmp_path, emulator, project, "run-1.log", prefect_server)

    def at_step_40() -> bool:  # session 2 logged step 40 and blocks after the next
        entries = emulator.runner.live_log(KERNEL, 2) or []
        return any((progress_line.parse(e["data"]) or {}).get("step") == 40 for e in entries)
    wait_for(at_step_40, 900, "session 2 to reach step 40")

    ran = relay_in_shell(tmp_path, emulator, project, "stop", NAME, "--now", input="n\n")
    assert ran.returncode == 1 and "nothing changed: the relay goes on" in ran.stdout, ran.stdout + ran.stderr
    assert f"the 10 steps since are lost" in ran.stdout
    assert _version(emulator, 2)["status"] == "RUNNING" and f"{USER}/{NAME}-control" not in emulator.store.datasets

    out = _ok(relay_in_shell(tmp_path, emulator, project, "stop", NAME, "--now", "--yes"))
    assert (f"relay stop --now ends session 2 ({NAME}-s002-a1) by deleting its kernel {KERNEL}: Kaggle has no"
            " other way to stop a session. It is at step 40 (its log); the last published checkpoint is at step 30:"
            " the 10 steps since are lost") in out
    assert f"session 2 ended (kernel {KERNEL} deleted); stopped at the last published checkpoint, step 30" in out
    assert KERNEL not in emulator.store.kernels
    deleted = emulator.store.data["deleted_kernels"][-1]
    assert deleted["ref"] == KERNEL and deleted["versions"][-1]["status"] == "CANCEL_ACKNOWLEDGED"

    out = _finished(relay, tmp_path, "run-1.log")
    assert relay.returncode == 0 and "stopped by the user (relay stop) at step 30" in out, out[-3000:]
    assert KERNEL not in emulator.store.kernels  # nothing pushed after the delete

    gate.touch()  # the next attempt of session 2 passes step 41
    _ok(relay_in_shell(tmp_path, emulator, project, "resume", NAME))
    out = _ok(relay_in_shell(tmp_path, emulator, project, "run", "spec.yaml", "--poll", "0.3",
                             env_extra=prefect_server))
    assert "done: step 60/60, 2 session(s) handed over" in out, out[-3000:]
    assert _runs(emulator) == [f"{NAME}-s002-a2"]  # the kernel pushed again after the delete, once
    assert emulator.faults.injected["delete_lag_refusal"] >= 1 and not emulator.store.ghosts
    progress = _published(emulator)
    assert [s["run_id"] for s in progress["sessions"]] == [f"{NAME}-s001-a1", f"{NAME}-s002-a2"]
    assert progress["weights_sha256"] == reference.weights(project / "spec.yaml")


def test_control_commands_refuse_a_relay_kaggle_does_not_hold(make_emulator, tmp_path):  # noqa: F811
    emulator = make_emulator()
    for command in (["stop", "no-such-relay"], ["resume", "no-such-relay"], ["logs", "no-such-relay"],
                    ["stop", "Not A Name!"]):
        ran = relay_in_shell(tmp_path, emulator, tmp_path, *command)
        assert ran.returncode == 2, ran.stdout + ran.stderr
        line = ran.stderr.strip()
        assert line.startswith(f"relay: error: relay {command[0]}") and "\n" not in line, line
    assert not emulator.store.datasets  # nothing recorded for a wrong name


def test_both_flows_push_nothing_while_the_relay_is_stopped(relay_env, both_flows, monkeypatch):
    """The per-relay step both flows take (relay/orchestrator/relay_step.py) obeys a stop recorded on Kaggle before any push."""
    from relay.orchestrator.kaggle import control_record

    relay_env.start()
    relay_env.write_spec()
    control_record.write(relay_env.backend(), USER, relay_env.name, control_record.STOPPED, "before it began")
    for mode in ("tick", "watch"):
        summary = relay_env.run_flow(monkeypatch, mode=mode)
        assert summary["state"] == "stopped", summary
        assert summary["why"].startswith("stopped by the user (relay stop) at step 0, by alice@"), summary
        assert "before it began" in summary["why"]
    assert relay_env.kernel_runs() == []
    control_record.write(relay_env.backend(), USER, relay_env.name, control_record.RESUMED)
    assert relay_env.run_flow(monkeypatch, mode="tick")["state"] == "pushed"
