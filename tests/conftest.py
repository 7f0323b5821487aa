"""Test configuration: float64 everywhere, so references are exact enough to compare."""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_default_matmul_precision", "highest")

import pytest


@pytest.fixture(autouse=True, scope="session")
def _single_threaded_blas():
    """numpy's multi-threaded BLAS competes with XLA's threads for the CI's two
    cores and can make small eigen-problems many times slower; one thread is
    plenty for the matrices the tests build."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - threadpoolctl comes with scikit-learn
        yield
        return
    with threadpool_limits(limits=1, user_api="blas"):
        yield
