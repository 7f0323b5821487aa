"""Algorithms 1 and 2: projections that keep NAIS blocks stable.

Both are pure pytree -> pytree functions, jittable, applied after every
optimiser update::

    params = optax.apply_updates(params, updates)
    params = project_params(params, eps=eps)

or, equivalently, as the *last* transformation of an optax chain::

    tx = optax.chain(optax.sgd(0.1, momentum=0.9), stability_projection(eps=eps))

State parameters are found by leaf name in any params pytree (dict,
``FrozenDict``, ``nnx.State``, ``nnx.Param``-boxed leaves): a leaf named
``"R"`` is a dense NAIS block's (Algorithm 1); a leaf named ``"state_kernel"``,
with the ``"delta"`` beside it if any, a convolutional one's (Algorithm 2).
Leading axes (untied weights: one set per step) are projected step by step.
The result always has the input's tree structure.
"""

from __future__ import annotations

from typing import Any

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


# --------------------------------------------------------------------------- trees
#
# The functions below walk any pytree (dict, FrozenDict, nnx.State, leaves wrapped
# in nnx.Param or nn.Partitioned, NamedTuples, ...) with jax.tree_util's path
# functions and never rebuild a container by hand, so their output has exactly
# the input's tree structure.

_STATE_NAMES = (FC_KEY, CONV_KERNEL_KEY, CONV_DELTA_KEY)
_WRAPPER_ATTRS = ("value", "raw_value")  # nnx.Variable / nn.Partitioned hold the array here


def _entry_name(entry) -> str:
    """The name a key-path entry gives its child: dict key, attribute, or index."""
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def _leaf_names(path) -> tuple[str, ...]:
    """A leaf's path as names, without the trailing ``.value`` of boxed leaves
    (``nnx.Param``, ``nn.Partitioned``): ``("block", "R")`` for both a plain
    ``{"block": {"R": array}}`` and ``{"block": {"R": nnx.Param(array)}}``."""
    path = list(path)
    while path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name in _WRAPPER_ATTRS:
        path.pop()
    return tuple(_entry_name(e) for e in path)


