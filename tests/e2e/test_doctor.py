"""`relay doctor`: the checks a newcomer runs first, against the emulator (the real `kaggle` client, a real CPU
canary kernel that starts as a session does and is read back from its output)."""
from __future__ import annotations

import shutil
import subprocess
import sys

import yaml

from conftest import REPO
from kaggle_fixtures import FAKE_KEY, USER, backend_for, make_emulator, isolated_env  # noqa: F401
from relay import doctor


def _project(tmp_path, **kaggle):
    """examples/byo-plain copied outside the repository, with its spec's kaggle: section set."""
    folder = tmp_path / "my-project"
    shutil.copytree(REPO / "examples" / "byo-plain", folder)
    spec = yaml.safe_load((folder / "spec.yaml").read_text())
    spec["kaggle"] = {"enable_gpu": True, **kaggle}
    (folder / "spec.yaml").write_text(yaml.safe_dump(spec))
    return folder / "spec.yaml"


def _doctor(emulator, spec, monkeypatch):
    monkeypatch.setenv("KAGGLE_USERNAME", USER)
    monkeypatch.setenv("KAGGLE_KEY", FAKE_KEY)
    lines = []
    rc = doctor.run(str(spec) if spec else None, lambda: backend_for(emulator), timeout_s=120, poll_s=0.1,
                    emit=lines.append)
    return rc, "\n".join(lines)


def test_doctor_passes_with_a_canary_kernel_that_mounts_the_data(make_emulator, tmp_path, monkeypatch):
    emulator = make_emulator()
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.csv").write_text("x,y\n1,2\n")
    backend_for(emulator).publish_folder(data, f"{USER}/doctor-data", "doctor data")
    spec = _project(tmp_path, dataset_sources=[f"{USER}/doctor-data"])

    rc, out = _doctor(emulator, spec, monkeypatch)

    assert rc == 0, out
    assert f"user {USER}, from KAGGLE_USERNAME/KAGGLE_KEY" in out
    assert "h left this week" in out
    assert f"ok    data source      {USER}/doctor-data: " in out
    assert "ran on CPU (no GPU quota)" in out
    assert "spec and code" in out and "train.py --lr 0.003 imports and validates" in out
    assert f"ok      mount          {USER}/doctor-data at " in out
    assert "ok      imports        train.py: " in out
    # a canary is a CPU kernel: the GPU quota is untouched, and the key never travelled
    backend = backend_for(emulator)
    assert backend.quota().used_s == 0
    kernel = backend.client.run("pull", lambda api: api.kernels_pull(f"{USER}/byo-plain-doctor", path=str(tmp_path / "pulled")))
    assert FAKE_KEY not in "".join(p.read_text() for p in (tmp_path / "pulled").rglob("*.py")), kernel


def test_doctor_names_a_missing_data_source_and_what_to_do(make_emulator, tmp_path, monkeypatch):
    emulator = make_emulator()
    spec = _project(tmp_path, dataset_sources=[f"{USER}/no-such-data"])

    rc, out = _doctor(emulator, spec, monkeypatch)

    assert rc == 1, out
    assert f"FAIL  data source      {USER}/no-such-data: not found or not readable by this account" in out
    assert "info  canary kernel    not pushed: fix the data sources first" in out
    assert out.splitlines()[-1] == "1 check(s) failed"


def test_doctor_without_credentials_says_where_to_put_them(make_emulator, monkeypatch):
    emulator = make_emulator()
    lines = []
    rc = doctor.run(None, lambda: backend_for(emulator), emit=lines.append)
    assert rc == 1
    assert lines[0].startswith("FAIL  credentials") and "~/.kaggle/kaggle.json" in lines[0]


