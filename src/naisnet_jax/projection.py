"""Algorithms 1 and 2: projections that keep NAIS blocks stable.

Both are pure pytree -> pytree functions, jittable, applied after every
optimiser update::

    params = optax.apply_updates(params, updates)
    params = project_params(params, eps=eps)

or, equivalently, as the *last* transformation of an optax chain::

    tx = optax.chain(optax.sgd(0.1, momentum=0.9), stability_projection(eps=eps))

State parameters are found by name in a Flax params tree: a dict holding
``"R"`` is a dense NAIS block (Algorithm 1); a dict holding ``"state_kernel"``
(and optionally ``"delta"``) is a convolutional one (Algorithm 2). Leading
axes (untied weights: one set per step) are projected step by step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from naisnet_jax.cell import check_state_kernel_shape
from naisnet_jax.parametrize import centre_mask, check_eps

Array = jax.Array
FC_KEY = "R"
CONV_KERNEL_KEY = "state_kernel"
CONV_DELTA_KEY = "delta"


def fc_delta(eps: float, relaxed: bool = False) -> float:
    """Algorithm 1's bound on ``||R^T R||_F``: ``1 - 2 eps``, or ``2 (1 - eps)`` relaxed."""
    check_eps(eps)
    return 2.0 * (1.0 - eps) if relaxed else 1.0 - 2.0 * eps


def check_eta(eta: float, eps: float) -> float:
    if not (eps < float(eta) < 1.0):
        raise ValueError(f"eta={eta!r} is outside (eps, 1) = ({eps}, 1).")
    return eta


def project_fc(R: Array, *, eps: float, relaxed: bool = False) -> Array:
    """Algorithm 1: project ``R`` onto ``{R : ||R^T R||_F <= delta}``.

    ``delta = 1 - 2 eps`` (default) puts every eigenvalue of
    ``I + h diag(s) A`` with ``A = -R^T R - eps I``, ``s in [s_min, 1]``,
    ``0 < h <= 1``, on the real interval ``[1 - h (1 - eps), 1 - h s_min eps]``
    (critically damped, monotone trajectories). ``relaxed=True`` uses
    ``delta = 2 (1 - eps)``: still stable for ReLU, but eigenvalues may be
    negative and trajectories may oscillate.

    Feasible ``R`` is returned unchanged; otherwise
    ``R <- sqrt(delta) R / sqrt(||R^T R||_F)``, which scales ``||R^T R||_F``
    to exactly ``delta``. ``R`` may carry leading axes (per-step factors).
    """
    delta = fc_delta(eps, relaxed)
    if R.ndim < 2:
        raise ValueError(f"R must have shape (..., r, n); got shape {R.shape}.")
    # Work with R / max|R| so that ||R^T R||_F cannot overflow for huge R (a
    # diverging optimiser); the projected point is the same, R's direction kept.
    peak = jnp.max(jnp.abs(R), axis=(-2, -1), keepdims=True)
    peak = jnp.where(peak > 0, peak, 1.0).astype(R.dtype)
    unit = R / peak
    gram = jnp.einsum("...ri,...rj->...ij", unit, unit, precision=jax.lax.Precision.HIGHEST)
    unit_norm = jnp.sqrt(jnp.sum(gram * gram, axis=(-2, -1), keepdims=True))
    norm = unit_norm * peak * peak  # ||R^T R||_F (may be inf; the comparison still holds)
    projected = unit * jnp.sqrt(delta / jnp.maximum(unit_norm, jnp.finfo(R.dtype).tiny)).astype(R.dtype)
    # ``where`` keeps the feasible branch bit-exact.
    return jnp.where(norm > delta, projected, R)


def project_conv(
    kernel: Array, delta: Array, *, eps: float, eta: float
) -> tuple[Array, Array]:
    """Algorithm 2: keep a convolutional state kernel inside its Gershgorin set.

    Per output channel ``c`` (``kernel`` is HWIO ``(k, k, C, C)``):

    1. ``delta_c <- clip(delta_c, -1 + eta, 1 - eta)``;
    2. the centre tap of channel ``c``'s own filter, ``kernel[p, p, c, c]``,
       is set to ``-1 - delta_c``;
    3. if the absolute sum of every *other* tap feeding channel ``c`` (all
       positions of all input channels) exceeds ``1 - eps - |delta_c|``,
       those taps are scaled down so the sum equals it.

    Afterwards every Gershgorin disc of the dense convolution operator ``A``
    lies in ``{z : |z + 1| <= 1 - eps}`` and ``||I + h A||_inf <= 1 - h eps``
    for ``0 < h <= 1``. Leading axes (per-step kernels) are allowed, with
    ``delta`` of shape ``(..., C)``. Returns ``(kernel, delta)``.
    """
    check_eps(eps)
    check_eta(eta, eps)
    check_state_kernel_shape(kernel.shape)
    c = kernel.shape[-1]
    if delta.shape != kernel.shape[:-4] + (c,):
        raise ValueError(
            f"delta must have shape {kernel.shape[:-4] + (c,)} for a state kernel of "
            f"shape {kernel.shape}; got {delta.shape}."
        )
    delta = jnp.clip(delta, -1.0 + eta, 1.0 - eta)
    mask = centre_mask(kernel.shape, kernel.dtype)
    others = kernel * (1 - mask)
    radius = jnp.sum(jnp.abs(others), axis=(-4, -3, -2))  # (..., C)
    budget = 1.0 - eps - jnp.abs(delta)
    scale = jnp.where(radius > budget, budget / jnp.where(radius > 0, radius, 1.0), 1.0)
    others = jnp.where(
        (radius > budget)[..., None, None, None, :],
        others * scale[..., None, None, None, :].astype(kernel.dtype),
        others,
    )
    centre = (-1.0 - delta)[..., None, None, None, :].astype(kernel.dtype)
    return others + centre * mask, delta


