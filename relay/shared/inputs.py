"""Strict reading of the files a user hands us: UTF-8 text with the bad line named, YAML without duplicate keys.

Both refuse with `relay.shared.errors.InputError` (one line naming the file, the line and what is expected): a spec
saved as Latin-1 or UTF-16, or one that sets `lr` twice (which one wins would be a guess), is not guessed at.
Runs inside the Kaggle kernel too (the price recipe reads its CSVs through `non_utf8_line`).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Optional

import numpy as np
import yaml

from relay.shared.errors import InputError

_MERGE_TAG = "tag:yaml.org,2002:merge"


def decode_utf8(data: bytes, source: str | Path) -> str:
    """`data` as text, or InputError naming the first line that is not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise InputError(f"{source}: line {line} is not UTF-8 text (byte 0x{data[err.start]:02x});"
                         " expected a file saved as UTF-8") from None


def non_utf8_line(path: Path) -> Optional[tuple[int, int]]:
    """(line number, offending byte) of the first line of `path` that is not UTF-8, or None (read line by
    line: only called once a reader has already failed, on files that may be large)."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as err:
                return number, line[err.start]
    return None


def check_field_counts(path: Path, chunk_bytes: int = 1 << 22) -> None:
    """InputError naming the first line of a numeric CSV whose field count is not the header's. pandas with
    `usecols` drops a row's extra fields silently (and fills missing ones with NaN), so the readers check first:
    commas per line counted with numpy, 4 MB at a time (numbers only: a quoted comma would count)."""
    number, carry, fields = 1, b"", None
    with open(path, "rb") as f:
        while True:
            chunk = f.read(chunk_bytes)
            buf = carry + chunk if chunk else carry + b"\n"  # the last line may have no newline
            end = buf.rfind(b"\n") + 1
            carry = buf[end:]
            a = np.frombuffer(buf, np.uint8, count=end)
            newlines = np.flatnonzero(a == ord("\n"))
            commas = np.diff(np.cumsum(a == ord(","), dtype=np.int32)[newlines], prepend=0)
            lengths = np.diff(newlines, prepend=-1) - 1 - (a[np.maximum(newlines - 1, 0)] == ord("\r"))
            counted = lengths > 0  # pandas skips blank lines
            if fields is None and counted.any():
                fields = int(commas[counted][0]) + 1  # the header
            bad = counted & (commas != (fields or 0) - 1)
            if fields is not None and bad.any():
                at = int(bad.argmax())
                raise InputError(f"{path}: line {number + at}: {int(commas[at]) + 1} fields, expected {fields}"
                                 " (the header's)")
            number += len(newlines)
            if not chunk:
                return


class OneLineArgumentParser(argparse.ArgumentParser):
    """A bad argument is one line on stderr, exit 2, like every other bad input (argparse prints its usage
    first). Subcommand parsers inherit the class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class DuplicateKey(InputError):
    """A mapping sets the same key twice; the message is `key.path: duplicate key at line N (...)`."""


class UniqueKeySafeLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping with the same key twice (PyYAML silently keeps the last).

    The check runs on the composed node tree before construction, so it can name the full key path
    (`optim.lr`) and both lines. Keys brought in by a `<<: *anchor` merge may be overridden, as YAML intends.
    """

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        _check_unique(node, (), set())
        return self.construct_document(node)


def _check_unique(node: yaml.Node, path: tuple[str, ...], seen: set[int]) -> None:
    if id(node) in seen:  # an alias of a node already checked (anchors may even be recursive)
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first_line: dict[tuple[str, str], int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            if isinstance(key_node, yaml.ScalarNode):
                key = (key_node.tag, key_node.value)
                line = key_node.start_mark.line + 1
                if key in first_line:
                    dotted = ".".join((*path, key_node.value))
                    raise DuplicateKey(f"{dotted}: duplicate key at line {line} (first set at line"
                                       f" {first_line[key]}); set each key once")
                first_line[key] = line
                child = (*path, key_node.value)
            else:
                child = (*path, "?")
            _check_unique(value_node, child, seen)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _check_unique(item, (*path[:-1], f"{path[-1]}[{index}]") if path else (f"[{index}]",), seen)


def load_yaml(text: str) -> Any:
    """yaml.safe_load, refusing duplicate keys (DuplicateKey) ; other errors are yaml.YAMLError."""
    return yaml.load(text, Loader=UniqueKeySafeLoader)  # noqa: S506 - a SafeLoader subclass
