"""The stability verifier, importable as ``naisnet_jax.verify``.

``audit_model(model, variables, inputs=...)`` audits a Flax model in memory and
``audit(checkpoint_dir)`` a checkpoint; both return a typed :class:`Certificate`
whose figures say whether they are proven, computed, estimated or measured.
"Certified" means Condition 1 is proven for the float32 operators the model
runs with. Numerics run in float64 (matmuls at highest precision, never TF32)
on the device, batched over blocks of one shape; only small Hessenberg and
dense eigenproblems go to the host. Building blocks: spectral radii of dense
matrices and of matrix-free operators (Arnoldi, an estimate with a residual),
Gershgorin discs and infinity-norm bounds read off convolution kernels, exact
spectra of periodic convolutions by FFT.
"""

from ._numerics import x64_scope
from .arnoldi import ArnoldiResult, arnoldi_eigs, arnoldi_eigs_batch, stack_operators
from .bounds import conv_inf_norm_bound, dense_gershgorin, gershgorin
from .certificate import (
    SCHEMA,
    BaselineParameters,
    BlockReport,
    Certificate,
    ConvParameters,
    DenseParameters,
    Equilibrium,
    Spectrum,
    Trajectory,
    Verdict,
    figure_status,
)
from .certify import AuditDataError, AuditOptions, ModelApplyError, audit, audit_model
from .operators import conv_matrix, conv_operator, dense_operator, jacobian_operator, operator_matrix
from .spectral import (
    SpectralResult,
    fft_conv_spectrum,
    power_norm_bound,
    power_norm_estimate,
    spectral_radius,
    spectral_radius_info,
)

__all__ = [
    "ArnoldiResult",
    "AuditDataError",
    "AuditOptions",
    "BaselineParameters",
    "BlockReport",
    "Certificate",
    "ConvParameters",
    "DenseParameters",
    "Equilibrium",
    "ModelApplyError",
    "SCHEMA",
    "SpectralResult",
    "Spectrum",
    "Trajectory",
    "Verdict",
    "arnoldi_eigs",
    "arnoldi_eigs_batch",
    "audit",
    "audit_and_report",
    "audit_model",
    "conv_inf_norm_bound",
    "conv_matrix",
    "conv_operator",
    "dense_gershgorin",
    "dense_operator",
    "fft_conv_spectrum",
    "figure_status",
    "gershgorin",
    "jacobian_operator",
    "operator_matrix",
    "power_norm_bound",
    "power_norm_estimate",
    "spectral_radius",
    "spectral_radius_info",
    "stack_operators",
    "x64_scope",
]

from .report import audit_and_report  # noqa: E402
