"""A notebook as code.entry (`code: {folder: ., entry: train.ipynb}`): its code cells run in order, in one
namespace, in this process, the way relay.kernel.entry runs a script (`__name__ == "__main__"`, the notebook's
folder as the current directory and first on sys.path, the same exit codes and classification of errors).

Jupyter's shell and magic lines are not Python. What has a meaning in a batch session is translated line for
line (the line numbers a traceback shows stay the cell's own); what has none is ignored; the rest is refused when
the spec loads (relay.kernel.usercode.parse_entry, behind the front door), one line naming the code cell and line:
  - ignored: %matplotlib, %config, %load_ext, %reload_ext, %autoreload (display and interactive settings)
  - run: `!cmd` in a shell as IPython runs it (its output in the log; a failing command does not stop the
    notebook, as in Jupyter), `%env NAME=VALUE`, `%time STATEMENT`, a `%%time` cell
  - refused: `!pip`/`%pip`/conda (a session installs at its start from kaggle.pip: the orchestrator checks the
    code against that list, and a session's internet is off by default), `!cmd {python_value}` (IPython's
    interpolation), `x = !cmd`, every other magic and cell magic.
Code cells are numbered from 1 in the order they run, which is the `In [N]` of a fresh "Run All".
The notebook is read as JSON (nbformat 4); nbformat itself is not needed in a session or on the orchestrator.
"""
from __future__ import annotations

import io
import json
import linecache
import re
import subprocess
import sys
import tokenize
import types
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Optional

SUFFIX = ".ipynb"
_IGNORED = {"matplotlib", "config", "load_ext", "reload_ext", "autoreload"}
_INSTALLERS = {"pip", "pip3", "conda", "mamba"}
_CELL_TAG = re.compile(r"\[code cell (\d+)\]$")


class NotebookError(ValueError):
    """A notebook that cannot run as an entry; the message is the one line the user sees (after `code.entry: `)."""


@dataclass(frozen=True)
class Cell:
    number: int  # 1-based among the code cells
    source: str  # the cell's code with its shell and magic lines translated, line for line
    filename: str  # what tracebacks show: /path/train.ipynb[code cell 3]


