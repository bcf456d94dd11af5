"""kaggle-relay: quota-sized, exactly-resumable training sessions chained through the Kaggle API."""

__version__ = "0.1.0"


def __getattr__(name):
    # `relay.open_session` / `relay.Session` for user scripts, imported lazily (torch is heavy for the CLI)
    if name in ("open_session", "Session"):
        from relay.kernel.session import api

        return getattr(api, name)
    raise AttributeError(f"module 'relay' has no attribute {name!r}")
