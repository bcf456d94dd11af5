"""`relay init` (relay/orchestrator/repo_init.py): a user's own repository made to relay itself from GitHub Actions.

The end-to-end test builds this package's wheel, runs `relay init --wheel` in a fresh git repository holding a
tiny script, checks the workflow's shape, then runs the workflow's own `run:` steps (their text, with their
`env:`) in a fresh virtual environment that has only the wheel installed (its dependencies come from the dev
venv: nothing is downloaded) against the Kaggle emulator, tick after tick, until the relay is done. Between
ticks it waits for the emulator's session to end (an event, not a timer). No schema of GitHub's workflow syntax
is available offline (none is vendored in site-packages), so the structure the relay relies on is checked with
a minimal JSON schema written here.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

import prefect_template
from byo_fixtures import tiny_session_script
from kaggle_fixtures import FAKE_KEY, KERNEL_ENV, USER, isolated_env, make_emulator  # noqa: F401
from relay import __version__
from relay.orchestrator import repo_init
from relay.shared.errors import InputError
from relay_fixtures import wait_for

REPO = Path(__file__).resolve().parents[2]
SECRETS = {"KAGGLE_USERNAME": USER, "KAGGLE_KEY": FAKE_KEY}
LENGTHS = {"optim": {"max_steps": 60}, "session": {"max_steps": 30, "threads": 1, "safety_margin": "0.5s"},
           "kaggle": {"session_timeout": "5m", "startup_overhead": "1s"}}

# What the relay relies on in its workflow (GitHub's full schema is not available offline: see the docstring).
WORKFLOW_SCHEMA = {
    "type": "object", "required": ["name", "on", "concurrency", "jobs", "permissions"],
    "properties": {
        "on": {"type": "object", "required": ["schedule", "workflow_dispatch"], "properties": {
            "schedule": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["cron"], "additionalProperties": False,
                "properties": {"cron": {"type": "string", "pattern": r"^\S+ \S+ \S+ \S+ \S+$"}}}}}},
        "permissions": {"const": {"contents": "read"}},
        "concurrency": {"type": "object", "required": ["group", "cancel-in-progress"], "additionalProperties": False,
                        "properties": {"group": {"type": "string", "minLength": 1},
                                       "cancel-in-progress": {"const": False}}},
        "jobs": {"type": "object", "minProperties": 1, "maxProperties": 1, "additionalProperties": {
            "type": "object", "required": ["runs-on", "steps"], "properties": {
                "runs-on": {"type": "string"}, "timeout-minutes": {"type": "integer", "minimum": 1},
                "env": {"type": "object", "additionalProperties": {"type": "string"}},
                "steps": {"type": "array", "items": {
                    "type": "object", "oneOf": [{"required": ["uses"]}, {"required": ["run"]}],
                    "properties": {"name": {"type": "string"}, "uses": {"type": "string", "pattern": "^[^@]+@v[0-9]+$"},
                                   "run": {"type": "string"}, "with": {"type": "object"},
                                   "env": {"type": "object", "additionalProperties": {"type": "string"}}},
                    "additionalProperties": False}}}}},
    },
}
_EXPRESSION = re.compile(r"\$\{\{\s*([^}]*?)\s*\}\}")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """This package's wheel, built once from a copy of its sources (a build in the checkout leaves build/ behind,
    whose stale files a later build would pack)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for package in ("relay", "flows", "tasks"):
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(root / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (built,) = (root / "dist").glob("kaggle_relay-*.whl")
    return built


def _init(repo: Path, *args: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(repo.parent), "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "relay", "init", *args], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=120)


def _venv(root: Path) -> Path:
    """A fresh venv whose own site-packages is empty; the dev venv's site-packages after it (a .pth line), for
    the dependencies and pip (its .pth files, the checkout's editable install among them, are not processed)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    site = next((root / "lib").glob("python3*/site-packages"))
    import sysconfig

    (site / "dev-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return root


def _resolve(value: str, runner_temp: Path) -> str:
    """A step's `env:` value with the only expressions the workflow may use: secrets.* and runner.temp."""
    def one(match: re.Match) -> str:
        expression = match.group(1)
        if expression.startswith("secrets."):
            return SECRETS[expression.removeprefix("secrets.")]
        assert expression == "runner.temp", f"an expression this test does not know: {expression}"
        return str(runner_temp)
    return _EXPRESSION.sub(one, value)


def _step(step: dict, job_env: dict, base: dict, runner_temp: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**base, **{k: _resolve(v, runner_temp) for k, v in {**job_env, **step.get("env", {})}.items()}}
    script = runner_temp / "step.sh"
    script.write_text(step["run"])
    return subprocess.run(["bash", "-e", str(script)], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def test_init_writes_a_workflow_whose_steps_relay_the_repository_to_the_end(wheel, make_emulator, tmp_path):
    repo = tmp_path / "my-model"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "train.py").write_text(tiny_session_script())
    out = _init(repo, "--entry", "train.py", "--wheel", str(wheel))
    assert out.returncode == 0, out.stderr
    wheel_in_repo = f".github/relay/{wheel.name}"
    assert f"the workflow installs ./{wheel_in_repo}" in out.stdout
    assert (repo / wheel_in_repo).read_bytes() == wheel.read_bytes()

    workflow = yaml.safe_load((repo / ".github/workflows/relay.yml").read_text())
    workflow["on"] = workflow.pop(True)  # YAML 1.1 reads the key `on` as true
    jsonschema.validate(workflow, WORKFLOW_SCHEMA)
    assert workflow["concurrency"]["group"] == "relay-my-model" and "workflow_dispatch" in workflow["on"]
    (job,) = workflow["jobs"].values()
    assert job["env"]["RELAY_PACKAGE"] == f"./{wheel_in_repo}" and job["env"]["RELAY_VERSION"] == __version__
    runs = [s for s in job["steps"] if "run" in s]
    assert len(runs) == 2 and all("${{" not in s["run"] for s in runs)  # values reach scripts through env only
    install, tick = runs
    assert {k: v for k, v in tick["env"].items() if k.startswith("KAGGLE_")} == {
        "KAGGLE_USERNAME": "${{ secrets.KAGGLE_USERNAME }}", "KAGGLE_KEY": "${{ secrets.KAGGLE_KEY }}"}
    assert "relay run \"$RELAY_SPEC\" --tick" in tick["run"]

    # the spec skeleton loads; shortened here to two step-bounded sessions
    spec = repo / "spec.yaml"
    data = yaml.safe_load(spec.read_text())
    assert data["name"] == "my-model" and data["code"] == {"folder": ".", "entry": "train.py", "exclude": []}
    for section, values in LENGTHS.items():
        data[section].update(values)
    spec.write_text(yaml.safe_dump(data, sort_keys=False))

    emulator = make_emulator(kernel_env=dict(KERNEL_ENV))
    venv = _venv(tmp_path / "runner-venv")
    runner_temp = tmp_path / "runner-temp"
    runner_temp.mkdir()
    prefect_template.migrated(runner_temp / "prefect")  # a migrated database, as a warm runner would have none of
    summary = runner_temp / "summary.md"
    base = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path / "home"), "TMPDIR": str(tmp_path / "tmp"),
            "RUNNER_TEMP": str(runner_temp), "GITHUB_STEP_SUMMARY": str(summary),
            "PIP_NO_DEPS": "1", "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1",  # offline: the wheel only
            "RELAY_KAGGLE_ENDPOINT": emulator.url,  # the test's stand-in for api.kaggle.com
            "OMP_NUM_THREADS": "1", "MPLCONFIGDIR": str(tmp_path / "mpl"),
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "600"}  # a busy 2-core machine
    done = _step(install, job["env"], base, runner_temp, repo)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    where = subprocess.run([str(venv / "bin/python"), "-c", "import relay; print(relay.__file__)"], env=base,
                           cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(venv)), where  # the relay that ticks is the wheel's, not the checkout

    kernel, outputs = f"{USER}/my-model-session", []
    for _ in range(6):  # 2 sessions: push, hand over + push, hand over (done); a bound, not a count to reach
        ticked = _step(tick, job["env"], base, runner_temp, repo)
        outputs.append(ticked.stdout + ticked.stderr)
        assert ticked.returncode == 0, outputs[-1][-3000:]
        if "done: step 60/60" in ticked.stdout:
            break
        wait_for(lambda: emulator.store.kernels[kernel]["versions"][-1]["status"] in ("COMPLETE", "ERROR"), 900,
                 "the session the tick pushed to end")
    assert "done: step 60/60" in outputs[-1], outputs
    assert len(outputs) == 3  # each tick did what needed no waiting: push; hand over and push; hand over (done)
    versions = emulator.store.kernels[kernel]["versions"]
    assert [v["status"] for v in versions] == ["COMPLETE", "COMPLETE"]
    text = "".join(outputs) + summary.read_text()
    assert FAKE_KEY not in text  # the key is never echoed (GitHub masks secrets too; nothing relies on it)
    assert "done: step 60/60" in summary.read_text()


