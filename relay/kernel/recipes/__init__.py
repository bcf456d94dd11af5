"""Recipe registry: the spec's `recipe:` name -> class, imported when asked (torch). A spec is validated with
the torch-free Params of relay.shared.params, so loading one imports no recipe."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from relay.shared.params import BUILT_IN, RecipeParams

if TYPE_CHECKING:
    from relay.kernel.recipes.base import Recipe

_REGISTRY = {
    "legal_bert": "relay.kernel.recipes.legal_bert:LegalBertRecipe",
    "price_model": "relay.kernel.recipes.price_model:PriceModelRecipe",
    "recsys": "relay.kernel.recipes.recsys:RecsysRecipe",
    "temporal": "relay.kernel.recipes.temporal:TemporalRecipe",
    "toy": "relay.kernel.recipes.toy:ToyRecipe",
    "vqa_student": "relay.kernel.recipes.vqa_student:VQAStudentRecipe",
}


def names() -> list[str]:
    return sorted(_REGISTRY)


def get(name: str) -> type["Recipe"]:
    if ":" in name:  # a user recipe "pkg.module:Class" from the spec's code.folder (relay.kernel.usercode)
        from relay.kernel.usercode import load_recipe

        return load_recipe(name)
    if name not in _REGISTRY:
        raise KeyError(name)
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


def params_class(name: str) -> type[RecipeParams]:
    """The Params model of a recipe: a built-in's without importing the recipe (torch); a user recipe is
    imported (its module is the only place its Params live)."""
    return BUILT_IN[name] if name in BUILT_IN else get(name).Params


def params_of(spec) -> RecipeParams:
    """The spec's `params:` as its recipe's Params, built-in or the user's."""
    return params_class(spec.recipe).model_validate(spec.params)


def __getattr__(attr: str):  # `from relay.kernel.recipes import Recipe` keeps working, importing torch only then
    if attr == "Recipe":
        from relay.kernel.recipes.base import Recipe

        return Recipe
    raise AttributeError(attr)


__all__ = ["Recipe", "RecipeParams", "get", "names", "params_class", "params_of"]
