"""The zygote of warm kernel starts: a process that imported torch once and forks each session's processes.

A toy session's `relay train` spends ~3.5 CPU s before its first step: `import torch` (1.5 s) and, at its first
optimizer, `torch._dynamo` (1.6 s); the tests and the demo start hundreds of them on 2 cores. A process forked
from here has them imported already, and is otherwise made what `python ARGS` would have made it (`become`):
its own stdio, working folder, environment, signal dispositions, `sys.argv`, `sys.path` and a fresh `__main__`;
at its end threads are joined, atexit handlers run and stdio flushed, as at an interpreter's exit.

Run as a script (`python warm_zygote.py FD MODULE...`; imported only for its constants): this file imports only
the standard library, so every module not named is imported by the forked program itself (a kernel imports the
relay from its own bundle, as on Kaggle). The zygote only imports: CUDA initialized before a fork is unusable
in the child, so a zygote whose modules initialized it refuses to start. The ways in, each answered by a fork:
- warm_start.py asks on socket FD for a process: the emulator's runner for a session's launcher, `python -u
  source.py`; `relay verify-resume` (RELAY_WARM_MODULES) for each of its `relay train` sessions. It is forked
  here into a session and process group of its own, as subprocess.Popen(start_new_session=True) would.
- inside that session, `sys.executable` is the shim warm_python.py. When the launcher (or anything below it)
  runs `python -m relay ...`, the shim asks the launcher's own process (a listener thread started in `become`),
  which forks it from itself. So the new process is in the session's process group, dies with it and is
  signalled with it, as the real child would be; the shim stands for it (its pid, its signals, its exit code).
  Any other command line (pip, a multiprocessing forkserver that inherits descriptors) runs the real interpreter.
- `python warm_zygote.py --listen MODULE...` is only that listener, for the processes of its own session: the
  tests' `python -m relay ...` runs (tests/kaggle_fixtures.py `warm_python`).
"""
from __future__ import annotations

import atexit
import io
import json
import os
import random
import runpy
import selectors
import signal
import socket
import struct
import sys
import tempfile
import threading
import traceback
import types
import weakref

SOCKET_VARIABLE = "RELAY_WARM_SOCKET"  # a process's way to the listener of its session (abstract unix socket)
MAX_MESSAGE = 1 << 22
BASE_PATH: list[str] = []              # sys.path of an interpreter started with no PYTHONPATH (set by main)
SHIM = ""                              # the `python` a warm process names as sys.executable (set by main)
_INHERITED_STDIO: list = []
_PRELOADED_FINALIZERS: list = []        # weakref.finalize objects the preloaded modules made (set by _prepare)
# c10/core/GeneratorImpl.h default_rng_seed_val: the seed torch's default CPU generator is built with. torch 2.13
# then seeds it from the OS as its extension loads (`python -c "import torch; print(torch.initial_seed())"` differs
# run to run); a torch that does not starts every interpreter at this one.
TORCH_BUILT_IN_SEED = 67280421310721
_RESEED_TORCH = [False]                 # torch seeded itself at load: so does each fork (set by _check_torch)


# -- what `python ARGS` would be --------------------------------------------------------------------------
def parse(args: list[str], modules: tuple[str, ...] = ()) -> dict | None:
    """The command `python ARGS` runs, as {"flags", "kind": script|module|code, "target", "rest"}; None for a
    command line this does not emulate, or (with `modules`) a module outside those packages."""
    flags, i = set(), 0
    while i < len(args) and args[i].startswith("-") and args[i] not in ("-m", "-c", "-"):
        if not set(args[i][1:]) <= {"u", "B"}:
            return None
        flags |= set(args[i][1:])
        i += 1
    if i >= len(args) or args[i] == "-":
        return None
    if args[i] in ("-m", "-c"):
        if i + 1 >= len(args):
            return None
        kind, target, rest = ("module" if args[i] == "-m" else "code"), args[i + 1], args[i + 2:]
    else:
        kind, target, rest = "script", args[i], args[i + 1:]
    if modules and not (kind == "module" and target.split(".")[0] in modules):
        return None
    return {"flags": sorted(flags), "kind": kind, "target": target, "rest": rest}


