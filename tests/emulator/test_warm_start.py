"""Warm session starts (relay/shared/warm_zygote.py): a forked process is what `python ARGS` would have been,
and a kernel's `python -m relay ...` is forked into the session's process group, so the runner's signals and
kills reach it as they reach a real child."""
from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from relay.shared.warm_start import WarmStarter

pytestmark = pytest.mark.usefixtures("spawns_processes")

LAUNCHER = textwrap.dedent("""
    import json, os, signal, subprocess, sys
    child = subprocess.Popen([sys.executable, "-m", "relay.probe", *sys.argv[1:]], env={**os.environ, "PROBE": "1"})
    signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM))
    code = child.wait()
    real = subprocess.run([sys.executable, "-c", "import sys; print(sys.executable)"], capture_output=True, text=True)
    print(json.dumps({"pid": os.getpid(), "group": os.getpgid(0), "session": os.getsid(0), "child_code": code,
                      "executable": sys.executable, "real": real.stdout.strip(), "argv": sys.argv,
                      "torch_imported": "torch" in sys.modules, "relay_imported": "relay" in sys.modules}), flush=True)
    sys.exit(7)
""")

PROBE = textwrap.dedent("""
    import json, os, signal, sys, time
    print(json.dumps({"pid": os.getpid(), "parent": os.getppid(), "group": os.getpgid(0), "argv": sys.argv,
                      "cwd": os.getcwd(), "probe": os.environ.get("PROBE"), "name": __name__,
                      "path0": sys.path[0], "file": __file__}), flush=True)
    mode = sys.argv[1]
    if mode == "raise":
        raise RuntimeError("a bug in the user's code")
    if mode == "exit-hooks":
        import atexit, weakref
        class Kept: pass
        kept = Kept()
        atexit.register(print, "atexit handler ran", flush=True)
        weakref.finalize(kept, print, "finalizer ran", flush=True)
    if mode in ("sleep", "term"):
        if mode == "term":
            signal.signal(signal.SIGTERM, lambda *_: (print("saved on SIGTERM", flush=True), sys.exit(0)))
        open(os.path.join(os.getcwd(), "ready"), "w").close()
        time.sleep(120)
    sys.exit(5)
""")


@pytest.fixture(scope="module")
def starter():
    return WarmStarter.shared(["json"], {"PATH": os.environ["PATH"], "LANG": "C.UTF-8"})


def _session(tmp_path: Path, starter: WarmStarter, mode: str):
    bundle = tmp_path / "bundle" / "relay"
    bundle.mkdir(parents=True)
    (bundle / "__init__.py").write_text("")
    (bundle / "probe.py").write_text(PROBE)
    (tmp_path / "source.py").write_text(LAUNCHER)
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(tmp_path / "bundle"), "PYTHONUNBUFFERED": "1"}
    return starter.start(["-u", str(tmp_path / "source.py"), mode], tmp_path, env)


def _lines(stream) -> list[dict]:
    return [json.loads(line) for line in stream.read().decode().splitlines() if line.startswith("{")]


def test_a_warm_process_is_what_python_would_be_and_its_relay_child_is_forked_into_its_group(tmp_path, starter):
    proc = _session(tmp_path, starter, "exit")
    assert proc.wait(60) == 7
    probe, launcher = _lines(proc.stdout)
    assert launcher["group"] == launcher["session"] == launcher["pid"] == proc.pid  # its own session and group
    assert launcher["argv"] == [str(tmp_path / "source.py"), "exit"]
    assert launcher["relay_imported"] is False  # the zygote imports nothing of the relay: kernels bring theirs
    assert launcher["child_code"] == 5
    assert launcher["executable"] != sys.executable and launcher["real"] == sys.executable  # -c: the real one
    assert probe["parent"] == launcher["pid"] and probe["group"] == launcher["group"]
    assert probe["file"] == str(tmp_path / "bundle" / "relay" / "probe.py")  # from PYTHONPATH, as `python -m`
    assert probe["name"] == "__main__" and probe["argv"] == [probe["file"], "exit"]
    assert probe["path0"] == str(tmp_path) == probe["cwd"] and probe["probe"] == "1"


def test_an_uncaught_exception_exits_1_with_its_traceback(tmp_path, starter):
    proc = _session(tmp_path, starter, "raise")
    assert proc.wait(60) == 7
    assert _lines(proc.stdout)[-1]["child_code"] == 1
    assert "RuntimeError: a bug in the user's code" in proc.stderr.read().decode()


def test_a_warm_process_runs_its_own_atexit_handlers_and_finalizers_at_its_exit(tmp_path, starter):
    """As an interpreter's exit does; only the finalizers of the modules the zygote preloaded are left out."""
    proc = _session(tmp_path, starter, "exit-hooks")
    assert proc.wait(60) == 7
    out = proc.stdout.read().decode()
    assert "atexit handler ran" in out and "finalizer ran" in out
    assert json.loads(out.splitlines()[-1])["child_code"] == 5


