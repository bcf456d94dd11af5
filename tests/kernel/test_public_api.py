"""What user code imports (docs/your-code.md, "What your code imports") is a short surface that does not move
with the package's inside: the documented names are exactly the ones the package exports, `import relay` needs
no torch, and scripts written against the paths documented before the package was split still run, inside the
session (the kernel bundle), with a DeprecationWarning naming the new path."""
from __future__ import annotations

import importlib
import io
import json
import re
import subprocess
import sys
import zipfile

import pytest
import yaml

from byo_fixtures import copy_example
from conftest import PYTHON, REPO, RelayCLI

# the paths documented before the package split -> the public names they now give
DEPRECATED = {"relay.integrations.hf": {"RelayCallback": "relay.hf.RelayCallback"},
              "relay.integrations.lightning": {"RelayLightningCallback": "relay.lightning.RelayLightningCallback"},
              "relay.recipes": {"Recipe": "relay.Recipe", "RecipeParams": "relay.RecipeParams"}}
# each example's import as the docs gave it before the split, and as they give it now
OLD_IMPORTS = {"byo-hf": ("from relay.integrations.hf import RelayCallback", "from relay.hf import RelayCallback"),
               "byo-lightning": ("from relay.integrations.lightning import RelayLightningCallback",
                                 "from relay.lightning import RelayLightningCallback"),
               "byo-recipe": ("from relay.recipes import Recipe, RecipeParams", "from relay import Recipe, RecipeParams")}


def documented_section() -> str:
    text = (REPO / "docs" / "your-code.md").read_text()
    return text.split("## What your code imports", 1)[1].split("\n## ", 1)[0]


def resolve(dotted: str):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_the_documented_names_are_exactly_the_public_surface_and_each_imports():
    import relay
    import relay.hf
    import relay.accelerate
    import relay.lightning

    documented = re.findall(r"^\| `(relay\.[\w.]+)` \|", documented_section(), re.M)
    exported = {f"{m.__name__}.{n}" for m in (relay, relay.hf, relay.lightning, relay.accelerate)
                for n in m.__all__}
    assert len(documented) == len(set(documented)) and set(documented) == exported, (documented, exported)
    for dotted in documented:
        obj = resolve(dotted)
        assert obj.__name__ == dotted.rpartition(".")[2], dotted
        if dotted.endswith("Error"):
            assert issubclass(obj, Exception), dotted
    assert set(dir(relay)) >= set(relay.__all__)
    with pytest.raises(AttributeError, match="no attribute 'open_sesion'"):
        relay.open_sesion  # noqa: B018 - a misspelt name fails as on any module


@pytest.mark.parametrize("old", list(DEPRECATED))
def test_an_old_path_gives_the_public_objects_with_a_warning_naming_the_new_path(old, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)  # imported afresh: the warning comes at import
    with pytest.warns(DeprecationWarning, match=re.escape(old) + " is deprecated: use") as caught:
        module = importlib.import_module(old)
    for name, public in DEPRECATED[old].items():
        assert getattr(module, name) is resolve(public)
        assert any(public.rpartition(".")[0] in str(w.message) for w in caught), public
    assert f"`{old}`" in documented_section()  # the docs list it among the old paths


BASE_INSTALL = """
import json, sys
sys.modules.update(dict.fromkeys(BLOCKED))  # not installed: importing one raises ImportError
before = set(sys.modules)
import relay
loaded = sorted(set(sys.modules) - before)
errors = [relay.InputError, relay.CheckpointError, relay.CorruptCheckpointError, relay.DiskBudgetError]
params = relay.RecipeParams
try:
    relay.open_session
except ModuleNotFoundError as err:
    missing = err.name
print(json.dumps({"loaded": loaded, "missing": missing, "params": params.__name__}))
"""


def test_import_relay_is_cheap_and_needs_no_torch(spawns_processes):
    """The orchestrator-only install has no torch: `import relay` loads nothing else of the package, the errors
    and RecipeParams come without torch, and the Session API says what is missing when it is used."""
    from relay.cli import TRAINING_STACK

    code = BASE_INSTALL.replace("BLOCKED", repr((*TRAINING_STACK, "lightning")))
    out = subprocess.run([PYTHON, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["loaded"] == ["relay"], found["loaded"]  # the names come on first use
    assert found["missing"] == "torch" and found["params"] == "RecipeParams"


def old_path_example(name: str, dest):
    """The example as the docs had it before the package split: its relay import on the old path, for a few steps."""
    spec = copy_example(name, dest, **{"optim.max_steps": 6, "optim.log_every_steps": 2})
    script = dest / ("mypkg/recipes.py" if name == "byo-recipe" else "train.py")
    old, new = OLD_IMPORTS[name]
    text = script.read_text()
    assert new in text, f"{script}: the example no longer imports `{new}`; update OLD_IMPORTS"
    script.write_text(text.replace(new, old))
    if name == "byo-recipe":
        data = yaml.safe_load(spec.read_text())
        data["params"].update(n_train=64, n_eval=16)
        data["optim"]["eval_every_steps"] = 6
        spec.write_text(yaml.safe_dump(data, sort_keys=False))
    return spec


def line_of(path, text: str) -> int:
    return next(n for n, line in enumerate(path.read_text().splitlines(), 1) if text in line)


# As on Kaggle, only the bundle's files import: the venv's editable install puts a finder on sys.meta_path that
# finds any relay.* module in the repository, which would hide a module the bundle lacks.
AS_IN_THE_KERNEL = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in"
                    " getattr(f, '__module__', '')]; ")


@pytest.mark.parametrize("example", list(OLD_IMPORTS))
def test_a_script_on_the_old_paths_runs_inside_the_kernel_bundle(example, tmp_path, spawns_processes):
    """`python -m relay train` from the kernel bundle alone, as a Kaggle session runs it (the failure was a
    ModuleNotFoundError there): the examples with their imports as the docs gave them before the split run to
    the end, and the entry script's warning names the new path at the user's line."""
    from relay.orchestrator.kaggle.bundle import build_bundle

    kernel = tmp_path / "kernel"
    zipfile.ZipFile(io.BytesIO(build_bundle().data)).extractall(kernel)
    spec = old_path_example(example, tmp_path / example)
    cli = RelayCLI(tmp_path / "cli")
    cli.env["PYTHONPATH"] = str(kernel)  # the bundle, not the repository
    where = subprocess.run([PYTHON, "-c", AS_IN_THE_KERNEL + "import relay, importlib.util; print(relay.__file__,"
                            " importlib.util.find_spec('relay.orchestrator'))"], env=cli.env, cwd=cli.cwd,
                           capture_output=True, text=True, timeout=60)
    assert where.stdout.split() == [str(kernel / "relay" / "__init__.py"), "None"], where.stdout + where.stderr
    train = AS_IN_THE_KERNEL + "import runpy; runpy.run_module('relay', run_name='__main__', alter_sys=True)"
    proc = subprocess.run([PYTHON, "-c", train, *cli.train_args(spec, tmp_path / "work", None, "--max-steps", "none")],
                          env=cli.env, cwd=cli.cwd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    progress = json.loads((tmp_path / "work" / "progress.json").read_text())
    assert progress["status"] == "done" and progress["global_step"] == 6
    old = OLD_IMPORTS[example][0].split()[1]
    if example != "byo-recipe":  # a module the entry imports is not __main__: Python's filter hides it there
        assert f"train.py:{line_of(spec.parent / 'train.py', old)}: " in proc.stderr  # the user's line, not ours
        assert f"{old} is deprecated: use" in proc.stderr, proc.stderr[-3000:]
