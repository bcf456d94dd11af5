"""The Lightning callback, on the public path `relay.lightning` (docs/your-code.md): this path stays when the
module that defines it moves."""
from relay.kernel.integrations.lightning import RelayLightningCallback

__all__ = ["RelayLightningCallback"]
