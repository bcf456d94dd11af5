"""The Prefect server's database for a bench: a fresh local PostgreSQL (deploy/local_postgres.py, the team's shape),
and the rows by table of either database at the end (bench/bench_relays.py)."""
from __future__ import annotations

import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sqlite_rows(db: Path) -> dict:
    """Rows by table of the server's SQLite file."""
    with sqlite3.connect(db) as conn:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        counts = {t: conn.execute(f'SELECT COUNT(*) FROM "{t}"').fetchone()[0] for t in tables}
    return {t: c for t, c in sorted(counts.items(), key=lambda tc: -tc[1]) if c}


def postgres_rows(url: str) -> dict:
    """Rows by table of the server's PostgreSQL database (exact counts, as sqlite_rows: not the planner's estimates)."""
    import asyncio

    import asyncpg  # Prefect's own PostgreSQL driver

    async def count() -> dict:
        conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
        try:
            tables = [r[0] for r in await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")]
            return {t: await conn.fetchval(f'SELECT COUNT(*) FROM "{t}"') for t in tables}
        finally:
            await conn.close()

    counts = asyncio.run(count())
    return {t: c for t, c in sorted(counts.items(), key=lambda tc: -tc[1]) if c}


class LocalPostgres:
    """A fresh PostgreSQL for the server (deploy/local_postgres.py, as bench/bench_scale.py), in a folder under /tmp
    (under root its owner, `nobody`, must be able to enter it)."""

    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix="relay-bench-pg-", dir="/tmp"))
        self.root.chmod(0o711)
        self.data = self.root / "data"
        self.url = subprocess.run([sys.executable, "deploy/local_postgres.py", "start", "--data", str(self.data),
                                   "--port", str(_port())], cwd=REPO, capture_output=True, text=True,
                                  check=True).stdout.strip()

    def processes(self) -> list:
        """The cluster's postmaster (its folder in its command line) and its backends (its children)."""
        found = [p for p in psutil.process_iter(["cmdline"]) if str(self.data) in " ".join(p.info["cmdline"] or [])]
        for postmaster in list(found):
            try:
                found += postmaster.children(recursive=True)
            except psutil.Error:
                continue
        return found

    def stop(self) -> None:
        subprocess.run([sys.executable, "deploy/local_postgres.py", "stop", "--data", str(self.data)], cwd=REPO,
                       capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)
