"""Test configuration: float64 everywhere, so references are exact enough to compare."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# One JAX compilation cache for the session, shared with the commands the tests start: many
# tests train the same tiny configs, and a program compiled once is then read back instead of
# compiled again (CI has two cores; compilation is most of the suite's time). Fresh per session.
_JAX_CACHE = tempfile.mkdtemp(prefix="naisnet-jax-test-cache-")
atexit.register(shutil.rmtree, _JAX_CACHE, ignore_errors=True)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _JAX_CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402 - after the environment above

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402


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