def test_sigterm_reaches_the_forked_child_through_its_stand_in(tmp_path, starter):
    proc = _session(tmp_path, starter, "term")
    _wait_for(tmp_path / "ready")
    os.kill(proc.pid, signal.SIGTERM)  # the launcher forwards it to its child, the shim, which forwards it on
    assert proc.wait(60) == 7
    out = proc.stdout.read().decode().splitlines()
    assert "saved on SIGTERM" in out and json.loads(out[-1])["child_code"] == 0


def test_signals_sent_to_a_warm_process_go_to_its_main_thread_not_the_listeners(tmp_path, starter):
    """A real `python` launcher has one thread; a warm one also has the listener's (which forked its child). A
    SIGTERM one of those caught would wait for the main thread's next bytecode, never coming while it blocks in
    `child.wait()`: the launcher would not forward it (seen once on one core). The listener's threads block the
    signals a process is sent, so the kernel gives them to the main thread (the mask is what decides)."""
    proc = _session(tmp_path, starter, "sleep")
    _wait_for(tmp_path / "ready")
    try:
        blocked = {}
        for task in Path(f"/proc/{proc.pid}/task").iterdir():
            status = (task / "status").read_text()
            mask = int(next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16)
            blocked[int(task.name)] = {sig for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
                                       if mask & (1 << (sig - 1))}
        assert blocked.pop(proc.pid) == set()  # the program's own thread takes them
        assert len(blocked) >= 2 and all(sigs == {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
                                         for sigs in blocked.values()), blocked  # the listener, the child's server
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(60)


def test_killing_the_session_group_kills_the_forked_child(tmp_path, starter):
    proc = _session(tmp_path, starter, "sleep")
    _wait_for(tmp_path / "ready")
    probe = json.loads(proc.stdout.readline())
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(60) == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while _alive(probe["pid"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(probe["pid"])


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def test_a_warm_process_writes_where_it_is_told_and_has_its_own_tmpdir_and_random_state(tmp_path, starter):
    """The zygote made a temporary folder (gettempdir() is cached) and its random generator has a state: a fork
    must read TMPDIR and seed from the OS as a fresh interpreter does. `output`: stdout and stderr into one file
    (the tests' flow processes write their logs so)."""
    code = ("import json, random, sys, tempfile; print(json.dumps({'tmp': tempfile.gettempdir(),"
            " 'draw': random.random()})); print('to stderr', file=sys.stderr)")
    seen = []
    for run in ("a", "b"):
        (tmp_path / run).mkdir()
        with open(tmp_path / run / "log", "w") as log:
            proc = starter.start(["-c", code], tmp_path, {"PATH": os.environ["PATH"], "TMPDIR": str(tmp_path / run)},
                                 output=log.fileno())
        assert proc.stdout is None and proc.wait(60) == 0
        lines = (tmp_path / run / "log").read_text().splitlines()
        seen += [json.loads(line) for line in lines if line.startswith("{")]
        assert seen[-1]["tmp"] == str(tmp_path / run) and "to stderr" in lines
    assert seen[0]["draw"] != seen[1]["draw"]


def test_a_signal_sent_before_the_stand_in_knows_its_process_is_forwarded_not_fatal(tmp_path):
    """The stand-in (relay/shared/warm_python.py) learns the forked process's pid from the listener's reply; the
    process may already run, and be sent a SIGTERM through the stand-in, before that reply is read (seen once
    under load: the stand-in died of it and the session never saved). A listener played here answers only after
    the signal was sent: the signal must reach the process, and the stand-in end as it did."""
    import socket
    import subprocess

    from relay.shared.warm_start import ZYGOTE

    address = f"relay-test-shim-{os.getpid()}-{time.monotonic_ns()}"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind("\0" + address)
    server.listen(1)
    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # the "forked" process
    shim = subprocess.Popen([sys.executable, "-SE", str(ZYGOTE.with_name("warm_python.py")), "-m", "relay", "x"],
                            env={"PATH": os.environ["PATH"], "RELAY_WARM_SOCKET": address})
    try:
        conn, _ = server.accept()
        request, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
        for fd in fds:
            os.close(fd)
        assert json.loads(request)["argv"] == ["-m", "relay", "x"]
        shim.send_signal(signal.SIGTERM)  # it waits for the reply: the pid it stands for is not known yet
        assert target.poll() is None
        conn.sendall(json.dumps({"pid": target.pid}).encode() + b"\n")
        assert target.wait(60) == -signal.SIGTERM  # forwarded once the pid was known
        conn.sendall(json.dumps({"exit": -signal.SIGTERM}).encode() + b"\n")
        assert shim.wait(60) == -signal.SIGTERM  # and it ends as its process did
    finally:
        for proc in (target, shim):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        server.close()
