"""Recipe registry: the spec's `recipe:` name -> class, imported when asked (torch). A spec is validated with
the torch-free Params of relay.shared.params, so loading one imports no recipe."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from relay.shared.params import RecipeParams

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
    """A built-in recipe's class (a user's `pkg.module:Class` is relay.kernel.usercode.recipe_class)."""
    if name not in _REGISTRY:
        raise KeyError(name)
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


def __getattr__(attr: str):  # `from relay.kernel.recipes import Recipe` keeps working, importing torch only then
    if attr == "Recipe":
        from relay.kernel.recipes.base import Recipe

        return Recipe
    raise AttributeError(attr)


__all__ = ["Recipe", "RecipeParams", "get", "names"]
