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
import functools

import jax
import numpy as np

U64 = 2.0**-53  # unit round-off of float64

#: XLA's options for the audit's programs. On a GPU XLA times the candidate kernels of every
#: convolution and product when it compiles a program (autotuning); an audit runs each of its
#: programs a few times, so a cold audit is mostly compilation and the timing costs more than the
#: fastest kernel wins back. Level 0 takes XLA's default kernel instead. Elsewhere it changes nothing.
COMPILER_OPTIONS = {"xla_gpu_autotune_level": 0}


def jit(fun=None, **kwargs):
    """``jax.jit`` with :data:`COMPILER_OPTIONS` where it compiles; as a decorator, with or without
    arguments. Called inside another traced function, where JAX takes no compiler options, it is
    the plain ``jax.jit`` and the outer program's options apply."""
    if fun is None:
        return functools.partial(jit, **kwargs)
    plain = jax.jit(fun, **kwargs)
    compiled = jax.jit(fun, compiler_options=COMPILER_OPTIONS, **kwargs)

    @functools.wraps(fun)
    def call(*args, **kw):
        traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves((args, kw)))
        return (plain if traced else compiled)(*args, **kw)

    return call


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