def become(command: dict, cwd: str, env: dict, fds: list[int], new_session: bool, group: int = 0,
           listen: bool = False, grouped: int = -1):
    """In a child just forked: turn into `python ARGS` and run it; never returns. `grouped`: a pipe closed once
    the process is in its session or group (its forker answers with the pid then, as Popen returns after it)."""
    try:
        if new_session:
            os.setsid()
        elif group:
            os.setpgid(0, group)
        if grouped >= 0:
            os.close(grouped)
        signal.set_wakeup_fd(-1)
        _default_signals()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, 1 << 16)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        unbuffered = "u" in command["flags"] or bool(env.get("PYTHONUNBUFFERED"))
        sys.dont_write_bytecode = "B" in command["flags"] or bool(env.get("PYTHONDONTWRITEBYTECODE"))
        _fresh_stdio(unbuffered)
        sys.executable = SHIM
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        first = {"script": os.path.dirname(os.path.realpath(command["target"])), "module": os.getcwd(),
                 "code": ""}[command["kind"]]
        sys.path[:] = [first, *extra, *BASE_PATH]
        sys.path_importer_cache.clear()
        tempfile.tempdir = None  # gettempdir() is cached: this process's TMPDIR, not the zygote's
        random.seed()  # a fresh interpreter seeds the global generators from the OS (random's own at-fork too)
        if "numpy.random" in sys.modules:
            sys.modules["numpy.random"].seed()
        if _RESEED_TORCH[0]:
            sys.modules["torch"].default_generator.seed()  # from the OS, as its load in a fresh interpreter
        if listen:
            _listen()
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
    except BaseException:  # noqa: BLE001 - the child must not return into the zygote's loop
        traceback.print_exc()
        os._exit(1)
    _exit(_run(command, main))


def _run(command: dict, main: types.ModuleType) -> int:
    try:
        if command["kind"] == "module":
            sys.argv = [command["target"], *command["rest"]]  # runpy puts the module's file in argv[0]
            runpy._run_module_as_main(command["target"], alter_argv=True)  # what `python -m` calls
        else:
            target = command["target"]
            if command["kind"] == "script":
                with open(target, "rb") as f:
                    code = compile(f.read(), target, "exec")
                main.__file__ = target
            else:
                code = compile(target, "<string>", "exec")
            sys.argv = [target if command["kind"] == "script" else "-c", *command["rest"]]
            main.__dict__.update(__builtins__=__builtins__, __spec__=None, __package__=None)
            exec(code, main.__dict__)
        return 0
    except SystemExit as stop:
        return _status(stop.code)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        return -signal.SIGINT
    except BaseException:  # noqa: BLE001 - as the interpreter: print the traceback, exit 1
        sys.excepthook(*sys.exc_info())
        return 1


def _status(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _exit(code: int):
    """An interpreter's exit: join non-daemon threads, run atexit handlers, flush stdio; then leave at once (the
    zygote's own state must not be torn down a second time). The preloaded modules' weakref finalizers are left
    out: torch's only unregister its operator libraries from this process's memory (nothing anyone outside could
    see), and they were ~40 ms of every warm process's exit."""
    for finalizer in _PRELOADED_FINALIZERS:
        finalizer.atexit = False
    for step in (threading._shutdown, atexit._run_exitfuncs, sys.stdout.flush, sys.stderr.flush):
        try:
            step()
        except BaseException:  # noqa: BLE001
            pass
    if code < 0:  # died of a signal, as the interpreter does for an uncaught KeyboardInterrupt
        signal.signal(-code, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
        os.kill(os.getpid(), -code)
    os._exit(code)


def _default_signals() -> None:
    for sig in signal.valid_signals():
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            try:
                signal.signal(sig, signal.SIG_DFL)
            except (OSError, ValueError):
                pass
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as Python sets them up
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def _fresh_stdio(unbuffered: bool) -> None:
    def writer(fd: int, errors: str, line: bool):
        raw = io.FileIO(fd, "w", closefd=False)
        binary = raw if unbuffered else io.BufferedWriter(raw)
        return io.TextIOWrapper(binary, encoding="utf-8", errors=errors, line_buffering=line,
                                write_through=unbuffered)

    # The inherited streams are kept, never closed or collected: another thread of the parent may have held their
    # locks at the fork, and what they buffered is the parent's output, not this process's.
    _INHERITED_STDIO.append((sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__, sys.__stderr__))
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)),
                                                 encoding="utf-8")
    sys.stdout = sys.__stdout__ = writer(1, "strict", os.isatty(1))
    sys.stderr = sys.__stderr__ = writer(2, "backslashreplace", True)


