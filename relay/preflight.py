"""Deprecated name of relay.front_door (the spec loader every command and flow uses): "preflight" also names
the Trainer's out-of-memory probe before training (session/loop.py). Kept importable, with a warning, for
code that still imports it."""
import warnings

from relay.front_door import load_spec

warnings.warn("relay.preflight is renamed relay.front_door", DeprecationWarning, stacklevel=2)

__all__ = ["load_spec"]
