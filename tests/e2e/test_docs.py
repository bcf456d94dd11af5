"""The docs that are generated from the code (the spec, params and CLI references, the site's home page) match
the code and the README, so a changed field description or flag cannot leave a stale page behind."""
from __future__ import annotations

import importlib.util

from conftest import REPO


def _generator():
    spec = importlib.util.spec_from_file_location("gen_reference", REPO / "docs" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_reference_pages_match_the_code(monkeypatch):
    gen = _generator()
    monkeypatch.setenv("COLUMNS", "100")
    stale = [name for name, make in gen.PAGES.items()
             if (gen.REFERENCE / name).read_text() != make()]
    assert not stale, f"stale generated docs {stale}: run `make docs`"


def test_every_spec_field_is_described():
    from relay.shared.spec import RunSpec

    missing = []

    def walk(model, prefix=""):
        for name, field in model.model_fields.items():
            if not field.description:
                missing.append(prefix + name)
            sub = _generator()._submodel(field.annotation)
            if sub is not None and sub is not model:
                walk(sub, f"{prefix}{name}.")

    walk(RunSpec)
    assert not missing, f"spec keys without a description (shown in docs/reference/spec.md): {missing}"


def test_the_site_home_page_is_the_readme():
    readme = (REPO / "README.md").read_text()
    assert (REPO / "docs" / "index.md").read_text() == readme.replace("](docs/", "](")
