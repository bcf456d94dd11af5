"""The unmodified `kaggle` CLI, in a subprocess, against `python -m relay.emulator serve` (also a
subprocess), configured only by the export lines the emulator printed."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kaggle_fixtures import run_kaggle


def start_serve(state: Path, *flags: str) -> tuple:
    proc = subprocess.Popen([sys.executable, "-m", "relay.emulator", "serve", "--port", "0",
                             "--state", str(state), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    exports = {}
    deadline = time.time() + 120  # a hang guard, generous for a slow machine
    while time.time() < deadline:
        line = proc.stdout.readline()
        if line.startswith("# Kaggle emulator on"):
            return proc, exports
        match = re.match(r"export (\w+)=(\S+)", line)
        if match:
            exports[match.group(1)] = match.group(2)
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"emulator did not start: {proc.stderr.read()}")


def stop_serve(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture
def served(tmp_path, spawns_processes):
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    tmp.mkdir()
    procs = []

    def start(*flags: str) -> dict:
        proc, exports = start_serve(tmp_path / "state", *flags)
        procs.append(proc)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("KAGGLE_") and k.lower() not in ("http_proxy", "https_proxy", "no_proxy")}
        env.update(exports, HOME=str(home), TMPDIR=str(tmp))
        return env

    yield start, procs
    for proc in procs:
        stop_serve(proc)


def write_dataset(folder: Path, ref: str, payload: bytes) -> None:
    (folder / "sub").mkdir(parents=True, exist_ok=True)
    (folder / "ckpt.bin").write_bytes(payload)
    (folder / "meta.csv").write_text("a,b\n1,2\n")
    (folder / "sub" / "notes.txt").write_text("nested\n")
    (folder / "dataset-metadata.json").write_text(json.dumps(
        {"id": ref, "title": "Stage 0 checkpoint", "licenses": [{"name": "CC0-1.0"}]}))


def test_serve_prints_exports_and_generates_a_persistent_local_user(served, tmp_path):
    start, procs = served
    env = start()
    assert env["KAGGLE_API_ENVIRONMENT"] == "LOCALHOST" and env["HTTP_PROXY"].startswith("http://127.0.0.1:")
    assert env["KAGGLE_USERNAME"] == "relay" and len(env["KAGGLE_KEY"]) == 32
    stop_serve(procs.pop())
    assert start()["KAGGLE_KEY"] == env["KAGGLE_KEY"]  # restart: same local user


def test_kaggle_cli_datasets_kernels_quota_and_restart(served, tmp_path):
    start, procs = served
    env = start("--user", "alice", "--key", "cli-key-123")
    work = tmp_path / "work"
    ds = work / "ds"
    write_dataset(ds, "alice/stage-0-ckpt", os.urandom(5000))

    created = run_kaggle(env, "datasets", "create", "-p", str(ds), "--dir-mode", "zip")
    assert "Your private Dataset is being created" in created.stdout, created.stderr
    status = run_kaggle(env, "datasets", "status", "alice/stage-0-ckpt")
    assert status.stdout.strip() == "ready"
    files = run_kaggle(env, "datasets", "files", "alice/stage-0-ckpt").stdout
    assert re.search(r"ckpt\.bin\s+5000", files) and "sub/notes.txt" in files and "meta.csv" in files

    v2 = os.urandom(7000)
    (ds / "ckpt.bin").write_bytes(v2)
    version = run_kaggle(env, "datasets", "version", "-p", str(ds), "-m", "stage 1", "--dir-mode", "zip")
    assert "Dataset version is being created" in version.stdout, version.stderr
    download = run_kaggle(env, "datasets", "download", "alice/stage-0-ckpt", "-p", str(work / "dl"), "--unzip")
    assert download.returncode == 0, download.stderr
    assert (work / "dl" / "ckpt.bin").read_bytes() == v2
    assert (work / "dl" / "sub" / "notes.txt").read_text() == "nested\n"
    one = run_kaggle(env, "datasets", "download", "alice/stage-0-ckpt", "-f", "meta.csv", "-p", str(work / "one"))
    assert one.returncode == 0, one.stderr
    assert (work / "one" / "meta.csv").read_text() == "a,b\n1,2\n"
    meta = run_kaggle(env, "datasets", "metadata", "alice/stage-0-ckpt", "-p", str(work / "meta"))
    assert "Downloaded metadata" in meta.stdout, meta.stderr
    info = json.loads((work / "meta" / "dataset-metadata.json").read_text())["info"]
    assert info["title"] == "Stage 0 checkpoint" and info["licenses"] == [{"name": "CC0-1.0"}]

    kern = work / "kern"
    kern.mkdir()
    (kern / "run.py").write_text(
        "import os\n"
        "mounted = os.path.join(os.environ['KAGGLE_INPUT_DIR'], 'stage-0-ckpt')\n"
        "print('sizes', os.path.getsize(os.path.join(mounted, 'ckpt.bin')))\n"
        "os.makedirs('sub', exist_ok=True)\n"
        "open('sub/metrics.json', 'w').write('{\"loss\": 1}')\n"
        "open('model.pt', 'w').write('weights')\n")
    (kern / "kernel-metadata.json").write_text(json.dumps({
        "id": "alice/train-stage-1", "title": "Train Stage 1", "code_file": "run.py", "language": "python",
        "kernel_type": "script", "is_private": True, "enable_gpu": True, "enable_internet": False,
        "dataset_sources": ["alice/stage-0-ckpt"], "machine_shape": "NvidiaTeslaT4"}))
    pushed = run_kaggle(env, "kernels", "push", "-p", str(kern))
    assert "Kernel version 1 successfully pushed" in pushed.stdout, pushed.stderr
    deadline = time.time() + 120  # a hang guard, generous for a slow machine
    while "COMPLETE" not in (status := run_kaggle(env, "kernels", "status", "alice/train-stage-1").stdout):
        assert time.time() < deadline and "ERROR" not in status, status
        time.sleep(0.3)
    out = work / "out"
    output = run_kaggle(env, "kernels", "output", "alice/train-stage-1", "-p", str(out))
    assert "Output file downloaded" in output.stdout, output.stderr
    assert (out / "model.pt").read_text() == "weights"
    assert json.loads((out / "sub" / "metrics.json").read_text()) == {"loss": 1}
    log = json.loads((out / "train-stage-1.log").read_text())
    assert any("sizes 7000" in entry["data"] for entry in log)  # mounted the newest READY version
    pulled = run_kaggle(env, "kernels", "pull", "alice/train-stage-1", "-p", str(work / "pulled"), "-m")
    assert "downloaded to" in pulled.stdout, pulled.stderr
    meta = json.loads((work / "pulled" / "kernel-metadata.json").read_text())
    assert meta["enable_gpu"] is True and meta["enable_internet"] is False
    assert meta["dataset_sources"] == ["alice/stage-0-ckpt"]
    assert (work / "pulled" / "train-stage-1.py").read_text() == (kern / "run.py").read_text()
    quota = run_kaggle(env, "quota").stdout
    assert re.search(r"GPU\s+\d+\.\d\dh\s+\d+\.\d\dh\s+30\.00h", quota), quota

    bad = dict(env, KAGGLE_KEY="wrong")
    denied = run_kaggle(bad, "datasets", "status", "alice/stage-0-ckpt")
    assert denied.returncode != 0 and re.search(r"401|Authentication required", denied.stdout + denied.stderr)

    stop_serve(procs.pop())  # a restarted emulator keeps datasets and kernels
    env = start("--user", "alice", "--key", "cli-key-123")
    assert run_kaggle(env, "datasets", "status", "alice/stage-0-ckpt").stdout.strip() == "ready"
    assert "COMPLETE" in run_kaggle(env, "kernels", "status", "alice/train-stage-1").stdout
    files = run_kaggle(env, "datasets", "files", "alice/stage-0-ckpt").stdout
    assert re.search(r"ckpt\.bin\s+7000", files)


def test_cli_push_refusal_exits_zero_but_says_why(served, tmp_path):
    """The CLI's exit code lies (the backend reads the response); the emulator gives the real message."""
    start, _ = served
    env = start("--user", "alice", "--key", "k", "--max-gpu-sessions", "0")
    kern = tmp_path / "k"
    kern.mkdir()
    (kern / "run.py").write_text("print(1)\n")
    (kern / "kernel-metadata.json").write_text(json.dumps({
        "id": "alice/gpu-kernel", "title": "GPU kernel", "code_file": "run.py", "language": "python",
        "kernel_type": "script", "enable_gpu": True, "enable_internet": False}))
    pushed = run_kaggle(env, "kernels", "push", "-p", str(kern))
    assert pushed.returncode == 0
    assert "Maximum batch GPU session count of 0 reached." in pushed.stdout