# -- reading and translating ------------------------------------------------------------------------------
def read_cells(path: Path) -> list[Cell]:
    """The notebook's code cells, translated and compiled (a syntax error is found here, not hours into a run)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise NotebookError(f"{path.name}: not a readable notebook ({type(err).__name__}: {err})") from None
    if not isinstance(data, dict) or not isinstance(data.get("cells"), list):
        raise NotebookError(f"{path.name}: not a notebook (expected nbformat 4 JSON with a 'cells' list)")
    if data.get("nbformat") != 4:
        raise NotebookError(f"{path.name}: nbformat {data.get('nbformat')} is not supported (expected 4;"
                            " `jupyter nbconvert --to notebook` upgrades it)")
    language = (data.get("metadata") or {}).get("kernelspec", {}).get("language", "python")
    if language != "python":
        raise NotebookError(f"{path.name}: a {language} notebook (the relay runs Python notebooks)")
    cells, number = [], 0
    for cell in data["cells"]:
        if not isinstance(cell, dict) or cell.get("cell_type") != "code":
            continue
        number += 1
        source = cell.get("source", "")
        source = "".join(source) if isinstance(source, list) else str(source)
        filename = f"{Path(path).resolve()}[code cell {number}]"
        code = translate(source, f"{path.name} code cell {number}")
        try:
            compile(code, filename, "exec")
        except SyntaxError as err:
            raise NotebookError(f"{path.name} code cell {number}, line {err.lineno}: SyntaxError: {err.msg}"
                                f"{_assign_hint(source, err.lineno)}") from None
        cells.append(Cell(number, code, filename))
    if not cells:
        raise NotebookError(f"{path.name}: no code cells to run")
    return cells


def translate(source: str, where: str) -> str:
    """The cell's Python: each shell or magic line that starts a statement replaced, at its indentation, by the
    Python that does what it means (or `pass`), so every other line keeps its number."""
    lines = source.splitlines(keepends=True)
    first_code = next((i for i, line in enumerate(lines) if line.strip()), None)
    for i, line in enumerate(lines):
        stripped = line.lstrip()
        if not stripped.startswith(("!", "%")) or not _starts_statement(lines[:i]):
            continue  # `%` inside a string or a bracketed expression is Python's
        indent = line[: len(line) - len(stripped)]
        text = stripped.rstrip("\n").rstrip()
        if text.startswith("%%"):
            if i != first_code or text.split()[0] != "%%time":
                raise NotebookError(f"{where}, line {i + 1}: {text!r}: cell magic is not run in a relay session"
                                    " (only %%time, on a cell's first line; write the cell as Python)")
            python = "pass"
        elif text.startswith("!"):
            python = _shell_line(text[1:].strip(), where, i + 1)
        else:
            python = _line_magic(text[1:].strip(), where, i + 1)
        lines[i] = f"{indent}{python}\n"
    return "".join(lines)


def _starts_statement(before: list[str]) -> bool:
    """Whether the next line begins a statement: the lines before it tokenize to their end (no open string,
    bracket or backslash continuation)."""
    try:
        for _ in tokenize.generate_tokens(io.StringIO("".join(before)).readline):
            pass
    except tokenize.TokenError:
        return False
    except SyntaxError:  # a dedent that matches no level: compile reports it, with its line
        return True
    return True


def _shell_line(command: str, where: str, line: int) -> str:
    words = command.split()
    tool = words[0] if words else ""
    if tool in _INSTALLERS or (tool.startswith("python") and words[1:3] == ["-m", "pip"]):
        raise NotebookError(f"{where}, line {line}: '!{command}': a relay session installs nothing from a cell;"
                            " list the package in the spec's kaggle.pip (installed at the session's start)")
    if not command:
        raise NotebookError(f"{where}, line {line}: '!' without a command")
    if "{" in command:
        raise NotebookError(f"{where}, line {line}: '!{command}': IPython's {{python value}} interpolation is"
                            " not run in a relay session (build the command in Python and call subprocess.run)")
    return f"__import__('relay.kernel.notebook', fromlist=['shell']).shell({command!r})"


def _line_magic(text: str, where: str, line: int) -> str:
    name, _, rest = text.partition(" ")
    rest = rest.strip()
    if name in _IGNORED:
        return "pass"
    if name in _INSTALLERS:
        raise NotebookError(f"{where}, line {line}: '%{text}': a relay session installs nothing from a cell;"
                            " list the package in the spec's kaggle.pip (installed at the session's start)")
    if name == "env" and rest:
        key, sep, value = rest.partition("=") if "=" in rest.split()[0] else rest.partition(" ")
        if not sep:  # `%env NAME` shows it
            return f"print(__import__('os').environ.get({key.strip()!r}))"
        return f"__import__('os').environ[{key.strip()!r}] = {value.strip()!r}"
    if name == "time" and rest:
        return rest  # the statement itself; its timing only matters interactively
    raise NotebookError(f"{where}, line {line}: '%{text}': this magic is not run in a relay session (ignored:"
                        f" %{', %'.join(sorted(_IGNORED))}; run: !cmd, %env, %time, %%time; write the rest as Python)")


def _assign_hint(source: str, lineno: Optional[int]) -> str:
    lines = source.splitlines()
    if lineno and 0 < lineno <= len(lines) and re.search(r"=\s*[!%]", lines[lineno - 1]):
        return " (a shell or magic line's output cannot be assigned in a relay session: use subprocess.run)"
    return ""


def shell(command: str) -> int:
    """A `!cmd` line: the command in a shell, its output in the session's log, as IPython runs it (a non-zero
    status is printed, not raised: a notebook goes on after a failing `!` line)."""
    sys.stdout.flush()
    sys.stderr.flush()
    status = subprocess.run(command, shell=True, check=False).returncode  # noqa: S602 - the user's own line
    if status:
        print(f"[relay] !{command.split()[0]}: exit status {status}", file=sys.stderr, flush=True)
    return status


# -- running ------------------------------------------------------------------------------------------------
def run(path: Path) -> None:
    """Run the notebook's code cells in order in one `__main__` namespace (sys.modules["__main__"] is it while
    the cells run, as runpy does for a script, so pickling what a cell defines works)."""
    cells = read_cells(Path(path))
    module = types.ModuleType("__main__")
    module.__dict__["display"] = _display  # IPython's builtin, used by most notebooks; prints in a session
    before = sys.modules.get("__main__")
    sys.modules["__main__"] = module
    try:
        for cell in cells:
            # tracebacks show the cell's lines: linecache never re-reads an entry without an mtime
            linecache.cache[cell.filename] = (len(cell.source), None, cell.source.splitlines(True), cell.filename)
            exec(compile(cell.source, cell.filename, "exec"), module.__dict__)  # noqa: S102 - the user's code
    finally:
        if before is not None:
            sys.modules["__main__"] = before


def _display(*objs, **_kwargs) -> None:
    for obj in objs:
        print(repr(obj), flush=True)


def where(tb: Optional[TracebackType]) -> str:
    """"code cell 3, line 5" for the innermost frame of a traceback that is in a notebook cell; "" if none is."""
    found = ""
    while tb is not None:
        match = _CELL_TAG.search(tb.tb_frame.f_code.co_filename)
        if match:
            found = f"code cell {match.group(1)}, line {tb.tb_lineno}"
        tb = tb.tb_next
    return found
