"""Stability verifier (importable as naisnet_jax.verify)."""
