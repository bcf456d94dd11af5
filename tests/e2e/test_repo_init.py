"""`relay init` (relay/orchestrator/repo_init.py): a user's own repository made to relay itself from GitHub Actions.

Every generated workflow is linted with actionlint (with shellcheck where it is on PATH: actionlint skips that
rule without it, so a machine without shellcheck lints less but does not fail) and zizmor offline, default
persona: no finding above informational. The default install (no --wheel, no --git) is tested from a copy of this
checkout committed to a fresh git repository whose remote is a GitHub URL: `relay init` imported from it pins its
commit, and the workflow's own install step runs in a fresh venv, git redirected from the GitHub URL to the local
repository (url.insteadOf), offline (the package itself from that commit, its dependencies from the dev venv).
A --wheel's install step refuses the committed wheel once its bytes change (its sha256 is in the requirement).

The end-to-end relay test builds this package's wheel, runs `relay init --wheel` in a fresh git repository holding a
tiny script, checks the workflow's shape, then runs the workflow's own `run:` steps (their text, with their
`env:`) in a fresh virtual environment that has only the wheel installed (its dependencies come from the dev
venv: nothing is downloaded) against the Kaggle emulator, tick after tick, until the relay is done. Between
ticks it waits for the emulator's session to end (an event, not a timer). No schema of GitHub's workflow syntax
is available offline (none is vendored in site-packages), so the structure the relay relies on is checked with
a minimal JSON schema written here.
"""
from __future__ import annotations

import hashlib
import json
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
            "type": "object", "required": ["runs-on", "steps"], "properties": {"name": {"type": "string"},
                "runs-on": {"type": "string"}, "timeout-minutes": {"type": "integer", "minimum": 1},
                "env": {"type": "object", "additionalProperties": {"type": "string"}},
                "steps": {"type": "array", "items": {
                    "type": "object", "oneOf": [{"required": ["uses"]}, {"required": ["run"]}],
                    "properties": {"name": {"type": "string"},
                                   "uses": {"type": "string", "pattern": "^actions/[a-z-]+@[0-9a-f]{40}$"},
                                   "run": {"type": "string"}, "with": {"type": "object"},
                                   "env": {"type": "object", "additionalProperties": {"type": "string"}}},
                    "additionalProperties": False}}}}},
    },
}
_EXPRESSION = re.compile(r"\$\{\{\s*([^}]*?)\s*\}\}")
SOURCES = ("pyproject.toml", "README.md", "relay", "flows", "tasks")  # what a kaggle-relay build reads
GIT_ID = ["-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "init.defaultBranch=main"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """This package's wheel, built once from a copy of its sources (a build in the checkout leaves build/ behind,
    whose stale files a later build would pack)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    _copy_sources(src)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(root / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (built,) = (root / "dist").glob("kaggle_relay-*.whl")
    return built


def _copy_sources(to: Path) -> None:
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, to / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(REPO / name, to / name)


def _init(repo: Path, *args: str, relay_from: Path = REPO) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(repo.parent), "PYTHONPATH": str(relay_from)}
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


def _resolve(value: str, runner_temp: Path, workspace: Path) -> str:
    """A step's `env:` value with the only expressions the workflow may use: secrets.*, runner.temp and
    github.workspace (the checkout: the repository's root)."""
    def one(match: re.Match) -> str:
        expression = match.group(1)
        if expression.startswith("secrets."):
            return SECRETS[expression.removeprefix("secrets.")]
        known = {"runner.temp": runner_temp, "github.workspace": workspace}
        assert expression in known, f"an expression this test does not know: {expression}"
        return str(known[expression])
    return _EXPRESSION.sub(one, value)


