"""The user's own code: importing it, checking it, and running its entry in a session.

A spec names it with a `code:` section (a folder and an entry: `train.py --lr 3e-4` or `pkg.module:function`)
and/or a user recipe (`recipe: pkg.module:Class`, a `relay.Recipe` subclass from that folder).
The spec alone checks the folder (relay.shared.spec: exists, at most 2 MB, relay.shared.code_folder); the front
door (relay.front_door.load_spec) then runs check_code here, so a wrong entry or recipe is one line and exit 2
before anything is written or pushed.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import re
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from relay.kernel import notebook
from relay.shared.errors import InputError

if TYPE_CHECKING:
    from relay.shared.spec import RunSpec

_MODULE_ENTRY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class UserCodeError(InputError):
    """The user's code failed in a way a new session would repeat: the relay stops instead of retrying."""


def _on_path(folder: Path) -> None:
    """The user's folder first on sys.path, and no module of the same name left cached from another folder
    (a long-lived orchestrator loads several specs, whose code may share a package name like `mypkg`)."""
    if str(folder) in sys.path:
        sys.path.remove(str(folder))
    sys.path.insert(0, str(folder))
    for entry in folder.iterdir():
        name = entry.stem if entry.suffix == ".py" else entry.name
        cached = sys.modules.get(name)
        origin = getattr(cached, "__file__", None)
        if cached is not None and origin and not Path(origin).resolve().is_relative_to(folder.resolve()):
            for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
                del sys.modules[key]
    importlib.invalidate_caches()


# -- the recipe a spec names, built-in or the user's --------------------------------------------------------
def recipe_class(name: str):
    """The Recipe class of `recipe:`: a built-in by name, or the user's `pkg.module:Class` from code.folder."""
    from relay.kernel import recipes

    return load_recipe(name) if ":" in name else recipes.get(name)


def recipe_params(spec: "RunSpec"):
    """The spec's `params:` as its recipe's Params model (a user recipe's own class is imported for it)."""
    from relay.shared.params import BUILT_IN

    params_class = BUILT_IN.get(spec.recipe) or recipe_class(spec.recipe).Params
    return params_class.model_validate(spec.params)


# -- the check behind the front door (relay.front_door.load_spec) ----------------------------------------
def check_code(spec: "RunSpec", source: str = "spec") -> bool:
    """Import-check the user's code the spec names (its folder, size and shape were checked when the spec
    loaded): the entry exists, a user recipe imports, is a Recipe, and its Params accept `params:`. SpecError
    `source: key: ...`; True when the check waits for the kernel (a module needing what kaggle.pip installs)."""
    from relay.shared.spec import SpecError

    try:
        return _check_code(spec)
    except SpecError as err:
        raise SpecError(f"{source}: {err}") from None


def _check_code(spec: "RunSpec") -> bool:
    from relay.shared.spec import validate_params

    code = spec.code
    if code is None:
        return False
    folder = Path(code.folder)
    _on_path(folder)
    if code.entry:
        parse_entry(code.entry, folder, pip=spec.kaggle.pip)
        return False
    recipe = load_recipe(spec.recipe, folder, pip=spec.kaggle.pip)
    if recipe is None:
        return True
    validate_params(spec, recipe.Params)
    return False


@contextlib.contextmanager
def _no_bytecode():
    """Import the user's code at spec load without writing __pycache__ into their folder: a spec check writes
    nothing, and the folder ships as it is."""
    before, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        yield
    finally:
        sys.dont_write_bytecode = before


def _third_party(err: BaseException, module: str, folder: Optional[Path]) -> Optional[str]:
    """The top-level package an import missed when it is not the user's own code (their folder, or the
    module named in the spec itself): one that kaggle.pip could install."""
    if not (isinstance(err, ModuleNotFoundError) and err.name):
        return None
    top = err.name.split(".")[0]
    own = module == err.name or module.startswith(err.name + ".")
    if own or (folder is not None and ((folder / top).is_dir() or (folder / f"{top}.py").is_file())):
        return None
    return top


