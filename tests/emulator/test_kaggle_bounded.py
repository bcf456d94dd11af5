"""Every Kaggle call is bounded, whatever Kaggle does: a request that is never answered is abandoned after its
read timeout and retried, and a call that keeps failing gives up (KaggleUnresponsive) with one line naming it;
error pages in HTML are judged by their status (429/5xx retried, Retry-After honoured; a 4xx is one line).
`relay run --tick`, `relay status` and `relay doctor` return with that line, never hang. The bounds are
shortened through the environment (RELAY_KAGGLE_TIMEOUT_S, RELAY_KAGGLE_GIVE_UP_S) so nothing here waits
minutes; the emulator's `hang` fault holds a request until the emulator stops. Real `kaggle` client."""
from __future__ import annotations

from pathlib import Path

import pytest

from byo_fixtures import RELAYED, copy_example, relay_in_shell
from kaggle_fixtures import KERNEL_ENV, USER, backend_for, isolated_env, make_emulator  # noqa: F401
from relay.orchestrator.handoff import kaggle_timeout_s, session_kernel
from relay.orchestrator.kaggle import KaggleHTTPError, KaggleUnresponsive, SessionKernel

BOUNDS = {"RELAY_KAGGLE_TIMEOUT_S": "0.5", "RELAY_KAGGLE_GIVE_UP_S": "2"}


@pytest.fixture
def short_bounds(monkeypatch):
    for name, value in BOUNDS.items():
        monkeypatch.setenv(name, value)


def test_a_hung_request_is_abandoned_and_retried_and_a_call_that_never_answers_gives_up(make_emulator,
                                                                                       short_bounds):
    emu = make_emulator(faults={"methods": {"GetAcceleratorQuotaStatistics": {"script": ["hang", "ok"] + ["hang"] * 50},
                                            "upload": {"script": ["hang"]}}})
    backend = backend_for(emu)
    assert backend.quota().allowed_s > 0  # the first request hung: abandoned at its timeout, the retry answered
    with pytest.raises(KaggleUnresponsive) as gave_up:
        backend.quota()
    message = str(gave_up.value)
    assert message.startswith("quota: no usable answer from Kaggle for 2 s") and "\n" not in message, message
    assert "no answer within 0.5 s" in message
    assert emu.faults.injected["hang"] >= 3
    # a dataset upload whose PUT is never answered is resumed, and the version is complete
    folder = emu.store.root.parent / "publish"
    folder.mkdir()
    (folder / "weights.bin").write_bytes(b"w" * 4096)
    result = backend.publish_folder(folder, f"{USER}/bounded-upload", "Bounded upload test")
    assert result.version == 1 and emu.faults.injected["hang"] >= 4
    assert {f.name: f.size for f in backend.list_dataset_files(f"{USER}/bounded-upload")}["weights.bin"] == 4096


@pytest.mark.parametrize("status", [429, 503])
def test_an_html_429_or_503_is_retried(make_emulator, status):
    emu = make_emulator(faults={"methods": {"GetAcceleratorQuotaStatistics": {"script": ["html", "html", "ok"],
                                                                              "html_status": status}}})
    assert backend_for(emu).quota().allowed_s > 0
    assert emu.faults.injected["html"] == 2


def test_an_html_4xx_is_one_line_naming_the_call(make_emulator):
    emu = make_emulator(faults={"methods": {"GetAcceleratorQuotaStatistics": {"script": ["html"],
                                                                              "html_status": 403}}})
    with pytest.raises(KaggleHTTPError) as refused:
        backend_for(emu).quota()
    assert str(refused.value) == "quota: HTTP 403 (an HTML page)"
    assert emu.faults.injected["html"] == 1  # answered once, not retried


def test_a_steps_bounded_session_is_pushed_with_what_it_needs_not_the_12_h_cap():
    from relay.orchestrator.policy import FIRST_SESSION_S, push_budget
    from relay.shared import spec as spec_mod

    # examples/byo-plain: 300 steps, sessions of 100 (session.max_steps), no session.budget; startup 120 s
    spec = spec_mod.load(Path(__file__).resolve().parents[2] / "examples" / "byo-plain" / "spec.yaml")
    assert spec.session.budget is None and spec.session.max_steps == 100
    # the first session: nothing measured yet, the stated default
    first = push_budget(spec, None, None)
    assert first == FIRST_SESSION_S and kaggle_timeout_s(spec, first) == FIRST_SESSION_S + 120 + 5
    # ... unless the user stated a step time (session.step_seconds): its 100 steps at that pace, with the slack a
    # measured step gets; a measured step then replaces the estimate
    stated = spec_mod.validate({**spec_mod.to_dict(spec), "session": {**spec_mod.to_dict(spec)["session"],
                                                                      "step_seconds": "0.5s"}})
    assert push_budget(stated, None, None) == pytest.approx(100 * 0.5 + 300 + 0 + 5)
    # then its 100 steps at the slowest step time measured so far (session 1: 2 s a step, session 2: 3 s, its
    # 8 s save excluded), with 25 % slack (at least 5 min), the slowest save and the safety margin
    sessions = [{"step_start": 0, "step_end": 100, "seconds": 204.0, "save_seconds": 4.0},
                {"step_start": 100, "step_end": 200, "seconds": 308.0, "save_seconds": 8.0}]
    progress = {"global_step": 200, "total_steps": 300, "sessions": sessions}
    need = 100 * 3.0 + 300 + 8 + 5
    assert push_budget(spec, None, progress) == pytest.approx(need) == push_budget(stated, None, progress)
    assert kaggle_timeout_s(spec, push_budget(spec, None, progress)) == int(need + 120 + 5 + 0.999)
    # the final session needs only the steps left; slow steps are capped at Kaggle's limit, never past it
    assert push_budget(spec, None, {**progress, "global_step": 290}) == pytest.approx(10 * 3.0 + 300 + 8 + 5)
    slow = [{"step_start": 0, "step_end": 100, "seconds": 100 * 600.0, "save_seconds": 0.0}]
    assert kaggle_timeout_s(spec, push_budget(spec, None, {"global_step": 100, "total_steps": 300,
                                                           "sessions": slow})) == 12 * 3600
    # a session bounded by time keeps its budget, unless the run's steps left need less (its final session)
    timed = spec_mod.validate({**spec_mod.to_dict(spec), "session": {"budget": "1h", "safety_margin": "5s"}})
    assert push_budget(timed, None, None) == 3600
    assert push_budget(timed, None, {**progress, "total_steps": 100_000}) == 3600
    assert push_budget(timed, None, progress) == pytest.approx(need)