# -- the listener of a session: forks `python -m relay ...` for the shim -----------------------------------
PROCESS_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
                   signal.SIGALRM, signal.SIGCHLD, signal.SIGWINCH}  # sent to a process, not raised by a thread


def _listen() -> None:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    address = f"relay-warm-{os.getpid()}-{os.urandom(4).hex()}"
    server.bind("\0" + address)
    server.listen(16)
    os.environ[SOCKET_VARIABLE] = address
    # A real `python` has one thread, which gets every signal sent to the process; the listener's threads are the
    # warm start's, not the program's. One of them catching the runner's SIGTERM would leave the program's
    # handler waiting for its main thread's next bytecode: never, while that thread blocks in a wait (seen on one
    # core: a launcher that never forwarded SIGTERM). So they block those signals (a thread inherits the mask of
    # the thread that starts it), and the kernel gives them to the main thread.
    program_mask = signal.pthread_sigmask(signal.SIG_BLOCK, PROCESS_SIGNALS)
    try:
        threading.Thread(target=_accept, args=(server,), name="warm-start listener", daemon=True).start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, program_mask)


def _accept(server: socket.socket) -> None:
    while True:
        conn, _ = server.accept()
        threading.Thread(target=_serve, args=(conn,), name="warm start", daemon=True).start()


def _serve(conn: socket.socket) -> None:
    """One shim: fork the process it stands for into the shim's process group; tell it the pid and the exit
    code; a shim that dies takes its process with it, as one process would."""
    fds: list[int] = []
    with conn:
        try:
            request, fds = _receive(conn)
            pid_of_shim = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
            command = parse(request["argv"], modules=("relay",))
            if command is None or len(fds) != 3 or os.getsid(pid_of_shim) != os.getsid(0):
                conn.sendall(b'{"refuse": true}\n')
                return
            group = os.getpgid(pid_of_shim)
            pid = os.fork()
            if pid == 0:
                become(command, request["cwd"], request["env"], fds, new_session=False, group=group)
        except OSError:
            return
        finally:
            for fd in fds:
                os.close(fd)
        process = os.pidfd_open(pid)  # signals through it never reach another process that reuses the pid
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")

        def shim_gone():
            while conn.recv(4096):
                pass
            try:
                signal.pidfd_send_signal(process, signal.SIGKILL)
            except ProcessLookupError:
                pass
            finally:
                os.close(process)

        threading.Thread(target=shim_gone, daemon=True).start()
        _, status = os.waitpid(pid, 0)
        try:
            conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        except OSError:
            pass


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 8)
    while not data.endswith(b"\n"):
        more = conn.recv(MAX_MESSAGE)
        if not more:
            raise OSError("the request ended early")
        data += more
    return json.loads(data), fds