def _step(step: dict, job_env: dict, base: dict, runner_temp: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**base, **{k: _resolve(v, runner_temp, cwd) for k, v in {**job_env, **step.get("env", {})}.items()}}
    script = runner_temp / "step.sh"
    script.write_text(step["run"])
    return subprocess.run(["bash", "-e", str(script)], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def _lint(workflow: Path) -> None:
    """actionlint and zizmor (offline, its default persona) find nothing above informational."""
    tools = Path(sys.executable).parent  # both are in the dev extra: the wheels carry the binaries
    env = {"PATH": "/usr/bin:/bin", "HOME": str(workflow.parents[3]), "NO_COLOR": "1"}
    lint = subprocess.run([str(tools / "actionlint"), "-no-color", str(workflow)], cwd=workflow.parents[2], env=env,
                          capture_output=True, text=True, timeout=120)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    audit = subprocess.run([str(tools / "zizmor"), "--offline", "--format", "json", str(workflow)], env=env,
                           capture_output=True, text=True, timeout=120)
    findings = json.loads(audit.stdout)
    above = [(f["ident"], f["determinations"]["severity"]) for f in findings
             if f["determinations"]["severity"] not in ("Informational", "Unknown")]
    assert above == [] and audit.returncode in (0, 11, 12), (above, audit.stderr[-2000:])


def _job(repo: Path) -> tuple[dict, dict]:
    """The generated workflow (checked against the schema) and its one job."""
    workflow = yaml.safe_load((repo / ".github/workflows/relay.yml").read_text())
    workflow["on"] = workflow.pop(True)  # YAML 1.1 reads the key `on` as true
    jsonschema.validate(workflow, WORKFLOW_SCHEMA)
    (job,) = workflow["jobs"].values()
    checkout = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/checkout@"))
    assert checkout["with"]["persist-credentials"] is False  # no token left in .git/config for the later steps
    return workflow, job


def test_init_writes_a_workflow_whose_steps_relay_the_repository_to_the_end(wheel, make_emulator, tmp_path):
    repo = tmp_path / "my-model"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "train.py").write_text(tiny_session_script())
    out = _init(repo, "--entry", "train.py", "--wheel", str(wheel))
    assert out.returncode == 0, out.stderr
    wheel_in_repo = f".github/relay/{wheel.name}"
    package = (f"kaggle-relay @ file://${{{{ github.workspace }}}}/{wheel_in_repo}"
               f"#sha256={hashlib.sha256(wheel.read_bytes()).hexdigest()}")  # pip checks it before installing
    assert f"the workflow installs {package}" in out.stdout
    assert (repo / wheel_in_repo).read_bytes() == wheel.read_bytes()

    workflow, job = _job(repo)
    _lint(repo / ".github/workflows/relay.yml")
    assert workflow["concurrency"]["group"] == "relay-my-model" and "workflow_dispatch" in workflow["on"]
    assert job["env"]["RELAY_PACKAGE"] == package and job["env"]["RELAY_VERSION"] == __version__
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
    git = ("--git", "https://github.com/me/kaggle-relay")  # where this checkout has no remote, the default has none
    bad = {("--entry", "nope.py", "--spec", "relay/spec.yaml", *git):
           "relay/spec.yaml: code.entry: nope.py not found in",
           ("--entry", "train.py", "--spec", "s.yaml", "--wheel", str(other)): f"--wheel: {other.name} is kaggle-relay"
           f" 9.9.9, this relay is {__version__}",
           ("--entry", "train.py", "--spec", "s.yaml", "--git", "github.com/me/relay"): "--git: 'github.com/me/relay'",
           ("--entry", "train.py", "--spec", "s.yaml", "--name", "My Model"): "--name: 'My Model' is not a relay name",
           ("--entry", "train.py", "--spec", "../s.yaml"): "--spec: ../s.yaml must be a .yaml path inside"}
    for args, expected in bad.items():
        code, err = _init_here(repo, monkeypatch, capsys, *args)
        assert code == 2 and len(err) == 1 and expected in err[0], (args, err)
    assert sorted(p.name for p in repo.iterdir()) == ["spec.yaml", "train.py"]  # nothing written, no folder left


@pytest.fixture
def relay_checkout(tmp_path, spawns_processes) -> tuple[Path, str]:
    """A copy of this checkout's sources committed to a fresh git repository, as a user's clone of kaggle-relay
    is (its remote is added by the test); its commit."""
    src = tmp_path / "kaggle-relay"
    src.mkdir()
    _copy_sources(src)
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "kaggle-relay"]):
        subprocess.run(["git", *GIT_ID, "-C", str(src), *args], check=True, capture_output=True, timeout=120)
    commit = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    return src, commit


