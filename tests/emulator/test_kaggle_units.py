"""Pieces of the backend on their own: retry policy, credential sources, code bundle, kernel source."""
from __future__ import annotations

import json
import random
import subprocess
import sys
import zipfile
import io

import pytest
import requests

from relay.emulator.faults import FaultPlan
from relay.orchestrator.kaggle import KaggleHTTPError, RetriesExhausted, RetryPolicy, SessionKernel
from relay.orchestrator.kaggle.bundle import build_bundle
from relay.orchestrator.kaggle.credentials import resolve
from relay.orchestrator.kaggle.kernel_source import find_plan, render, run_id_marker
from relay.orchestrator.kaggle.retry import call, is_transient, unless_absent
from relay.orchestrator.kaggle.types import KaggleError, NotFound
from relay.shared.errors import InputError
from relay.shared.session_plan import SessionPlan


def http_error(status: int, headers=None, body=b"{}") -> requests.HTTPError:
    response = requests.Response()
    response.status_code, response._content = status, body
    response.headers.update(headers or {})
    return requests.HTTPError(f"HTTP {status}", response=response)


def test_retry_honours_retry_after_and_is_bounded():
    sleeps = []
    policy = RetryPolicy(attempts=4, base_delay_s=0.01, max_delay_s=5, sleep=sleeps.append, rng=random.Random(0))
    outcomes = iter([http_error(429, {"Retry-After": "2"}), http_error(503), requests.ConnectionError("reset")])

    def flaky():
        exc = next(outcomes, None)
        if exc:
            raise exc
        return "ok"

    assert call(flaky, policy, "flaky") == "ok"
    assert sleeps[0] >= 2 and all(s < 1 for s in sleeps[1:]) and len(sleeps) == 3
    with pytest.raises(RetriesExhausted, match="gave up after 4 attempts"):
        call(lambda: (_ for _ in ()).throw(http_error(500)), policy, "always 500")
    asked = []
    with pytest.raises(KaggleHTTPError, match="^missing: HTTP 404$") as answered:  # an answer, not a glitch:
        call(lambda: asked.append(1) or (_ for _ in ()).throw(http_error(404)), policy, "missing")  # one line,
    assert len(asked) == 1 and answered.value.response.status_code == 404  # asked once, the response kept


def test_a_404_is_the_absent_answer_and_any_other_error_goes_up():
    def fails(exc):
        def call():
            raise exc
        return call

    assert unless_absent(lambda: "there", None) == "there"
    assert unless_absent(fails(http_error(404)), None) is None
    assert unless_absent(fails(http_error(200, body=b'{"code": 404}')), "absent") == "absent"  # 404 in a 200's body
    with pytest.raises(NotFound, match="^kernel a/b: not found$") as raised:
        unless_absent(fails(http_error(404)), NotFound("kernel a/b: not found"))
    assert raised.value.__cause__.response.status_code == 404  # the answer kept
    for other in (http_error(403), http_error(500), requests.ConnectionError("reset")):
        with pytest.raises(type(other)):
            unless_absent(fails(other), None)


def test_transient_classification_reads_json_error_code_on_http_200():
    assert is_transient(http_error(200, body=b'{"code": 500, "message": "Internal error"}'))
    assert not is_transient(http_error(200, body=b'{"code": 403, "message": "no"}'))
    assert is_transient(requests.ConnectionError()) and not is_transient(ValueError("bad"))


def test_credentials_from_env_and_kaggle_json(tmp_path):
    assert resolve(env={"KAGGLE_USERNAME": "u", "KAGGLE_KEY": "k"}).key == "k"
    token_file = tmp_path / "token"
    token_file.write_text("tok-1\n")
    assert resolve(env={"KAGGLE_API_TOKEN": str(token_file), "KAGGLE_USERNAME": "u"}).token == "tok-1"
    (tmp_path / "kaggle.json").write_text(json.dumps({"username": "j", "key": "jk"}))
    assert resolve(env={"KAGGLE_CONFIG_DIR": str(tmp_path)}).username == "j"
    with pytest.raises(InputError, match="no Kaggle credentials"):
        resolve(env={"HOME": str(tmp_path / "nowhere")})
    (tmp_path / "kaggle.json").write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        resolve(env={"KAGGLE_CONFIG_DIR": str(tmp_path)})