def test_doctor_refuses_a_missing_spec_in_one_line(tmp_path, spawns_processes):
    out = subprocess.run([sys.executable, "-m", "relay", "doctor", "nope.yaml"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, env={"PATH": "", "HOME": str(tmp_path),
                                                                          "PYTHONPATH": str(REPO)})
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == f"relay: error: nope.yaml: no such spec file (relative paths start at {tmp_path})"


def test_the_canary_finds_code_that_imports_only_on_this_machine(make_emulator, tmp_path, monkeypatch):
    """The entry imports a module that lives outside code.folder: the spec check passes here (it is on this
    machine's path) and fails inside the kernel, where only the shipped folder is: the canary says so."""
    emulator = make_emulator()
    spec = _project(tmp_path)
    (spec.parent / "mymain.py").write_text("import localonly\n\ndef main():\n    localonly.train()\n")
    data = yaml.safe_load(spec.read_text())
    data["code"]["entry"] = "mymain:main"
    spec.write_text(yaml.safe_dump(data))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "localonly.py").write_text("def train():\n    pass\n")
    monkeypatch.syspath_prepend(str(elsewhere))

    rc, out = _doctor(emulator, spec, monkeypatch)

    assert rc == 1, out
    assert "ok    spec " in out  # fine on this machine
    assert "FAIL    imports        ModuleNotFoundError: No module named 'localonly'" in out


def test_the_canary_finds_a_script_import_missing_in_the_kernel(make_emulator, tmp_path, monkeypatch):
    emulator = make_emulator()
    spec = _project(tmp_path)
    script = spec.parent / "train.py"
    script.write_text("import helpers_not_shipped\n" + script.read_text())

    rc, out = _doctor(emulator, spec, monkeypatch)

    assert rc == 1, out
    assert "FAIL    imports        ModuleNotFoundError: train.py imports helpers_not_shipped, not found" in out


def test_probe_shows_every_behaviour_as_expected_against_the_emulator_and_cleans_up(
        make_emulator, tmp_path, monkeypatch, spawns_processes):
    """`relay doctor --probe`, the command a user runs on their own account, against the emulator: every row as
    expected (the emulator holds to the record: docs/kaggle.md), its JSON report written, nothing left behind."""
    import json
    import os

    emulator = make_emulator()
    env = {**os.environ, "KAGGLE_USERNAME": USER, "KAGGLE_KEY": FAKE_KEY, "RELAY_KAGGLE_ENDPOINT": emulator.url}
    report = tmp_path / "probe.json"
    ran = subprocess.run([sys.executable, "-m", "relay", "doctor", "--probe", "--report", str(report), "--poll",
                          "0.1", "--timeout", "300"], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=600)
    assert ran.returncode == 0, ran.stdout + ran.stderr[-3000:]
    rows = json.loads(report.read_text())["rows"]
    assert [r["behaviour"] for r in rows] == [
        "absent kernel", "slug of a pushed title", "status through a run", "version addressing", "quota report",
        "small dataset version", "delete of a running kernel", "cleanup"]
    assert all(r["ok"] for r in rows), ran.stdout
    assert all(line.startswith("ok ") for line in ran.stdout.splitlines()[1:-1]), ran.stdout
    assert "0 difference(s); the report: " + str(report) in ran.stdout
    seen = {r["behaviour"]: r["seen"] for r in rows}
    assert seen["absent kernel"] == "403"
    assert seen["version addressing"] == "v1: version 1; slug/1: 403; '1': 404"
    assert seen["status through a run"].endswith("complete")
    assert not emulator.store.kernels and not emulator.store.datasets  # the probe deleted what it made
    assert FAKE_KEY not in ran.stdout + ran.stderr + report.read_text()


def test_probe_says_each_difference_in_one_line_and_exits_1(make_emulator, tmp_path):
    """An account whose Kaggle answers otherwise (here: the push of the running version refused, as a full
    session count would) gets the row marked, one line naming the difference, and exit status 1."""
    import json

    from relay.orchestrator import probe

    emulator = make_emulator(faults={"methods": {"SaveKernel": {"script": ["ok", "ok", "refused"]}}})
    lines = []
    rc = probe.probe(backend_for(emulator), report=tmp_path / "r.json", emit=lines.append, poll_s=0.05,
                     timeout_s=120, stamp="1")
    assert rc == 1
    differences = [line for line in lines if line.startswith("difference: ")]
    assert differences == [line for line in differences if line.startswith("difference: delete of a running"
                                                                            " kernel: expected it is gone;")]
    assert len(differences) == 1 and "seen push refused: " in differences[0], lines
    assert [r["ok"] for r in json.loads((tmp_path / "r.json").read_text())["rows"]].count(False) == 1
    assert not emulator.store.kernels and not emulator.store.datasets
