"""JAX's persistent compilation cache, as the commands use it.

A program that compiled once (a training step, an epoch's scan, the verifier's batched figures)
is read back from disk the next time instead of compiled again: a resumed run, a second audit
or a second run of the same config starts in seconds. ``naisnet-train`` and ``naisnet-verify``
turn it on by default in the user's cache folder; the library never does on its own.
"""

from __future__ import annotations

import os
import sys

#: Where the commands keep compiled programs: ``$NAISNET_JAX_CACHE`` if set (``none``: nowhere),
#: else ``$XDG_CACHE_HOME/naisnet_jax/jax_cache`` (``~/.cache/...``).
ENV = "NAISNET_JAX_CACHE"
#: Every program is stored, however quickly it compiled (JAX's own default keeps only those over
#: a second): a cold audit or first epoch also compiles a hundred or more small programs (eager
#: operations on the parameters among them), each slower to compile than to read back.
MIN_COMPILE_SECONDS = 0.0
#: The cache's size in bytes: beyond it JAX evicts the least recently used programs.
MAX_BYTES = 4 * 2**30


def default_directory() -> str:
    """The commands' cache folder (:data:`ENV`, else the user's cache folder)."""
    if os.environ.get(ENV):
        return os.environ[ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "naisnet_jax", "jax_cache")


def enable(directory: str | None = None) -> str | None:
    """Turn JAX's persistent compilation cache on in ``directory`` (default
    :func:`default_directory`; ``"none"``: leave it off) and return the folder, or ``None`` if it
    stays off. A cache the user configured for JAX itself (``JAX_COMPILATION_CACHE_DIR``) is kept.
    A folder that cannot be created leaves the cache off: a cache never stops the work; one the user
    named (``directory``, :data:`ENV`) says so in one line on stderr."""
    import jax

    if directory is None and jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    named = directory is not None or bool(os.environ.get(ENV))
    directory = directory or default_directory()
    if directory == "none":
        return None
    directory = os.path.abspath(os.path.expanduser(directory))
    try:
        os.makedirs(directory, exist_ok=True)
        usable = os.access(directory, os.W_OK)
        reason = "it cannot be written"
    except OSError as e:
        usable, reason = False, e.strerror or str(e)
    if not usable:
        if named:
            print(
                f"warning: the compilation cache {directory} cannot be used ({reason}); compiling without it.",
                file=sys.stderr,
                flush=True,
            )
        return None
    jax.config.update("jax_compilation_cache_dir", directory)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:  # else the user's threshold
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    if "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ:  # else the user's bound
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return directory
