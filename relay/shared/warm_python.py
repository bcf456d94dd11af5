# The `python` of a warm emulator session (warm_zygote.py copies this file under a `#!<python> -SE` line and
# names the copy as sys.executable in the processes it forks). `python -m relay ...` is forked by the session's
# listener from an interpreter that has torch imported; this process stands for it: the caller's pid, the
# signals it receives, and the exit code (or the signal) the forked process ended with. Anything else, or no
# listener, runs the real interpreter in this process's place. Standard library only: it runs without site.
import json
import os
import signal
import socket
import sys


FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def real_python(mask=None):
    if mask is not None:  # a signal mask outlives exec
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])


def main():
    address = os.environ.get("RELAY_WARM_SOCKET")
    if not address:
        real_python()
    # Held from before the fork is asked for until they are forwarded: the forked process may run (and be sent a
    # SIGTERM through this one) before the reply naming it is read here, which would otherwise kill this stand-in.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.connect("\0" + address)
        request = {"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}
        socket.send_fds(listener, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
        replies = listener.makefile("rb")
        reply = json.loads(replies.readline() or b'{"refuse": true}')
    except OSError:
        reply = {"refuse": True}
    if "refuse" in reply:
        listener.close()
        real_python(mask)
    pid = reply["pid"]

    def forward(signum, frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # one that came meanwhile is forwarded now
    line = replies.readline()
    code = json.loads(line)["exit"] if line else 1
    if code < 0:  # it died of a signal: so does its stand-in
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


main()