# -- the zygote: forks sessions' launchers for the emulator's runner ---------------------------------------
def _prepare(modules: list[str]) -> str:
    """Import `modules` and write the shim; returns the shim's folder."""
    global SHIM
    own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    # not this file's folder (relay/shared's files are no top-level modules), nor the zygote's own PYTHONPATH:
    # a fork's sys.path is its own PYTHONPATH and these
    BASE_PATH[:] = [p for p in sys.path[1:] if p not in own]
    sys.path[:] = [*own, *BASE_PATH]
    for name in modules:
        __import__(name)
    _check_torch(modules)
    _PRELOADED_FINALIZERS.extend(weakref.finalize._registry)  # noqa: SLF001 - see _exit
    folder = tempfile.mkdtemp(prefix="relay-warm-")
    SHIM = os.path.join(folder, "python")
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "warm_python.py")) as f:
        text = f"#!{sys.executable} -SE\n" + f.read()
    with open(SHIM, "w") as f:
        f.write(text)
    os.chmod(SHIM, 0o755)
    return folder


def _check_torch(modules: list[str]) -> None:
    """What a fork inherits of torch must be what a fresh interpreter starts with: no CUDA context (a fork cannot
    use its parent's), and the default generator as `import torch` leaves it (nothing the zygote imported drew
    from it: a fresh interpreter that does not import those modules would not have drawn)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    named = " ".join(modules)
    if torch.cuda.is_initialized():
        raise SystemExit(f"warm zygote: importing {named} initialized CUDA; a forked process could not use it:"
                         " leave out the module that does")
    seed = torch.initial_seed()
    if not torch.equal(torch.default_generator.get_state(), torch.Generator().manual_seed(seed).get_state()):
        raise SystemExit(f"warm zygote: importing {named} drew from torch's default generator; a forked process"
                         " would not start where a fresh interpreter does: leave out the module that does")
    _RESEED_TORCH[0] = seed != TORCH_BUILT_IN_SEED


def serve_shims(modules: list[str]) -> None:
    """`python warm_zygote.py --listen MODULE...`: only the listener, for the processes of this one's session
    (a test worker's `python -m relay ...` runs); says {"python": shim, "socket": address} on stdout, and ends
    when its stdin does."""
    folder = _prepare(modules)
    _listen()
    print(json.dumps({"python": SHIM, "socket": os.environ[SOCKET_VARIABLE]}), flush=True)
    try:
        while os.read(0, 4096):  # not sys.stdin: a child forked meanwhile would inherit its lock held
            pass
    finally:
        os.unlink(SHIM)
        os.rmdir(folder)


def main() -> None:
    if sys.argv[1] == "--listen":
        return serve_shims(sys.argv[2:])
    fd, modules = int(sys.argv[1]), sys.argv[2:]
    folder = _prepare(modules)
    runner = socket.socket(fileno=fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C in the emulator's terminal is the emulator's to handle
    selector = selectors.DefaultSelector()
    selector.register(runner, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    runner.sendall(b'{"ready": true}\n')  # the modules are imported: a session's clock may start
    try:
        while True:
            for key, _ in selector.select():
                if key.fileobj is runner:
                    try:
                        request, fds = _receive(runner)
                    except (OSError, ValueError):
                        return  # the runner is gone
                    _fork_launcher(runner, request, fds)
                else:
                    os.read(wake_r, 4096)
            _reap(runner)
    finally:
        os.unlink(SHIM)
        os.rmdir(folder)


def _fork_launcher(runner: socket.socket, request: dict, fds: list[int]) -> None:
    command = parse(request["argv"])
    if command is None or len(fds) != 2:
        for fd in fds:
            os.close(fd)
        return runner.sendall(json.dumps({"id": request["id"], "error": "not a command line to start warm"}).encode()
                              + b"\n")
    grouped_r, grouped_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(grouped_r)
        stdin = os.open(os.devnull, os.O_RDONLY)
        become(command, request["cwd"], request["env"], [stdin, *fds], new_session=True, listen=True,
               grouped=grouped_w)
    os.close(grouped_w)
    os.read(grouped_r, 1)  # end of file once the child is its own session: a killpg(pid) from now on reaches it
    os.close(grouped_r)
    for fd in fds:
        os.close(fd)
    runner.sendall(json.dumps({"id": request["id"], "pid": pid}).encode() + b"\n")


def _reap(runner: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        runner.sendall(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")


if __name__ == "__main__":
    main()
