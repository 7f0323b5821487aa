"""The fast paths of a tied NAIS block (``block_vjp="stacked"`` or ``"fused"``): the same values
and gradients as the plain ``lax.scan`` unroll, with hand-written VJPs and GPU kernels.

One module per engine, none importing another's kernels:

- :mod:`~naisnet_jax.kernels.stacked`: the stacked VJP in plain JAX, on any backend (one
  weight-gradient op for all K steps); the fallback of the others;
- :mod:`~naisnet_jax.kernels.triton_conv` and :mod:`~naisnet_jax.kernels.triton_dense`: a conv or
  dense block's K steps in one Triton kernel each way (any CUDA GPU);
- :mod:`~naisnet_jax.kernels.wgmma_split` and :mod:`~naisnet_jax.kernels.wgmma_tf32`: a conv
  block's kernels on Hopper's ``wgmma`` (Mosaic GPU), in split bfloat16 or in TF32, in the frame
  both share (:mod:`~naisnet_jax.kernels.wgmma_common`);
- :mod:`~naisnet_jax.kernels.conv`: a conv block's fused path over those engines;
- :mod:`~naisnet_jax.kernels.policy`: :class:`KernelPolicy`, the typed choice a caller passes,
  and the plan made from it; :mod:`~naisnet_jax.kernels.tuning`: every tiling table;
  :mod:`~naisnet_jax.kernels.common`: what the engines share.

Entry points: :func:`unroll_tied` (the stacked VJP of any linear operator),
:func:`unroll_tied_conv` and :func:`unroll_tied_dense` (the fused paths, which fall back to the
stacked VJP where their kernels do not run; ``KernelPolicy(interpret=True)`` runs the kernels in
Pallas' interpreter, the tests' path on a CPU).
"""

from naisnet_jax.kernels.conv import unroll_tied_conv
from naisnet_jax.kernels.policy import KernelPolicy
from naisnet_jax.kernels.stacked import conv_op, dense_op, on_side_stream, side_stream_conv, unroll_tied
from naisnet_jax.kernels.triton_dense import unroll_tied_dense

__all__ = [
    "KernelPolicy",
    "conv_op",
    "dense_op",
    "on_side_stream",
    "side_stream_conv",
    "unroll_tied",
    "unroll_tied_conv",
    "unroll_tied_dense",
]
