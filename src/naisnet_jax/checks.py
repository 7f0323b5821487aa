"""Argument checks shared by the whole package: one function per rule, one wording per error.

Every check takes the ``name`` to report (``"steps"``, ``"config.steps"``, ``"--samples"``, ...)
and raises ``ValueError`` naming the value and what was expected; it returns the value
unchanged. The domain rules built on them live beside their maths and are the only copies:
:func:`naisnet_jax.cell.check_step_size` (``h``), :func:`naisnet_jax.cell.check_activation`,
:func:`naisnet_jax.cell.check_kernel_shape`, :func:`naisnet_jax.parametrize.check_eps`,
:func:`naisnet_jax.projection.check_eta`. This module imports only numpy and jax, so every layer
(data, models, training, checkpoints, the verifier) may import it.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np


def check_int(name: str, value: Any, minimum: int = 1, maximum: int | None = None) -> Any:
    """``value`` is an integer (not a bool) in ``[minimum, maximum]``; ``maximum=None`` is unbounded."""
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    if ok and value >= minimum and (maximum is None or value <= maximum):
        return value
    if maximum is not None:
        expected = f"an integer in [{minimum}, {maximum}]"
    else:
        expected = {1: "a positive integer", 0: "a non-negative integer"}.get(minimum, f"an integer >= {minimum}")
    raise ValueError(f"{name}={value!r} must be {expected}.")


def _real(value: Any) -> float | None:
    """``value`` as a Python float if it is a real scalar (not a bool), else ``None``."""
    if isinstance(value, (bool, np.bool_, str, bytes)):
        return None
    try:
        array = np.asarray(value)
    except Exception:  # noqa: BLE001 - a tracer or an object numpy cannot read: not checkable as a number
        return None
    if array.ndim != 0 or array.dtype.kind not in "iuf":
        return None
    return float(array)


def check_real(name: str, value: Any) -> float:
    """``value`` is a real number (not a bool; NaN and inf allowed); returns it as a float."""
    x = _real(value)
    if x is None:
        raise ValueError(f"{name}={value!r} is not a number.")
    return x


def interval(lo: float, hi: float, lo_open: bool = False, hi_open: bool = False) -> str:
    """``"(0, 1]"``-style text of an interval."""
    return f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"


def check_number(
    name: str,
    value: Any,
    lo: float = -math.inf,
    hi: float = math.inf,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
    label: str | None = None,
    why: str = "",
) -> Any:
    """``value`` is a finite real number (not a bool) in the interval from ``lo`` to ``hi``.

    ``label`` names the interval symbolically (``"(eps, 1)"`` is written ``(eps, 1) = (0.01, 1)``);
    ``why`` is appended to the message (``": the proofs need h <= 1"``).
    """
    where = interval(lo, hi, lo_open, hi_open)
    where = f"{label} = {where}" if label else where
    x = _real(value)
    if x is None:
        raise ValueError(f"{name}={value!r} is not a number; expected one in {where}{why}.")
    inside = math.isfinite(x) and (x > lo if lo_open else x >= lo) and (x < hi if hi_open else x <= hi)
    if not inside:
        raise ValueError(f"{name}={value!r} is outside {where}{why}.")
    return value


def check_positive(name: str, value: Any) -> Any:
    """``value`` is a finite number ``> 0``."""
    return check_number(name, value, 0.0, math.inf, lo_open=True, hi_open=True)


def check_bool(name: str, value: Any) -> Any:
    """``value`` is ``True`` or ``False`` (a Python or numpy bool)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name}={value!r} must be True or False.")
    return value


def check_choice(name: str, value: Any, choices: Iterable, why: str = "") -> Any:
    """``value`` is one of ``choices``; ``why`` is appended to the message."""
    choices = tuple(choices)
    try:
        ok = value in choices
    except TypeError:  # an unhashable value in a dict's keys
        ok = False
    if not ok:
        raise ValueError(f"{name}={value!r} must be one of {choices}{why}.")
    return value


def check_finite(what: str, tree: Any, why: str = "") -> Any:
    """Every inexact leaf of ``tree`` is free of NaN and inf; the error names each bad leaf.

    Traced leaves (under ``jit``) cannot be checked here and pass; ``why`` is appended.
    """
    bad, total = [], 0
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    for path, leaf in leaves:
        if isinstance(leaf, jax.core.Tracer):
            continue
        values = np.asarray(leaf)
        if not np.issubdtype(values.dtype, np.inexact):
            continue
        count = int(values.size - np.count_nonzero(np.isfinite(values)))
        if count:
            total += count
            bad.append((f"{what}{jax.tree_util.keystr(path)}", count, values.size))
    if not bad:
        return tree
    if len(leaves) == 1 and not leaves[0][0]:  # a single array
        message = f"{what} has {total} non-finite entries (NaN or inf) out of {bad[0][2]}"
    else:
        message = f"{what} has {total} non-finite entries (NaN or inf): " + ", ".join(
            f"{label} ({count} of {size})" for label, count, size in bad
        )
    raise ValueError(f"{message}{why}.")


def _nearest_existing(path: str) -> str:
    """The deepest ancestor of ``path`` (or ``path`` itself) that exists."""
    current = os.path.abspath(path)
    while not os.path.exists(current):
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    return current


def _can_create_in(directory: str) -> bool:
    """Whether this process can create a file in ``directory``: the permission bits
    (``os.access``) and then a real attempt, a hidden empty file created and removed at once.
    The attempt is what counts where the bits say yes and the file system says no (``/sys`` and
    ``/proc``, a read-only mount, for root)."""
    if not os.access(directory, os.W_OK | os.X_OK):
        return False
    try:
        fd, probe = tempfile.mkstemp(prefix=".naisnet-write-check-", dir=directory)
    except OSError:
        return False
    os.close(fd)
    os.remove(probe)
    return True


def _check_creatable(name: str, path: str, what: str) -> None:
    """``path`` does not exist yet: the deepest existing ancestor must be a writable directory."""
    ancestor = _nearest_existing(path)
    if not os.path.isdir(ancestor):
        raise ValueError(f"{name}={path!r}: {ancestor} is a file, so {what} cannot be created under it.")
    if not _can_create_in(ancestor):
        raise ValueError(f"{name}={path!r}: {ancestor} is not writable, so {what} cannot be created there.")


def check_output_dir(name: str, path: str) -> str:
    """``path`` is a directory this process can write into, or can be created as one; checked
    before any work, leaving nothing behind (a file created there to find out is removed)."""
    if not str(path).strip():
        raise ValueError(f"{name} is empty; expected a directory.")
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ValueError(f"{name}={path!r} exists and is not a directory.")
        if not _can_create_in(path):
            raise ValueError(f"{name}={path!r} is not writable.")
    else:
        _check_creatable(name, path, "the directory")
    return path


def check_output_file(name: str, path: str) -> str:
    """``path`` is a file this process can write (replace: a new file beside it, renamed over
    it), or can create; checked before any work, leaving nothing behind."""
    if not str(path).strip():
        raise ValueError(f"{name} is empty; expected a file name.")
    if os.path.isdir(path) or str(path).endswith(os.sep):
        raise ValueError(f"{name}={path!r} is a directory; expected a file name.")
    if os.path.exists(path):
        if not os.access(path, os.W_OK) or not _can_create_in(os.path.dirname(os.path.abspath(path))):
            raise ValueError(f"{name}={path!r} is not writable.")
    else:
        _check_creatable(name, path, "the file")
    return path
