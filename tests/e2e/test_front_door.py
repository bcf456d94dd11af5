"""The front door, played as a newcomer: a copy of examples/byo-plain outside the repository, relative paths
only, the commands the README's "Run it on Kaggle" lists, in fresh processes against the emulator (the real
`kaggle` client; the newcomer's `relay run` on its embedded, ephemeral Prefect, a fresh machine's first; the code
fix's on the worker's Prefect server, which PREFECT_API_URL names)."""
from __future__ import annotations

import json

import yaml

from conftest import REPO
from kaggle_fixtures import KERNEL_ENV, USER, isolated_env, make_emulator, verify_warm  # noqa: F401
from byo_fixtures import RELAYED, copy_example, relay_in_shell

FRESH = {"fresh_prefect": True}  # a fresh machine: `relay run`'s Prefect migrates an empty database


def test_a_newcomer_relays_their_script_with_the_readme_commands(make_emulator, tmp_path, reference):
    emulator = make_emulator(kernel_env=dict(KERNEL_ENV))
    project = tmp_path / "my-project"
    copy_example("byo-plain", project, **RELAYED)
    # what the relayed weights are checked against: the same script trained straight (`relay train`, not one of
    # the README's commands: forked warm by the reference fixture, beside the relay), its spec outside the project
    straight = yaml.safe_load((project / "spec.yaml").read_text())
    straight["code"]["folder"] = str(project)
    straight_spec = tmp_path / "straight" / "spec.yaml"
    straight_spec.parent.mkdir()
    straight_spec.write_text(yaml.safe_dump(straight, sort_keys=False))
    reference.start(straight_spec)

    doctor = relay_in_shell(tmp_path, emulator, project, "doctor", "spec.yaml", "--poll", "0.2", **FRESH)
    assert doctor.returncode == 0 and "all checks passed" in doctor.stdout, doctor.stdout + doctor.stderr[-2000:]
    verify = relay_in_shell(tmp_path, emulator, project, "verify-resume", "spec.yaml", "--steps", "24", "--workdir",
                            "verify", env_extra=verify_warm(), **FRESH)  # forked warm: RELAY_WARM_MODULES
    assert verify.returncode == 0 and verify.stdout.startswith("identical"), verify.stdout + verify.stderr[-2000:]
    run = relay_in_shell(tmp_path, emulator, project, "run", "spec.yaml", "--poll", "0.3", **FRESH)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "done: step 60/60, 2 session(s) handed over" in run.stdout, run.stdout
    assert f"the final model: Kaggle dataset {USER}/byo-plain-model" in run.stdout, run.stdout
    outputs = project / "relay-runs" / "byo-plain"
    assert (outputs / "curves.png").is_file() and (outputs / "timeline.png").is_file()
    status = relay_in_shell(tmp_path, emulator, project, "status", "byo-plain", "--out", "status", **FRESH)
    assert status.returncode == 0 and "2 session(s) handed over" in status.stdout and "next: done" in status.stdout

    published = json.loads((outputs / "published" / "progress.json").read_text())
    assert published["weights_sha256"] == reference.weights(straight_spec)
    assert not list(REPO.glob("relay-runs")) and not (REPO / "examples" / "byo-plain" / "relay-runs").exists()


BROKEN = "    session.restore()  # relay\n"


