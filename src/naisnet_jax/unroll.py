"""Unrolling a NAIS step: fixed depth, adaptive depth, and a trainable adaptive form.

``step`` maps a batched state ``x`` to the next state. It must treat patterns
(rows of the leading axis) independently, as every NAIS block does.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer.")
    return value


def check_scan_unroll(scan_unroll: Any) -> int | bool:
    """``lax.scan``'s ``unroll``: a positive int (steps per loop iteration) or a bool
    (``True`` unrolls the whole loop, ``False`` is 1)."""
    if isinstance(scan_unroll, bool):
        return scan_unroll
    if not isinstance(scan_unroll, int) or scan_unroll < 1:
        raise ValueError(
            f"scan_unroll={scan_unroll!r} must be a positive integer (steps per loop "
            f"iteration) or a bool (True unrolls every step)."
        )
    return scan_unroll


def _check_tol(tol: Any) -> float:
    if not isinstance(tol, (int, float)) or not (tol > 0):
        raise ValueError(f"tol={tol!r} must be a positive number.")
    return float(tol)


def unroll(
    step: Callable[..., Array],
    x0: Array,
    *,
    steps: int,
    trajectory: bool = False,
    xs: Any = None,
    scan_unroll: int | bool = 1,
):
    """Apply ``step`` ``steps`` times with ``lax.scan``.

    Plain-Python meaning::

        x, xs_out = x0, []
        for k in range(steps):
            x = step(x) if xs is None else step(x, xs[k])
            xs_out.append(x)
        return (x, stack(xs_out)) if trajectory else x

    ``xs`` (a pytree with leading axis ``steps``) carries per-step parameters
    for untied weights. With ``trajectory=True`` also returns the states
    ``x_1 .. x_K`` stacked on a new leading axis, shape ``(steps, *x0.shape)``.
    ``scan_unroll`` is ``lax.scan``'s ``unroll`` (steps per compiled loop
    iteration; ``True``: all of them); it changes speed and compile time, not
    the result.
    """
    _check_positive_int("steps", steps)
    check_scan_unroll(scan_unroll)
    if xs is not None:
        lengths = {leaf.shape[0] for leaf in jax.tree_util.tree_leaves(xs)}
        if lengths != {steps}:
            raise ValueError(
                f"per-step parameters xs have leading axis sizes {sorted(lengths)}, "
                f"which disagree with steps={steps}."
            )

    def body(x, p):
        x = step(x) if xs is None else step(x, p)
        return x, (x if trajectory else None)

    x, traj = lax.scan(body, x0, xs, length=steps, unroll=scan_unroll)
    return (x, traj) if trajectory else x


def _pattern_norm(d: Array) -> Array:
    """2-norm over every non-batch axis: shape ``(batch,)``."""
    return jnp.sqrt(jnp.sum(jnp.square(d), axis=tuple(range(1, d.ndim))))


def _freeze(active: Array, new: Array, old: Array) -> Array:
    mask = active.reshape(active.shape + (1,) * (new.ndim - 1))
    return jnp.where(mask, new, old)


def _adaptive_forward(step, tol, max_steps, x0, *consts):
    batch = x0.shape[0]

    def cond(carry):
        k, _, active, _ = carry
        return jnp.logical_and(k < max_steps, jnp.any(active))

    def body(carry):
        k, x, active, depth = carry
        x_new = step(x, *consts)
        moved = _pattern_norm(x_new - x)
        depth = depth + active.astype(depth.dtype)
        x = _freeze(active, x_new, x)
        active = jnp.logical_and(active, moved >= tol)
        return k + 1, x, active, depth

    init = (
        jnp.asarray(0, jnp.int32),
        x0,
        jnp.ones((batch,), bool),
        jnp.zeros((batch,), jnp.int32),
    )
    _, x, _, depth = lax.while_loop(cond, body, init)
    return x, depth


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _adaptive(step, tol, max_steps, x0, *consts):
    return _adaptive_forward(step, tol, max_steps, x0, *consts)


def _adaptive_fwd(step, tol, max_steps, x0, *consts):
    return _adaptive_forward(step, tol, max_steps, x0, *consts), None


def _adaptive_bwd(step, tol, max_steps, residuals, cotangents):
    raise ValueError(
        "unroll_adaptive stops with an unbounded lax.while_loop and cannot be "
        "differentiated in reverse mode. To train with a stopping threshold use "
        "unroll_adaptive_bounded(step, x0, tol=..., max_steps=...), which masks a "
        "lax.scan of max_steps steps and is differentiable."
    )


_adaptive.defvjp(_adaptive_fwd, _adaptive_bwd)


def unroll_adaptive(
    step: Callable[[Array], Array], x0: Array, *, tol: float, max_steps: int
) -> tuple[Array, Array]:
    """Unroll each pattern until its update is smaller than ``tol`` (inference).

    Plain-Python meaning, for each pattern ``i`` on its own::

        x, depth = x0[i], 0
        for k in range(max_steps):
            x_new = step(x)
            depth += 1
            done = norm(x_new - x) < tol        # 2-norm over non-batch axes
            x = x_new
            if done:
                break

    A pattern that has stopped is frozen while the others go on; the loop
    (``lax.while_loop``) ends when every pattern has stopped or after
    ``max_steps`` steps. Returns ``(x, depth)`` with ``depth`` an int32 array
    of shape ``(batch,)``.

    Reverse-mode differentiation raises an error: use
    :func:`unroll_adaptive_bounded` for training.
    """
    tol = _check_tol(tol)
    _check_positive_int("max_steps", max_steps)
    closed, consts = jax.closure_convert(step, x0)
    return _adaptive(closed, tol, max_steps, x0, *consts)


def unroll_adaptive_bounded(
    step: Callable[[Array], Array],
    x0: Array,
    *,
    tol: float,
    max_steps: int,
    trajectory: bool = False,
    scan_unroll: int | bool = 1,
):
    """Differentiable form of :func:`unroll_adaptive`: a masked scan of ``max_steps``.

    Same result and depth as :func:`unroll_adaptive` (same plain-Python
    meaning), but always runs ``max_steps`` steps with ``lax.scan``, freezing
    patterns once they have stopped, so reverse-mode gradients flow (the
    stopping decision itself is piecewise constant and gets no gradient).
    Returns ``(x, depth)``, or ``(x, depth, xs)`` with ``trajectory=True``,
    where ``xs[k]`` is the (frozen) state after step ``k + 1``. ``scan_unroll``
    as in :func:`unroll`.
    """
    tol = _check_tol(tol)
    _check_positive_int("max_steps", max_steps)
    check_scan_unroll(scan_unroll)
    batch = x0.shape[0]

    def body(carry, _):
        x, active, depth = carry
        x_new = step(x)
        moved = _pattern_norm(x_new - x)
        depth = depth + active.astype(depth.dtype)
        x = _freeze(active, x_new, x)
        active = jnp.logical_and(active, lax.stop_gradient(moved) >= tol)
        return (x, active, depth), (x if trajectory else None)

    init = (x0, jnp.ones((batch,), bool), jnp.zeros((batch,), jnp.int32))
    (x, _, depth), traj = lax.scan(body, init, None, length=max_steps, unroll=scan_unroll)
    return (x, depth, traj) if trajectory else (x, depth)
