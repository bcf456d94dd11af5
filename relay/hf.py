"""The Hugging Face `Trainer` callback, on the public path `relay.hf` (docs/your-code.md): this path stays
when the module that defines it moves."""
from relay.kernel.integrations.hf import RelayCallback

__all__ = ["RelayCallback"]