def test_after_a_code_error_a_fixed_script_is_pushed_and_an_unchanged_one_is_refused(make_emulator, tmp_path,
                                                                                     prefect_server):
    """Its `relay run`s report to the worker's Prefect server (PREFECT_API_URL, as a user with a server exports it):
    the embedded Prefect's start is the newcomer's subject, not this one's."""
    emulator = make_emulator(kernel_env=dict(KERNEL_ENV))
    project = tmp_path / "my-project"
    spec = copy_example("byo-plain", project, **RELAYED)  # the fault's session is the last
    script = project / "train.py"
    good = script.read_text()
    assert BROKEN in good
    script.write_text(good.replace(BROKEN, BROKEN + "    if session.step >= 30:\n        raise KeyError('label')\n"))

    failed = relay_in_shell(tmp_path, emulator, project, "run", "spec.yaml", "--poll", "0.3", env_extra=prefect_server)
    assert failed.returncode == 1 and "relay: stopped: session 2 failed with a code error" in failed.stdout, \
        failed.stdout + failed.stderr[-3000:]
    versions = len(emulator.store.kernels[f"{USER}/byo-plain-session"]["versions"])

    again = relay_in_shell(tmp_path, emulator, project, "run", "spec.yaml", "--poll", "0.3", env_extra=prefect_server)
    assert again.returncode == 1 and "the code and spec are unchanged since that push" in again.stdout, again.stdout
    assert len(emulator.store.kernels[f"{USER}/byo-plain-session"]["versions"]) == versions  # nothing pushed

    script.write_text(good)  # the fix
    fixed = relay_in_shell(tmp_path, emulator, project, "run", "spec.yaml", "--poll", "0.3", env_extra=prefect_server)
    assert fixed.returncode == 0 and "done: step 60/60" in fixed.stdout, fixed.stdout + fixed.stderr[-3000:]
    runs = [v for v in emulator.store.kernels[f"{USER}/byo-plain-session"]["versions"]]
    sources = [(emulator.store.kernel_dir(f"{USER}/byo-plain-session", v["number"]) / "source.py").read_text()
               for v in runs]
    assert [s.split("# relay-run-id: ")[1].split("\n")[0] for s in sources] == [
        "byo-plain-s001-a1", "byo-plain-s002-a1", "byo-plain-s002-a2"]
    progress = json.loads((project / "relay-runs" / "byo-plain" / "published" / "progress.json").read_text())
    assert [s["step_start"] for s in progress["sessions"]] == [0, 30]  # session 2 again from step 30
    assert yaml.safe_load(spec.read_text())["name"] == "byo-plain"


def test_bad_input_to_the_new_commands_is_one_line_exit_2_and_writes_nothing(make_emulator, tmp_path,
                                                                             spawns_processes):
    emulator = make_emulator()
    project = tmp_path / "my-project"
    copy_example("byo-plain", project)
    (project / "not-a-folder").write_text("")
    (project / "bad.yaml").write_text("name: Bad Name\noptim: {max_steps: 10}\n")
    cases = {
        ("run", "nope.yaml"): "relay: error: nope.yaml: no such spec file (SPEC is relative to the current folder,",
        ("run", "spec.yaml", "--out", "not-a-folder"): "relay: error: --out not-a-folder: exists and is not a folder",
        ("run", "bad.yaml"): "relay: error: bad.yaml: name: String should match pattern",
        ("run", "spec.yaml", "--submit"): "relay: error: --submit: PREFECT_API_URL is not set (the Prefect server to",
        ("doctor", "nope.yaml"): "relay: error: nope.yaml: no such spec file",
        ("status", "Not A Name"): "relay: error: relay status: 'Not A Name' is neither a folder, a spec file nor",
        ("status", "no-such-relay"): "relay: error: relay status: no relay named no-such-relay for Kaggle user",
    }
    for args, expected in cases.items():
        out = relay_in_shell(tmp_path, emulator, project, *args, timeout=300)
        assert out.returncode == 2 and out.stderr.strip().startswith(expected) and "\n" not in out.stderr.strip(), \
            (args, out.stderr[-2000:])
    assert not (project / "relay-runs").exists() and not emulator.store.kernels  # nothing written, nothing pushed


def test_the_users_code_is_checked_once_where_the_spec_is_taken_in(tmp_path, monkeypatch):
    """`relay run` loads the spec before Prefect starts and hands the flow what it loaded: the user's code is
    import-checked once in the process, and the flow checks nothing again (relay.front_door.spec_at_flow); a spec
    loaded again (another process, a deployment's path) is checked again, a changed file with it."""
    from relay import front_door
    from relay.kernel import usercode

    checks = []
    real = usercode.check_code
    monkeypatch.setattr(usercode, "check_code", lambda spec, source: checks.append(source) or real(spec, source))
    spec = copy_example("byo-plain", tmp_path / "ex", **RELAYED)
    loaded = front_door.read_spec(spec)
    assert front_door.spec_at_flow(loaded) is loaded
    assert len(checks) == 1
    (spec.parent / "train.py").write_text((spec.parent / "train.py").read_text() + "\n# changed\n")
    front_door.spec_at_flow(str(spec))
    assert len(checks) == 2