def _state_leaves(tree: Any):
    """``(leaves, treedef, blocks)``: the flattened tree and, per NAIS block
    (keyed by its parent path, in flattening order), the leaf index of each
    state parameter it holds, e.g. ``{("block",): {"R": 3}}``."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    blocks: dict[tuple[str, ...], dict[str, int]] = {}
    named = [(_leaf_names(path), i) for i, (path, _) in enumerate(flat)]
    parents = {names[:-1] for names, _ in named if names and names[-1] in (FC_KEY, CONV_KERNEL_KEY)}
    for names, i in named:
        if names and names[-1] in _STATE_NAMES and names[:-1] in parents:
            blocks.setdefault(names[:-1], {})[names[-1]] = i
    return [leaf for _, leaf in flat], treedef, blocks


def _project_block(leaves: list, block: dict[str, int], eps: float, eta: float, relaxed: bool) -> dict[int, Any]:
    """The projected state leaves of one block, by leaf index."""
    out = {}
    if FC_KEY in block:
        i = block[FC_KEY]
        out[i] = project_fc(jnp.asarray(leaves[i]), eps=eps, relaxed=relaxed)
    if CONV_KERNEL_KEY in block:
        i = block[CONV_KERNEL_KEY]
        kernel = jnp.asarray(leaves[i])
        check_state_kernel_shape(kernel.shape)
        j = block.get(CONV_DELTA_KEY)
        if j is None:
            zeros = jnp.zeros(kernel.shape[:-4] + kernel.shape[-1:], kernel.dtype)
            out[i], _ = project_conv(kernel, zeros, eps=eps, eta=eta)
        else:
            out[i], out[j] = project_conv(kernel, jnp.asarray(leaves[j]), eps=eps, eta=eta)
    return out


def _projected_leaves(tree: Any, eps: float, eta: float, relaxed: bool):
    """``(leaves, treedef, projected)``; ``projected`` maps leaf index -> new value."""
    leaves, treedef, blocks = _state_leaves(tree)
    projected: dict[int, Any] = {}
    for block in blocks.values():
        projected.update(_project_block(leaves, block, eps, eta, relaxed))
    return leaves, treedef, projected


def project_params(
    params: Any, *, eps: float, eta: float = 0.5, relaxed: bool = False
) -> Any:
    """Project every NAIS block's state parameters in a params pytree.

    Blocks are found by leaf name: a leaf named ``"R"`` gets Algorithm 1; a
    leaf named ``"state_kernel"`` gets Algorithm 2 together with the
    ``"delta"`` beside it (same parent path), or with ``delta = 0`` when the
    block has none. Every other leaf is returned as is, and the result has
    exactly the structure of ``params``: a dict, a ``FrozenDict``, an
    ``nnx.State``, leaves boxed in ``nnx.Param``, ...
    """
    check_eps(eps)
    check_eta(eta, eps)
    leaves, treedef, projected = _projected_leaves(params, eps, eta, relaxed)
    return jax.tree_util.tree_unflatten(treedef, [projected.get(i, leaf) for i, leaf in enumerate(leaves)])


def iter_state_blocks(params: Any):
    """Yield ``(path, node)`` for every NAIS block in a params pytree.

    ``path`` is the tuple of names leading to the block (the parent of its
    ``"R"`` or ``"state_kernel"`` leaf); ``node`` is a plain nested dict of the
    block's sub-tree with unboxed array leaves (``node["R"]``, or
    ``node["state_kernel"]`` and maybe ``node["delta"]``, and the block's
    other parameters such as ``node["input"]["kernel"]``), whatever container
    ``params`` is. Plain-Python meaning::

        for path in parents_of_state_leaves(params):   # flattening order
            yield path, {rest: leaf for (path + rest), leaf in leaves(params)}
    """
    flat = [(_leaf_names(p), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]]
    _, _, blocks = _state_leaves(params)
    for parent in blocks:
        node: dict = {}
        for names, leaf in flat:
            if len(names) > len(parent) and names[: len(parent)] == parent:
                *inner, last = names[len(parent):]
                target = node
                for name in inner:
                    target = target.setdefault(name, {})
                target[last] = leaf
        yield parent, node


def count_projected_blocks(params: Any) -> int:
    """Number of NAIS blocks :func:`project_params` would project."""
    return len(_state_leaves(params)[2])


def stability_projection(
    *, eps: float, eta: float = 0.5, relaxed: bool = False
) -> optax.GradientTransformation:
    """Optax transform that makes ``params + updates`` satisfy Algorithms 1 and 2.

    The returned updates are ``project_params(params + updates) - params`` on
    the state parameters and the incoming updates, untouched, everywhere else,
    so ``optax.apply_updates(params, updates)`` lands exactly on the projected
    parameters. It reads ``params``, so it must be the **last** transformation
    of a chain (anything after it would move the parameters off the set).
    Works on any params pytree (dict, ``FrozenDict``, ``nnx.State`` inside
    ``nnx.Optimizer``); the updates keep their structure.
    """
    check_eps(eps)
    check_eta(eta, eps)

    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError(
                "stability_projection needs params: call tx.update(updates, state, params)."
            )
        u_leaves, u_def = jax.tree_util.tree_flatten(updates)
        p_leaves, p_def = jax.tree_util.tree_flatten(params)
        if len(u_leaves) != len(p_leaves):
            raise ValueError(
                f"stability_projection: updates and params differ in structure "
                f"({len(u_leaves)} vs {len(p_leaves)} leaves): {u_def} vs {p_def}."
            )
        new_params = optax.apply_updates(params, updates)
        leaves, _, projected = _projected_leaves(new_params, eps, eta, relaxed)
        # Only the state parameters change; elsewhere updates pass through
        # untouched (no params + u - params round-off).
        out = [
            (projected[i] - p_leaves[i]).astype(u.dtype) if i in projected else u
            for i, u in enumerate(u_leaves)
        ]
        return jax.tree_util.tree_unflatten(u_def, out), state

    return optax.GradientTransformation(init_fn, update_fn)
