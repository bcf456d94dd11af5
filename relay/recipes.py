"""Deprecated path of a user recipe's base classes (documented before the package split): use relay.Recipe and
relay.RecipeParams. Recipe is looked up on first use, as there, so importing this module needs no torch."""
import warnings

import relay

warnings.warn("relay.recipes is deprecated: use `from relay import Recipe, RecipeParams`", DeprecationWarning,
              stacklevel=2)

__all__ = ["Recipe", "RecipeParams"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(relay, name)
    raise AttributeError(f"module 'relay.recipes' has no attribute {name!r}")