def _init_here(repo: Path, monkeypatch, capsys, *args: str) -> tuple[int, list[str]]:
    from relay.cli import main

    monkeypatch.chdir(repo)
    monkeypatch.setattr("sys.path", list(sys.path))  # the front door puts code.folder on it
    code = main(["init", *args])
    return code, capsys.readouterr().err.strip().splitlines()


def test_init_refuses_to_overwrite_and_names_bad_options(tmp_path, monkeypatch, capsys):
    repo = tmp_path / "proj"
    repo.mkdir()
    (repo / "train.py").write_text("print(1)\n")
    (repo / "spec.yaml").write_text("mine\n")
    assert _init_here(repo, monkeypatch, capsys, "--entry", "train.py") == (2, [
        "relay: error: spec.yaml: already exists in .; relay init writes only new files (move it away, or pick"
        " another --spec)"])
    assert (repo / "spec.yaml").read_text() == "mine\n" and not (repo / ".github").exists()
    other = tmp_path / "kaggle_relay-9.9.9-py3-none-any.whl"
    other.write_bytes(b"")
    bad = {("--entry", "nope.py", "--spec", "relay/spec.yaml"): "relay/spec.yaml: code.entry: nope.py not found in",
           ("--entry", "train.py", "--spec", "s.yaml", "--wheel", str(other)): f"--wheel: {other.name} is kaggle-relay"
           f" 9.9.9, this relay is {__version__}",
           ("--entry", "train.py", "--spec", "s.yaml", "--git", "github.com/me/relay"): "--git: 'github.com/me/relay'",
           ("--entry", "train.py", "--spec", "s.yaml", "--name", "My Model"): "--name: 'My Model' is not a relay name",
           ("--entry", "train.py", "--spec", "../s.yaml"): "--spec: ../s.yaml must be a .yaml path inside"}
    for args, expected in bad.items():
        code, err = _init_here(repo, monkeypatch, capsys, *args)
        assert code == 2 and len(err) == 1 and expected in err[0], (args, err)
    assert sorted(p.name for p in repo.iterdir()) == ["spec.yaml", "train.py"]  # nothing written, no folder left


def test_install_pins_this_version_from_pypi_or_a_git_tag(tmp_path):
    (tmp_path / "t.py").write_text("")
    assert repo_init.plan(tmp_path, "t.py", "1.2.3").install == "kaggle-relay==1.2.3"
    git = repo_init.plan(tmp_path, "t.py", "1.2.3", git="https://github.com/me/kaggle-relay").install
    assert git == "kaggle-relay @ git+https://github.com/me/kaggle-relay@v1.2.3"
    ssh = repo_init.plan(tmp_path, "t.py", "1.2.3", git="ssh://git@github.com/me/kaggle-relay@abc123").install
    assert ssh == "kaggle-relay @ git+ssh://git@github.com/me/kaggle-relay@abc123"
    with pytest.raises(InputError, match="--wheel, --git: give one"):
        repo_init.plan(tmp_path, "t.py", "1.2.3", wheel=tmp_path / "x.whl", git="https://h/x")
    assert os.listdir(tmp_path) == ["t.py"]  # plan writes nothing
