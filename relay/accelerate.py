"""The Hugging Face Accelerate integration, on the public path `relay.accelerate` (docs/your-code.md): this path
stays when the module that defines it moves."""
from relay.kernel.integrations.accelerate import RelayAccelerate

__all__ = ["RelayAccelerate"]
