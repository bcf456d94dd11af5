"""A migrated Prefect database for the tests' own Prefect servers (`relay run`'s ephemeral one, `prefect server
start`), as the database of a user who has run Prefect before.

On an empty PREFECT_HOME a server's first start runs every SQLite migration and registers Prefect's block types:
8.3 CPU s to start, against 3.4 CPU s on a migrated copy (measured on the 2-core VM). One migrated database per
test run, made by the first worker that asks (under a lock; the others wait for it), is copied into a test's
PREFECT_HOME before its first server starts. A test that proves a first run on a fresh machine (the README's
newcomer) keeps its PREFECT_HOME empty.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

DB_NAME = "prefect.db"  # Prefect's SQLite database in PREFECT_HOME, when no connection URL is set

# What a server's start does to an empty database: the migrations, then the block types.
MIGRATE = """
import asyncio
from prefect.server.database import provide_database_interface
from prefect.server.models.block_registration import run_block_auto_registration

async def main():
    db = provide_database_interface()
    await db.create_db()
    async with await db.session() as session:
        await run_block_auto_registration(session=session)
        await session.commit()

asyncio.run(main())
"""

ROOT: Optional[Path] = None  # the run's shared temporary folder: set by tests/conftest.py at the session's start


def template() -> Path:
    """The run's migrated database, made once for all workers."""
    if ROOT is None:
        raise RuntimeError("prefect_template.ROOT is not set (tests/conftest.py sets it for the session)")
    made = ROOT / "prefect-template" / DB_NAME
    ROOT.mkdir(parents=True, exist_ok=True)
    with open(ROOT / "prefect-template.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker making it: wait for it
        if not made.is_file():
            home = Path(tempfile.mkdtemp(prefix="prefect-template-", dir=ROOT))
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "TMPDIR": str(home),
                   "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}
            done = subprocess.run([sys.executable, "-c", MIGRATE], env=env, capture_output=True, text=True,
                                  timeout=600)
            if done.returncode != 0 or not (home / DB_NAME).is_file():
                raise RuntimeError(f"migrating a template Prefect database failed:\n{done.stderr[-3000:]}")
            leftovers = sorted(p.name for p in home.iterdir() if p.name.startswith(DB_NAME + "-"))
            if leftovers:  # a -wal or -journal file: the database file alone would be incomplete
                raise RuntimeError(f"the template Prefect database was left with {leftovers}")
            home.rename(made.parent)
    return made


def migrated(prefect_home: Path) -> Path:
    """PREFECT_HOME with a migrated database in it (a copy of the run's template), unless it has one already."""
    prefect_home = Path(prefect_home)
    prefect_home.mkdir(parents=True, exist_ok=True)
    if not (prefect_home / DB_NAME).exists():
        shutil.copyfile(template(), prefect_home / DB_NAME)
    return prefect_home
