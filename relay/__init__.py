"""kaggle-relay: quota-sized, exactly-resumable training sessions chained through the Kaggle API.

What user code imports is this module and three beside it, documented in docs/your-code.md ("What your code
imports") and held there by tests/kernel/test_public_api.py:
    relay.open_session, relay.Session            the Session API, for your own loop
    relay.Recipe, relay.RecipeParams             a recipe of your own on the relay's loop
    relay.InputError, relay.CheckpointError,     what a script may catch
    relay.CorruptCheckpointError, relay.DiskBudgetError
    relay.hf.RelayCallback                       the Hugging Face Trainer callback
    relay.lightning.RelayLightningCallback       the Lightning callback
    relay.accelerate.RelayAccelerate             Hugging Face Accelerate in your own loop
These paths stay when the modules behind them move. Each name is imported on first use, so `import relay`
stays cheap and torch-free (an orchestrator-only install has no torch).
"""

__version__ = "0.1.0"

# public name -> the module that defines it (the only place that knows where the inside is)
_SURFACE = {
    "open_session": "relay.kernel.session.api",
    "Session": "relay.kernel.session.api",
    "Recipe": "relay.kernel.recipes.base",
    "RecipeParams": "relay.shared.params",
    "InputError": "relay.shared.errors",
    "CheckpointError": "relay.kernel.session.checkpoint",
    "CorruptCheckpointError": "relay.kernel.session.checkpoint",
    "DiskBudgetError": "relay.kernel.session.checkpoint",
}
__all__ = list(_SURFACE)


def __getattr__(name: str):
    if name in _SURFACE:
        import importlib

        return getattr(importlib.import_module(_SURFACE[name]), name)
    raise AttributeError(f"module 'relay' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_SURFACE})
