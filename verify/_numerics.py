"""Shared numerics of the audit: the float64 scope and rounding-error bounds.

Every *proven* figure of the certificate is an upper (or lower) bound computed
in float64 from the float32 values the model runs with, plus a bound on the
float64 rounding of that very computation: with ``u = 2^-53`` a sum of ``m``
terms is within ``gamma(m) * sum |terms|`` of exact, ``gamma(k) = k u / (1 - k u)``
(Higham, *Accuracy and Stability of Numerical Algorithms*, ch. 3). These
factors only ever make a verdict harder to reach.
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np

U64 = 2.0**-53  # unit round-off of float64


def gamma(k: int) -> float:
    """``k u / (1 - k u)`` in float64."""
    ku = k * U64
    return ku / (1 - ku)


@contextlib.contextmanager
def x64_scope():
    """float64 and full-precision matmuls for the audit, restored on exit.

    JAX's x64 switch is thread-local inside this context manager, so a user's
    training code running in float32 (x64 off) is not changed by an audit
    made in between; arrays created outside keep their dtypes. Matmul
    precision is "highest" (no TF32 on GPUs).
    """
    enable = getattr(jax, "enable_x64", None)
    if enable is None:  # older JAX
        from jax.experimental import enable_x64 as enable
    with enable(True), jax.default_matmul_precision("highest"):
        yield


def float32_h(h: float) -> float:
    """The step size a float32 forward pass multiplies by: ``float32(h)``."""
    return float(np.float32(h))


@contextlib.contextmanager
def single_threaded_blas():
    """numpy's BLAS on one thread for the small host eigenproblems of the audit (64 x 64
    Hessenbergs): threads only add overhead there, and on a busy machine they thrash. Uses
    threadpoolctl when it is installed; otherwise changes nothing."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        yield
        return
    with threadpool_limits(limits=1, user_api="blas"):
        yield
