"""NAIS-Net in JAX/Flax."""