def test_serve_accepts_several_accounts_from_flags_or_its_config(served, tmp_path):
    """A team's shape on one emulator: two accounts, each answered as itself (its own quota view), a third refused;
    the config's `users` are honoured when no --user is given (issue 60)."""
    start, procs = served
    env = start("--user", "ann:key-a", "--user", "bob:key-b")
    assert env["KAGGLE_USERNAME"] == "ann" and env["KAGGLE_KEY"] == "key-a"
    for user, key in (("ann", "key-a"), ("bob", "key-b")):
        quota = run_kaggle(dict(env, KAGGLE_USERNAME=user, KAGGLE_KEY=key), "quota")
        assert quota.returncode == 0 and re.search(r"GPU\s+\d", quota.stdout), quota.stdout + quota.stderr
    refused = run_kaggle(dict(env, KAGGLE_USERNAME="bob", KAGGLE_KEY="key-a"), "quota")
    assert refused.returncode != 0 or "401" in refused.stdout + refused.stderr
    stop_serve(procs.pop())
    config = tmp_path / "team.json"
    config.write_text(json.dumps({"users": {"cy": "key-c", "dee": "key-d"}}))
    env = start("--config", str(config))
    assert (env["KAGGLE_USERNAME"], env["KAGGLE_KEY"]) == ("cy", "key-c")
    assert run_kaggle(dict(env, KAGGLE_USERNAME="dee", KAGGLE_KEY="key-d"), "quota").returncode == 0


@pytest.mark.parametrize("flags, error", [
    (["--user", "ann"], "--user 'ann': expected NAME:KEY (or --user NAME --key KEY)"),
    (["--user", "ann:a", "--user", "ann:b"], "--user ann: given twice"),
    (["--user", "ann:a", "--key", "k"], "--key goes with a single --user NAME; for several accounts use --user"
                                        " NAME:KEY each"),
    (["--key", "k"], "--key KEY needs --user NAME"),
])
def test_a_wrong_account_flag_is_one_line(tmp_path, flags, error, capsys):
    from relay.emulator.serve_command import main

    assert main(["serve", "--state", str(tmp_path), *flags]) == 2
    assert capsys.readouterr().err == f"relay emulator: error: {error}\n"