def test_init_pins_the_commit_it_runs_from_and_the_workflows_install_step_installs_it(relay_checkout, tmp_path):
    src, commit = relay_checkout
    repo = tmp_path / "my-model"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "train.py").write_text(tiny_session_script())
    refused = _init(repo, "--entry", "train.py", relay_from=src)  # a clone with no remote: nothing to pin
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert all(part in refused.stderr for part in ("has no git remote", "--git URL@COMMIT", "--wheel FILE"))
    assert sorted(p.name for p in repo.iterdir()) == [".git", "train.py"]

    url = "https://github.com/example/kaggle-relay.git"
    subprocess.run(["git", "-C", str(src), "remote", "add", "origin", url], check=True)
    out = _init(repo, "--entry", "train.py", relay_from=src)
    package = f"kaggle-relay @ git+{url}@{commit}"
    assert out.returncode == 0 and f"the workflow installs {package}\n" in out.stdout, out.stdout + out.stderr
    assert "push it before the workflow's first tick" in out.stdout  # the commit is on no origin/* branch here
    _, job = _job(repo)
    assert job["env"]["RELAY_PACKAGE"] == package
    _lint(repo / ".github/workflows/relay.yml")

    # The workflow's own install step in a fresh venv: git fetches the GitHub URL from the local repository.
    venv = _venv(tmp_path / "runner-venv")
    runner_temp = tmp_path / "runner-temp"
    runner_temp.mkdir()
    base = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path / "home"), "TMPDIR": str(tmp_path),
            "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "PIP_NO_DEPS": "1",  # offline: the dependencies are the dev venv's (_venv)
            "PIP_NO_BUILD_ISOLATION": "0",  # pip's inverted switch: 0 builds with the dev venv's setuptools
            "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_COUNT": "1",
            "GIT_CONFIG_KEY_0": f"url.{src.as_uri()}.insteadOf", "GIT_CONFIG_VALUE_0": url}
    (install,) = [s for s in job["steps"] if s.get("name", "").startswith("Install kaggle-relay")]
    done = _step(install, job["env"], base, runner_temp, repo)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    helped = subprocess.run([str(venv / "bin/relay"), "--help"], env=base, cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)
    assert helped.returncode == 0 and "init" in helped.stdout, helped.stderr[-3000:]
    where = subprocess.run([str(venv / "bin/python"), "-c", "import relay; print(relay.__file__)"], env=base,
                           cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(venv)), where  # the relay installed from the pinned commit, not the checkout


def test_the_install_step_refuses_a_committed_wheel_whose_bytes_changed(wheel, tmp_path, spawns_processes):
    repo = tmp_path / "my-model"
    repo.mkdir()
    (repo / "train.py").write_text(tiny_session_script())
    assert _init(repo, "--entry", "train.py", "--wheel", str(wheel)).returncode == 0
    with open(repo / ".github/relay" / wheel.name, "ab") as committed:
        committed.write(b"\0")  # a zip still readable, but not the wheel `relay init` pinned
    _, job = _job(repo)
    (install,) = [s for s in job["steps"] if s.get("name", "").startswith("Install kaggle-relay")]
    venv = _venv(tmp_path / "runner-venv")
    base = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path / "home"), "TMPDIR": str(tmp_path),
            "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_NO_DEPS": "1"}
    done = _step(install, job["env"], base, tmp_path, repo)
    assert done.returncode != 0 and "THESE PACKAGES DO NOT MATCH THE HASHES" in done.stderr, done.stderr[-3000:]
    assert not list((venv / "lib").glob("python3*/site-packages/relay"))


@pytest.mark.parametrize("name", ["ci.yml", "relay-tick.yml"])
def test_the_projects_own_workflows_lint_clean(name, spawns_processes):
    """The project's own CI and tick workflows meet the bar the generated one does (pinned actions, no persisted
    checkout token, read-only permissions)."""
    _lint(REPO / ".github" / "workflows" / name)
