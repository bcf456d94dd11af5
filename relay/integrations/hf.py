"""Deprecated path of the Hugging Face callback (documented before the package split): use relay.hf."""
import warnings

warnings.warn("relay.integrations.hf is deprecated: use `from relay.hf import RelayCallback`", DeprecationWarning,
              stacklevel=2)

from relay.hf import RelayCallback  # noqa: E402

__all__ = ["RelayCallback"]