def _hint(err: BaseException, module: str, folder: Optional[Path]) -> str:
    top = _third_party(err, module, folder)
    return f"; if {top} is a package to install, list it in kaggle.pip" if top else ""


def _module_file(module: str, folder: Path) -> bool:
    """Whether pkg.mod is a file in `folder`, found without importing anything (pkg/__init__.py may import
    what only kaggle.pip provides)."""
    path: object = [str(folder)]
    parts = module.split(".")
    for i in range(len(parts)):
        found = importlib.machinery.PathFinder.find_spec(".".join(parts[: i + 1]), path)
        if found is None:
            return False
        path = found.submodule_search_locations
        if path is None and i < len(parts) - 1:
            return False
    return True


def parse_entry(entry: str, folder: Path, pip: list[str] = ()) -> tuple[str, object, list[str]]:
    """("module", "pkg.mod:function", []), ("script", Path, args) or ("notebook", Path, args) for a .ipynb (its
    cells read, translated and compiled: relay.kernel.notebook); SpecError when it does not exist or cannot run."""
    from relay.shared.spec import SpecError

    if _MODULE_ENTRY.match(entry.strip()):
        module = entry.strip().split(":")[0]
        try:
            with _no_bytecode():  # find_spec("pkg.mod") runs pkg/__init__.py
                found = importlib.util.find_spec(module)
        except (ImportError, ValueError) as err:
            # The orchestrator never pip-installs: a package only kaggle.pip provides is checked in the kernel.
            if pip and _third_party(err, module, folder) and _module_file(module, folder):
                return "module", entry.strip(), []
            found, why = None, f" ({type(err).__name__}: {err}{_hint(err, module, folder)})"
        else:
            why = ""
        if found is None:
            raise SpecError(f"code.entry: module {module} not found in {folder}{why}")
        return "module", entry.strip(), []
    try:
        script, *args = shlex.split(entry)
    except ValueError as err:
        raise SpecError(f"code.entry: cannot split {entry!r} into a script and arguments ({err})") from None
    path = folder / script
    if not path.is_file():
        raise SpecError(f"code.entry: {script} not found in {folder} (expected a script with arguments, e.g."
                        " 'train.py --lr 3e-4', a notebook 'train.ipynb', or 'module:function')")
    if path.suffix == notebook.SUFFIX:
        try:
            notebook.read_cells(path)
        except notebook.NotebookError as err:
            raise SpecError(f"code.entry: {err}") from None
        return "notebook", path, args
    return "script", path, args


def load_recipe(path: str, folder: Optional[Path] = None, pip: list[str] = ()):
    """The Recipe subclass named "pkg.module:Class" (its folder already on sys.path). None when the module
    imports a package kaggle.pip installs at kernel start: `relay train` in the kernel checks it after pip."""
    from relay.kernel.recipes.base import Recipe, RecipeParams
    from relay.shared.spec import SpecError

    module_name, _, cls_name = path.partition(":")
    try:
        with _no_bytecode():
            module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - any failure to import the user's module is reported
        # The orchestrator never pip-installs: a package only kaggle.pip provides is checked in the kernel.
        if pip and _third_party(err, module_name, folder) and _module_file(module_name, folder):
            return None
        raise SpecError(f"recipe: cannot import {module_name} ({type(err).__name__}: {err}"
                        f"{_hint(err, module_name, folder)})") from None
    cls = getattr(module, cls_name, None)
    if cls is None:
        raise SpecError(f"recipe: {module_name} has no {cls_name}")
    if not (isinstance(cls, type) and issubclass(cls, Recipe)):
        raise SpecError(f"recipe: {path} is not a Recipe (expected a subclass of relay.Recipe)")
    if not (isinstance(getattr(cls, "Params", None), type) and issubclass(cls.Params, RecipeParams)):
        raise SpecError(f"recipe: {path}.Params must be a relay.RecipeParams subclass")
    return cls
