"""A bench's own folders and environment while it runs in the caller's process (bench/run.py runs the benches one
after the other): a work folder with home/ and tmp/, variables such as HOME pointed into it, and after the bench the
environment and tempfile's folder as they were, the folder removed unless kept."""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator


@contextmanager
def work_folder(prefix: str, keep: bool = False, folders: Iterable[str] = ("home", "tmp")) -> Iterator[Path]:
    """A new temporary folder with `folders` in it; removed after unless `keep`."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    for name in folders:
        (work / name).mkdir()
    try:
        yield work
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


@contextmanager
def environment(**values: str) -> Iterator[None]:
    """Within: os.environ with `values`; after: every variable as before (those set within too, e.g. by
    `temporary_files_in`), and tempfile's folder as before."""
    saved, saved_tempdir = dict(os.environ), tempfile.tempdir
    os.environ.update(values)
    try:
        yield
    finally:
        for name in set(os.environ) - set(saved):
            del os.environ[name]
        os.environ.update(saved)
        tempfile.tempdir = saved_tempdir


def temporary_files_in(folder: Path) -> None:
    """Temporary files (TMPDIR and tempfile's folder, where the kaggle client keeps its upload state) in `folder`,
    until the `environment()` this is called in ends."""
    os.environ["TMPDIR"] = tempfile.tempdir = str(folder)