def test_bundle_is_deterministic_and_versioned_like_code_version(tmp_path, spawns_processes):
    bundle = build_bundle()
    names = zipfile.ZipFile(io.BytesIO(bundle.data)).namelist()
    # the kernel side, what `python -m relay train` enters by and what user code imports; the orchestrator stays home
    assert "relay/cli.py" in names and "relay/kernel/session/checkpoint.py" in names
    assert "relay/orchestrator/kaggle/kernel_source.py" not in names
    assert not any("__pycache__" in n for n in names)
    zipfile.ZipFile(io.BytesIO(bundle.data)).extractall(tmp_path)
    extracted = build_bundle(tmp_path / "relay")
    assert extracted.data == bundle.data and extracted.code_version == bundle.code_version
    inside = subprocess.run([sys.executable, "-c", "from relay.shared.version import code_version; print(code_version())"],
                            cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)},
                            capture_output=True, text=True, timeout=60)
    assert inside.stdout.strip() == bundle.code_version  # what a session records inside the kernel


def test_kernel_source_is_valid_python_with_marker_and_rejects_bad_run_ids(tmp_path):
    session = SessionKernel(kernel="u/k", title="Title", spec_text="name: x\n'quoted' \"both\"\n", run_id="r-1")
    source = render(session, build_bundle())
    compile(source, "session.py", "exec")
    assert run_id_marker("r-1") in source
    with pytest.raises(InputError, match="run id"):
        render(SessionKernel(kernel="u/k", title="Title", spec_text="", run_id="bad id; rm -rf"), build_bundle())


def test_kernel_source_runs_relay_with_the_plan_it_was_pushed_with(tmp_path, spawns_processes):
    """Run the generated script with a stand-in for `python -m relay`, and check the command it builds: the plan the
    orchestrator made, passed on as it is (the session finds the mounts: tests/shared/test_session_plan.py)."""
    bundle = build_bundle()
    session = SessionKernel(kernel="u/k", title="Title", spec_text="name: x\n", run_id="r-9", budget_s=30,
                            checkpoint_dataset="u/ckpt", data_dataset="u/data", features_datasets=("u/feat",))
    source = render(session, bundle).replace(
        'cmd = [sys.executable, "-m", "relay"',
        'cmd = [sys.executable, "-c", "import sys, json; json.dump(sys.argv, open(\'argv.json\', \'w\'))", "relay"')
    (tmp_path / "input" / "ckpt").mkdir(parents=True)
    (tmp_path / "input" / "data").mkdir()
    (tmp_path / "working").mkdir()
    (tmp_path / "session.py").write_text(source)
    env = {"PATH": "/usr/bin:/bin", "KAGGLE_INPUT_DIR": str(tmp_path / "input"),
           "KAGGLE_WORKING_DIR": str(tmp_path / "working")}
    done = subprocess.run([sys.executable, str(tmp_path / "session.py")], cwd=tmp_path / "working", env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    argv = json.loads((tmp_path / "working" / "argv.json").read_text())
    assert not {"--budget", "--run-id", "--resume-from", "--data", "--features"} & set(argv)  # one typed plan
    plan_file = argv[argv.index("--plan") + 1]
    plan = SessionPlan.read(plan_file)
    with open(plan_file) as f:  # the JSON the orchestrator embedded, byte for byte
        assert f.read() == json.dumps(find_plan(source), sort_keys=True)
    assert plan.resume == ("u/ckpt",) and plan.data == "u/data" and plan.features == ("u/feat",)
    assert plan.budget == 30.0 and plan.run_id == "r-9" and plan.deadline is None
    marker = json.loads((tmp_path / "working" / "relay-kernel.json").read_text())
    assert marker["run_id"] == "r-9" and marker["code_version"] == bundle.code_version


def test_fault_plan_replays_for_a_seed():
    spec = {"seed": 4, "methods": {"*": {"rate": 0.5}, "SaveKernel": {"script": ["lost", "ok"]}}}
    first, second = FaultPlan(spec), FaultPlan(spec)
    draws = [first.decide("GetKernel").kind for _ in range(50)]
    assert draws == [second.decide("GetKernel").kind for _ in range(50)]
    assert 10 < sum(d != "ok" for d in draws) < 40
    assert [first.decide("SaveKernel").kind for _ in range(2)] == ["lost", "ok"]
    with pytest.raises(InputError, match="unknown kind"):
        FaultPlan({"methods": {"X": {"script": ["boom"]}}})


def test_a_kagglesdk_without_the_endpoint_table_is_one_line(monkeypatch):
    """The emulator's address goes into kagglesdk's private kaggle_env._env_to_endpoint (pyproject.toml pins the
    versions that keep it); a kagglesdk laid out otherwise (stood in for here: only one version is installed) is
    one line naming the range, not a call that silently goes to kaggle.com."""
    from kagglesdk import kaggle_env

    from relay.orchestrator.kaggle import client

    monkeypatch.setattr(kaggle_env, "_env_to_endpoint", None)
    with pytest.raises(KaggleError, match=r"^kagglesdk: this version keeps no kaggle_env._env_to_endpoint table,"
                                          r" .*install kagglesdk>=0.1.30,<0.2$"):
        client._endpoints_per_thread()
