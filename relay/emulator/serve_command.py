"""`relay emulator serve`: run the local Kaggle in the foreground.

It prints, first, the `export` lines that point an unmodified `kaggle` CLI at it (as its first account), then
serves until Ctrl-C / SIGTERM. The accounts it accepts: every `--user NAME:KEY` (a team's several accounts), or
`--user NAME --key KEY`, else the `users` of `--config`, else a local user it creates once and keeps in the state
folder.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import sys
import threading
from pathlib import Path
from typing import Optional, Sequence

from relay.emulator.config import EmulatorConfig
from relay.emulator.faults import from_flags
from relay.shared.errors import InputError

LOCAL_USER_FILE = "local-user.json"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="relay emulator", description="A local Kaggle API emulator.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the Kaggle API on 127.0.0.1")
    serve.add_argument("--port", type=int, default=8765, help="TCP port on 127.0.0.1 (0 = any free port)")
    serve.add_argument("--state", required=True, help="state folder (kept across restarts)")
    serve.add_argument("--config", help="JSON file of EmulatorConfig settings")
    serve.add_argument("--user", action="append", metavar="NAME[:KEY]",
                       help="an account to accept, NAME:KEY; repeat for several (default: --config's users, else a"
                            " generated local user)")
    serve.add_argument("--key", help="API key of a single --user NAME")
    serve.add_argument("--time-scale", type=float, help="Kaggle seconds per wall second (3600: 12 h -> 12 s)")
    serve.add_argument("--processing-delay", type=float, help="wall seconds before a dataset version is READY")
    serve.add_argument("--queue-delay", type=float, help="wall seconds a pushed kernel stays QUEUED")
    serve.add_argument("--gpu-quota-hours", type=float, help="weekly GPU quota (Kaggle hours)")
    serve.add_argument("--max-gpu-sessions", type=int, help="concurrent GPU sessions allowed")
    serve.add_argument("--output-cap-gb", type=float, help="kept output cap of /kaggle/working")
    serve.add_argument("--mount-layout", choices=("flat", "nested"),
                       help="mounts at <input>/<slug> (flat) or <input>/datasets|notebooks/<owner>/<slug> (nested)")
    serve.add_argument("--status-lag", type=float,
                       help="after a push, unpinned status/output answer the previous version for S seconds")
    serve.add_argument("--status-lag-pinned", action="store_true",
                       help="with --status-lag: requests pinned to the new version (versionLabel) lag too")
    serve.add_argument("--latency", type=float, metavar="S",
                       help="every request takes up to S seconds more (seeded by --seed), as over a network")
    serve.add_argument("--faults", help="JSON fault plan (see relay/emulator/faults.py)")
    serve.add_argument("--fault-rate", type=float, default=0.0, help="fraction of calls failing (429/500/reset/lost)")
    serve.add_argument("--seed", type=int, default=0, help="fault seed, so a failing run replays")
    return parser


def load_config(args: argparse.Namespace) -> EmulatorConfig:
    config = EmulatorConfig.from_file(Path(args.config)) if args.config else EmulatorConfig()
    for flag, name, scale in (("time_scale", "time_scale", 1), ("processing_delay", "dataset_processing_delay", 1),
                              ("queue_delay", "queue_delay", 1), ("gpu_quota_hours", "gpu_quota_s", 3600),
                              ("max_gpu_sessions", "max_gpu_sessions", 1)):
        value = getattr(args, flag)
        if value is not None:
            setattr(config, name, type(getattr(config, name))(value * scale))
    if args.output_cap_gb is not None:
        config.output_cap_bytes = int(args.output_cap_gb * 1e9)
    if args.mount_layout:
        config.mount_layout = args.mount_layout
    if args.faults:
        try:
            config.faults = json.loads(Path(args.faults).read_text())
        except (OSError, ValueError) as err:
            raise InputError(f"--faults {args.faults}: {err}") from None
    elif args.fault_rate:
        if not 0 <= args.fault_rate < 1:
            raise InputError(f"--fault-rate {args.fault_rate}: use a fraction in [0, 1)")
        config.faults = from_flags(args.fault_rate, args.seed)
    if args.status_lag:
        config.faults = dict(config.faults or {}, status_lag={"seconds": args.status_lag,
                                                              "pinned": bool(args.status_lag_pinned)})
    elif args.status_lag_pinned:
        raise InputError("--status-lag-pinned needs --status-lag S")
    if args.latency is not None:
        if not 0 <= args.latency <= 60:
            raise InputError(f"--latency {args.latency}: use seconds in [0, 60]")
        config.faults = dict(config.faults or {}, latency={"min_s": 0.0, "max_s": args.latency})
        config.faults.setdefault("seed", args.seed)
    return config.validate()


def accounts(state: Path, users: Optional[Sequence[str]], key: Optional[str], configured: dict) -> dict:
    """username -> key of the accounts to accept, the first the one the export lines name: the flags
    (`--user NAME:KEY` each, or one `--user NAME --key KEY`), else the config's `users`, else the local user."""
    if not users:
        if key:
            raise InputError("--key KEY needs --user NAME")
        return dict(configured) if configured else dict([local_user(state)])
    if key is not None:
        if len(users) > 1 or ":" in users[0]:
            raise InputError("--key goes with a single --user NAME; for several accounts use --user NAME:KEY each")
        return {users[0]: key}
    out: dict = {}
    for given in users:
        name, _, secret = given.partition(":")
        if not (name and secret):
            raise InputError(f"--user {given.split(':')[0]!r}: expected NAME:KEY (or --user NAME --key KEY)")
        if name in out:
            raise InputError(f"--user {name}: given twice")
        out[name] = secret
    return out


def local_user(state: Path) -> tuple:
    """A local user generated once and kept in the state folder: (name, key)."""
    path = state / LOCAL_USER_FILE
    if path.exists():
        data = json.loads(path.read_text())
        return data["username"], data["key"]
    state.mkdir(parents=True, exist_ok=True)
    name, generated = "relay", secrets.token_hex(16)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"username": name, "key": generated}, f)
    return name, generated


def export_lines(user: str, key: str, port: int) -> list:
    return [f"export KAGGLE_USERNAME={user}", f"export KAGGLE_KEY={key}",
            "export KAGGLE_API_ENVIRONMENT=LOCALHOST", f"export HTTP_PROXY=http://127.0.0.1:{port}",
            # the kaggle CLI calls `localhost`, through the proxy; a local Prefect server (127.0.0.1) is not
            "export NO_PROXY=127.0.0.1", "export no_proxy=127.0.0.1",
            f"export RELAY_KAGGLE_ENDPOINT=http://127.0.0.1:{port}  # for relay run/doctor/status"]


def serve(args: argparse.Namespace) -> int:
    from relay.emulator.server import Emulator

    state = Path(args.state)
    config = load_config(args)
    config.users = accounts(state, args.user, args.key, config.users)
    emulator = Emulator(state, config, port=args.port)
    (user, key), *others = config.users.items()
    for line in export_lines(user, key, emulator.port):
        print(line)
    for name, secret in others:  # the other accounts: a spec names one with kaggle.credentials_block or these
        print(f"# account {name}: KAGGLE_USERNAME={name} KAGGLE_KEY={secret}")
    print(f"# Kaggle emulator on {emulator.url}, state in {state.resolve()}", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    emulator.start()
    try:
        done.wait()
    except KeyboardInterrupt:
        pass
    finally:
        emulator.stop()
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return serve(args)
    except InputError as err:
        print(f"relay emulator: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"relay emulator: error: {err}", file=sys.stderr)
        return 1
