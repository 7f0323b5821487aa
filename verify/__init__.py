"""The stability verifier, importable as ``naisnet_jax.verify``.

Numerics (float64, or float32 at highest matmul precision; never TF32):
spectral radii of dense matrices and of matrix-free operators (Arnoldi through
plain calls of a linear function), Gershgorin discs and infinity-norm bounds
read off convolution kernels, exact spectra of periodic convolutions by FFT.
"""

from .bounds import conv_inf_norm_bound, dense_gershgorin, gershgorin
from .operators import conv_matrix, conv_operator, dense_operator, jacobian_operator, operator_matrix
from .spectral import (
    ArnoldiResult,
    SpectralResult,
    arnoldi_eigs,
    fft_conv_spectrum,
    power_norm_bound,
    spectral_radius,
    spectral_radius_info,
)

__all__ = [
    "ArnoldiResult",
    "SpectralResult",
    "arnoldi_eigs",
    "conv_inf_norm_bound",
    "conv_matrix",
    "conv_operator",
    "dense_gershgorin",
    "dense_operator",
    "fft_conv_spectrum",
    "gershgorin",
    "jacobian_operator",
    "operator_matrix",
    "power_norm_bound",
    "spectral_radius",
    "spectral_radius_info",
]

from .certify import SCHEMA, AuditOptions, audit  # noqa: E402
from .cli import audit_and_report  # noqa: E402

__all__ += ["SCHEMA", "AuditOptions", "audit", "audit_and_report"]
