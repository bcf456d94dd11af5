"""Which opens of one file the code under test makes, seen by a Python audit hook (its `open` events, from any
thread): how the tests check that a spec file is read once."""
from __future__ import annotations

import os
import sys
import traceback
from contextlib import contextmanager
from typing import Iterator, List

# An audit hook stays for the life of the process: it records only while a test watches a file.
_WATCHED: dict = {"path": None, "opens": []}
_installed = False


def _hook(event: str, args: tuple) -> None:
    path = _WATCHED["path"]
    if event != "open" or path is None or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    if os.path.realpath(os.fsdecode(args[0])) == path:
        _WATCHED["opens"].append("".join(traceback.format_stack(limit=6)[:-1]))


@contextmanager
def opens_of(path) -> Iterator[List[str]]:
    """Within: a list that gets, for each open of `path`, the stack that opened it."""
    global _installed
    if not _installed:
        sys.addaudithook(_hook)
        _installed = True
    opens: List[str] = []
    _WATCHED.update(path=os.path.realpath(path), opens=opens)
    try:
        yield opens
    finally:
        _WATCHED["path"] = None