def _project_node(node: dict, eps: float, eta: float, relaxed: bool) -> dict:
    node = dict(node)
    if FC_KEY in node:
        node[FC_KEY] = project_fc(node[FC_KEY], eps=eps, relaxed=relaxed)
    if CONV_KERNEL_KEY in node:
        kernel = node[CONV_KERNEL_KEY]
        check_state_kernel_shape(kernel.shape)
        delta = node.get(CONV_DELTA_KEY)
        if delta is None:
            zeros = jnp.zeros(kernel.shape[:-4] + kernel.shape[-1:], kernel.dtype)
            node[CONV_KERNEL_KEY], _ = project_conv(kernel, zeros, eps=eps, eta=eta)
        else:
            node[CONV_KERNEL_KEY], node[CONV_DELTA_KEY] = project_conv(
                kernel, delta, eps=eps, eta=eta
            )
    return node


def project_params(
    params: Any, *, eps: float, eta: float = 0.5, relaxed: bool = False
) -> Any:
    """Project every NAIS block's state parameters in a (Flax) params tree.

    Dicts holding ``"R"`` get Algorithm 1; dicts holding ``"state_kernel"``
    get Algorithm 2 (with ``delta = 0`` when the block has no ``"delta"``).
    Everything else is returned as is.
    """
    check_eps(eps)
    check_eta(eta, eps)

    def visit(node):
        if not _is_mapping(node):
            return node
        items = dict(node.items())
        if FC_KEY in items or CONV_KERNEL_KEY in items:
            items = _project_node(items, eps, eta, relaxed)
        out = {k: v if _is_leaf(v) else visit(v) for k, v in items.items()}
        return out if isinstance(node, dict) else type(node)(out)

    return visit(params)


def _is_leaf(x) -> bool:
    return hasattr(x, "shape")


def _is_mapping(x) -> bool:
    return hasattr(x, "items") and not _is_leaf(x)


def iter_state_blocks(params: Any, path: tuple[str, ...] = ()):
    """Yield ``(path, node)`` for every NAIS block's parameter dict in a tree.

    ``node`` holds ``"R"`` (dense block) or ``"state_kernel"`` (and maybe
    ``"delta"``, conv block); ``path`` is the tuple of keys leading to it.
    """
    if not _is_mapping(params):
        return
    if FC_KEY in params or CONV_KERNEL_KEY in params:
        yield path, params
    for key, value in params.items():
        if not _is_leaf(value):
            yield from iter_state_blocks(value, path + (str(key),))


def count_projected_blocks(params: Any) -> int:
    """Number of NAIS blocks :func:`project_params` would project."""
    return sum(1 for _ in iter_state_blocks(params))


class StabilityProjectionState(NamedTuple):
    """No state: the projection is a function of the parameters alone."""


def stability_projection(
    *, eps: float, eta: float = 0.5, relaxed: bool = False
) -> optax.GradientTransformation:
    """Optax transform that makes ``params + updates`` satisfy Algorithms 1 and 2.

    The returned updates are ``project_params(params + updates) - params``, so
    ``optax.apply_updates(params, updates)`` lands exactly on the projected
    parameters. It reads ``params``, so it must be the **last** transformation
    of a chain (anything after it would move the parameters off the set).
    """
    check_eps(eps)
    check_eta(eta, eps)

    def init_fn(params):
        del params
        return StabilityProjectionState()

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError(
                "stability_projection needs params: call tx.update(updates, state, params)."
            )
        new_params = optax.apply_updates(params, updates)
        projected = project_params(new_params, eps=eps, eta=eta, relaxed=relaxed)
        # Only the state parameters change; elsewhere updates pass through
        # untouched (no params + u - params round-off).
        new_updates = _replace_state_updates(updates, params, projected)
        return new_updates, state

    return optax.GradientTransformation(init_fn, update_fn)


def _replace_state_updates(updates, params, projected):
    if _is_mapping(updates):
        out = {}
        for key, u in updates.items():
            p, q = params[key], projected[key]
            if key in (FC_KEY, CONV_KERNEL_KEY, CONV_DELTA_KEY) and _is_leaf(u):
                out[key] = (q - p).astype(u.dtype)
            else:
                out[key] = _replace_state_updates(u, p, q)
        return out if isinstance(updates, dict) else type(updates)(out)
    return updates
