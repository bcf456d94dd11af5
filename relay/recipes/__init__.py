"""Recipe registry: the spec's `recipe:` name -> class. Imports are lazy so the spec loads fast."""
from __future__ import annotations

import importlib

from relay.recipes.base import Recipe, RecipeParams

_REGISTRY = {
    "legal_bert": "relay.recipes.legal_bert:LegalBertRecipe",
    "price_model": "relay.recipes.price_model:PriceModelRecipe",
    "recsys": "relay.recipes.recsys:RecsysRecipe",
    "temporal": "relay.recipes.temporal:TemporalRecipe",
    "toy": "relay.recipes.toy:ToyRecipe",
    "vqa_student": "relay.recipes.vqa_student:VQAStudentRecipe",
}


def names() -> list[str]:
    return sorted(_REGISTRY)


def get(name: str) -> type[Recipe]:
    if ":" in name:  # a user recipe "pkg.module:Class" from the spec's code.folder (relay.usercode)
        from relay.usercode import load_recipe

        return load_recipe(name)
    if name not in _REGISTRY:
        raise KeyError(name)
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


__all__ = ["Recipe", "RecipeParams", "get", "names"]
