"""Callbacks that put other trainers (Hugging Face, Lightning) under a relay session. Kernel-side; user code
imports them from the public paths relay.hf and relay.lightning."""
