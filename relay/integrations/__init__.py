"""Deprecated package: the callbacks' paths as documented before the package was split into shared/, kernel/
and orchestrator/. Their public paths are relay.hf and relay.lightning."""
