"""Callbacks that put other trainers (Hugging Face, Lightning) under a relay session. Kernel-side."""
