"""Deprecated path of the Lightning callback (documented before the package split): use relay.lightning."""
import warnings

warnings.warn("relay.integrations.lightning is deprecated: use `from relay.lightning import RelayLightningCallback`",
              DeprecationWarning, stacklevel=2)

from relay.lightning import RelayLightningCallback  # noqa: E402

__all__ = ["RelayLightningCallback"]
