"""The GPU kernels' shared pieces (the engines themselves are :mod:`naisnet_jax.block_vjp`,
:mod:`naisnet_jax.fused_block`, :mod:`naisnet_jax.fused_dense`, :mod:`naisnet_jax.hopper_block` and
:mod:`naisnet_jax.hopper_tf32`)."""
