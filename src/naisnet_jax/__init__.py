"""NAIS-Net in JAX/Flax: stable non-autonomous residual blocks and their projections.

The pure core (cells, parametrisations, projections, unrolls) needs only jax,
optax and numpy; Flax models live in :mod:`naisnet_jax.models`, training in
:mod:`naisnet_jax.train`, and the stability verifier in :mod:`naisnet_jax.verify`.
"""

from naisnet_jax.cell import ACTIVATIONS, activation_slope, conv_same, conv_step, fc_step
from naisnet_jax.kernels import KernelPolicy, unroll_tied, unroll_tied_conv, unroll_tied_dense
from naisnet_jax.parametrize import centre_mask, conv_state_kernel, fc_state_matrix
from naisnet_jax.projection import (
    NoNaisBlockWarning,
    count_projected_blocks,
    fc_delta,
    iter_state_blocks,
    project_conv,
    project_fc,
    project_params,
    stability_projection,
)
from naisnet_jax.unroll import (
    unroll,
    unroll_adaptive,
    unroll_adaptive_bounded,
    unroll_adaptive_stream,
)

__version__ = "0.1.0"

__all__ = [
    "ACTIVATIONS",
    "KernelPolicy",
    "NoNaisBlockWarning",
    "activation_slope",
    "centre_mask",
    "conv_same",
    "conv_state_kernel",
    "conv_step",
    "count_projected_blocks",
    "fc_delta",
    "fc_state_matrix",
    "fc_step",
    "iter_state_blocks",
    "project_conv",
    "project_fc",
    "project_params",
    "stability_projection",
    "unroll",
    "unroll_adaptive",
    "unroll_adaptive_bounded",
    "unroll_adaptive_stream",
    "unroll_tied",
    "unroll_tied_conv",
    "unroll_tied_dense",
]