def test_the_push_asks_kaggle_for_the_budget_plus_its_margins_capped_at_the_session_timeout(make_emulator):
    from relay.orchestrator.chain import Action, Do, Names
    from relay.shared import spec as spec_mod

    run_spec = spec_mod.RunSpec.model_validate({"name": "push-timeout", "recipe": "toy",
                                                "optim": {"micro_batch": 8, "lr": 0.003, "max_steps": 100},
                                                "session": {"safety_margin": "2m"},
                                                "kaggle": {"session_timeout": "12h", "startup_overhead": "5m"}})
    # a 2 h session: 2 h + 5 min start-up + 2 min for the final save; an 11.95 h one: capped at 12 h
    assert kaggle_timeout_s(run_spec, 2 * 3600) == 2 * 3600 + 300 + 120
    assert kaggle_timeout_s(run_spec, 11.95 * 3600) == 12 * 3600
    assert kaggle_timeout_s(run_spec, None) == 12 * 3600
    action = Action(Do.PUSH, "push-timeout-s001-a1", 1, "first session")
    session = session_kernel(run_spec, "name: push-timeout\n", Names(USER, "push-timeout"), action, 2 * 3600,
                             features_published=False, has_checkpoint=False)
    assert session.session_timeout_s == 2 * 3600 + 420
    # and Kaggle (the emulator) is asked for exactly that
    emu = make_emulator()
    backend = backend_for(emu)
    pushed = backend.push_session(SessionKernel(kernel=f"{USER}/push-timeout-session", title="push-timeout session",
                                                spec_text="name: push-timeout\n", run_id="push-timeout-s001-a1",
                                                budget_s=1, enable_gpu=False, session_timeout_s=7620))
    assert pushed.pushed
    version = emu.store.kernels[f"{USER}/push-timeout-session"]["versions"][-1]
    assert version["timeout_s"] == 7620


def _project(tmp_path):
    project = tmp_path / "my-project"
    copy_example("byo-plain", project, **RELAYED)
    return project


def test_a_tick_status_and_doctor_return_with_one_line_when_kaggle_never_answers(make_emulator, tmp_path):
    # every GetKernel (the first thing a tick and `relay status` ask) and every quota request hang
    emu = make_emulator(kernel_env=dict(KERNEL_ENV), faults={"methods": {
        "GetKernel": {"hang": 1.0}, "GetAcceleratorQuotaStatistics": {"hang": 1.0}}})
    project = _project(tmp_path)
    tick = relay_in_shell(tmp_path, emu, project, "run", "spec.yaml", "--tick", timeout=120, env_extra=BOUNDS)
    assert tick.returncode == 1, tick.stdout + tick.stderr[-3000:]
    said = [line for line in tick.stdout.splitlines() if "Kaggle did not answer" in line]
    assert len(said) == 1 and "get kernel alice/byo-plain-session: no usable answer from Kaggle for 2 s" in said[0], \
        tick.stdout
    assert "Traceback" not in tick.stdout + tick.stderr

    status = relay_in_shell(tmp_path, emu, project, "status", "byo-plain", timeout=120, env_extra=BOUNDS)
    assert status.returncode == 2 and "Traceback" not in status.stdout + status.stderr, status.stderr[-3000:]
    assert "get kernel alice/byo-plain-session: no usable answer from Kaggle" in status.stderr.strip().splitlines()[-1]

    doctor = relay_in_shell(tmp_path, emu, project, "doctor", "spec.yaml", timeout=120, env_extra=BOUNDS)
    assert doctor.returncode == 1 and "Traceback" not in doctor.stdout + doctor.stderr, doctor.stderr[-3000:]
    assert any(line.startswith("FAIL") and "quota: no usable answer from Kaggle for 2 s" in line
               for line in doctor.stdout.splitlines()), doctor.stdout
