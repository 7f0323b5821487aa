"""Unrolling a NAIS step: fixed depth, adaptive depth, and a trainable adaptive form.

``step`` maps a batched state ``x`` to the next state. It must treat patterns
(rows of the leading axis) independently, as every NAIS block does.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from naisnet_jax.checks import check_bool, check_int, check_positive

Array = jax.Array


def check_scan_unroll(scan_unroll: Any) -> int | bool:
    """``lax.scan``'s ``unroll``: a positive int (steps per loop iteration) or a bool
    (``True`` unrolls the whole loop, ``False`` is 1)."""
    if isinstance(scan_unroll, bool):
        return scan_unroll
    if not isinstance(scan_unroll, int) or scan_unroll < 1:
        raise ValueError(
            f"scan_unroll={scan_unroll!r} must be a bool (True unrolls every step) or an int >= 1 "
            f"(steps per loop iteration)."
        )
    return scan_unroll


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
    check_int("steps", steps)
    check_bool("trajectory", trajectory)
    check_scan_unroll(scan_unroll)
    if xs is not None:
        lengths = {leaf.shape[0] for leaf in jax.tree_util.tree_leaves(xs)}
        if lengths != {steps}:
            raise ValueError(
                f"per-step parameters xs have leading axis sizes {sorted(lengths)}, which disagree with steps={steps}."
            )

    def body(x, p):
        x = step(x) if xs is None else step(x, p)
        return x, (x if trajectory else None)

    args = () if xs is None else (jax.tree.map(lambda a: a[0], xs),)
    with _step_named(x0, step, *args):
        x, traj = lax.scan(body, x0, xs, length=steps, unroll=scan_unroll)
    return (x, traj) if trajectory else x


def _pattern_norm(d: Array) -> Array:
    """2-norm over every non-batch axis: shape ``(batch,)``."""
    return jnp.sqrt(jnp.sum(jnp.square(d), axis=tuple(range(1, d.ndim))))


def _freeze(active: Array, new: Array, old: Array) -> Array:
    mask = active.reshape(active.shape + (1,) * (new.ndim - 1))
    return jnp.where(mask, new, old)


#: Steps of a ``check_every`` chunk compiled as straight-line code (the rest loops): a GPU
#: loop iteration costs about as much as a 1024 x 256 block step (~10 us on an H100), so a
#: chunk run as a loop would pay it on every step, and the adaptive unroll could not beat
#: the fixed one. Chunks of up to this many steps are one loop iteration.
CHUNK_UNROLL = 32


def _masked_chunk(step, tol, max_steps, length):
    """``length`` steps of the per-pattern rule on a batch, as one ``lax.scan`` unrolled by
    up to :data:`CHUNK_UNROLL` steps.

    Plain meaning, for every row ``i`` at once (``inputs`` are per-row)::

        for _ in range(length):
            if active[i]:
                x_new = step(x[i], inputs[i]); depth[i] += 1
                active[i] = not norm(x_new - x[i]) < tol and depth[i] < max_steps
                x[i] = x_new
    """

    def run(x, inputs, active, depth):
        def body(carry, _):
            x, active, depth = carry
            x_new = step(x, inputs)
            moved = _pattern_norm(x_new - x)
            depth = depth + active.astype(depth.dtype)
            x = _freeze(active, x_new, x)
            active = active & ~(moved < tol) & (depth < max_steps)  # a NaN move is no convergence
            return (x, active, depth), None

        (x, active, depth), _ = lax.scan(
            body, (x, active, depth), None, length=length, unroll=min(length, CHUNK_UNROLL)
        )
        return x, active, depth

    return run


def _while_active(chunk, inputs, carry, more):
    """``while more(active): (x, active, depth) = chunk(...)``."""
    return lax.while_loop(lambda c: more(c[1]), lambda c: chunk(c[0], inputs, c[1], c[2]), carry)


def _phase_sizes(batch: int) -> list[int]:
    """Buffer sizes of the compacting unroll: halve while above a sixteenth of the batch."""
    sizes, floor = [batch], max(1, -(-batch // 16))
    while sizes[-1] > floor:
        sizes.append(-(-sizes[-1] // 2))
    return sizes


def _take(tree, index):
    return jax.tree.map(lambda a: a[index], tree)


def _adaptive_forward(steps, tol, max_steps, check_every, compact, x0, inputs, *consts):
    """``steps``: one ``(closed step, number of its consts)`` per buffer size."""
    chunks, start = [], 0
    for step, count in steps:
        phase_consts = consts[start : start + count]
        start += count
        chunks.append(_masked_chunk(lambda x, inp, f=step, c=phase_consts: f(x, inp, *c), tol, max_steps, check_every))
    batch = x0.shape[0]
    carry = (x0, jnp.ones((batch,), bool), jnp.zeros((batch,), jnp.int32))
    if not compact:
        x, _, depth = _while_active(chunks[0], inputs, carry, jnp.any)
        return x, depth
    sizes = _phase_sizes(batch)
    out_x, out_depth, rows = x0, carry[2], jnp.arange(batch)
    for i in range(len(sizes)):
        nxt = sizes[i + 1] if i + 1 < len(sizes) else 0
        carry = _while_active(chunks[i], inputs, carry, lambda a, n=nxt: jnp.sum(a) > n)
        x, active, depth = carry
        out_x, out_depth = out_x.at[rows].set(x), out_depth.at[rows].set(depth)
        if nxt:  # the (at most nxt) active rows first, into a smaller buffer
            order = jnp.argsort(~active, stable=True)[:nxt]
            carry, inputs, rows = _take(carry, order), _take(inputs, order), rows[order]
    return out_x, out_depth


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _adaptive(step, tol, max_steps, check_every, compact, x0, inputs, *consts):
    return _adaptive_forward(step, tol, max_steps, check_every, compact, x0, inputs, *consts)


def _adaptive_fwd(step, tol, max_steps, check_every, compact, x0, inputs, *consts):
    out = _adaptive_forward(step, tol, max_steps, check_every, compact, x0, inputs, *consts)
    return out, None


def _adaptive_bwd(step, tol, max_steps, check_every, compact, residuals, cotangents):
    raise ValueError(
        "unroll_adaptive stops with an unbounded lax.while_loop and cannot be "
        "differentiated in reverse mode. To train with a stopping threshold use "
        "unroll_adaptive_bounded(step, x0, tol=..., max_steps=...), which masks a "
        "lax.scan of max_steps steps and is differentiable."
    )


_adaptive.defvjp(_adaptive_fwd, _adaptive_bwd)


@contextlib.contextmanager
def _step_named(x0: Array, step: Callable, *args):
    """Where a ``lax`` loop refuses its carry (its message names the loop's carry, not the step),
    say whether ``step(x0, *args)`` changes the state's shape or dtype; only on that failure is
    the step traced again, so a working unroll pays nothing."""
    try:
        yield
    except TypeError:
        out = jax.eval_shape(step, x0, *args)
        got = (getattr(out, "shape", None), getattr(out, "dtype", None))
        if got != (jnp.shape(x0), jnp.result_type(x0)):
            raise ValueError(
                f"step maps the state x0 of shape {jnp.shape(x0)} ({jnp.result_type(x0)}) to "
                f"{_describe(out)}; a step must keep the state's shape and dtype."
            ) from None
        raise


def _check_batch(x0: Array) -> None:
    """An adaptive unroll's state has a leading pattern axis (each pattern stops on its own)."""
    if jnp.ndim(x0) < 1:
        raise ValueError(f"x0 must have a leading batch axis (patterns, ...); got shape {jnp.shape(x0)}.")


def _describe(out) -> str:
    if hasattr(out, "shape") and hasattr(out, "dtype"):
        return f"shape {tuple(out.shape)} ({out.dtype})"
    return f"{type(out).__name__} {jax.tree.map(lambda a: getattr(a, 'shape', a), out)}"


def _check_inputs(inputs, batch: int, what: str) -> None:
    sizes = {leaf.shape[0] if leaf.ndim else None for leaf in jax.tree.leaves(inputs)}
    if sizes and sizes != {batch}:
        raise ValueError(
            f"per-pattern inputs have leading axis sizes {sorted(sizes, key=str)}, which "
            f"disagree with the {batch} patterns of {what}."
        )


def unroll_adaptive(
    step: Callable[..., Array],
    x0: Array,
    *,
    tol: float,
    max_steps: int,
    check_every: int = 1,
    inputs: Any = None,
    compact: bool = False,
) -> tuple[Array, Array]:
    """Unroll each pattern until its update is smaller than ``tol`` (inference).

    Plain-Python meaning, for each pattern ``i`` on its own::

        x, depth = x0[i], 0
        for k in range(max_steps):
            x_new = step(x) if inputs is None else step(x, inputs[i])
            depth += 1
            done = norm(x_new - x) < tol        # 2-norm over non-batch axes
            x = x_new
            if done:
                break

    A pattern whose state becomes NaN or infinite never meets the test (a NaN
    compares false), so it runs all ``max_steps`` steps: ``depth == max_steps``
    with a non-finite state, never a depth that reads as converged.
    A pattern that has stopped is frozen while the others go on; the loop
    (``lax.while_loop``) ends when every pattern has stopped or after
    ``max_steps`` steps. Returns ``(x, depth)`` with ``depth`` an int32 array
    of shape ``(batch,)``.

    Speed options (same depths and states): ``check_every = c`` tests "is any
    pattern still running" once per ``c`` steps, running the steps in between
    as a masked ``lax.scan`` unrolled by up to :data:`CHUNK_UNROLL` steps (a GPU
    ``while_loop`` synchronises with the host on every test, and a loop iteration
    costs as much as a small step); a pattern still stops at exactly its own step. ``inputs`` is a
    pytree of per-pattern arrays (leading axis ``batch``, e.g. a block's drive)
    passed as ``step(x, inputs)``; with it, ``compact=True`` moves the running
    patterns into a buffer of half the size whenever they fit (down to a
    sixteenth of the batch), so that the work follows the mean depth rather
    than the deepest pattern. On GPUs a matrix product of another batch size
    may round differently in the last bit; on the CPU results are identical.

    Reverse-mode differentiation raises an error: use
    :func:`unroll_adaptive_bounded` for training.
    """
    tol = float(check_positive("tol", tol))
    check_int("max_steps", max_steps)
    check_int("check_every", check_every)
    check_bool("compact", compact)
    if compact and inputs is None:
        raise ValueError(
            "compact=True moves patterns between buffers, so their per-pattern data must be "
            "passed as inputs=... (step(x, inputs)), not closed over by step."
        )
    fn = step if inputs is not None else (lambda x, _: step(x))
    _check_batch(x0)
    _check_inputs(inputs, x0.shape[0], "x0")
    # closure_convert hoists closed-over arrays (weights, tracers) into arguments, so that
    # the custom VJP can refuse reverse mode; its function is traced for one shape, so
    # each buffer size of the compacting loop gets its own.
    steps, consts = [], []
    for size in _phase_sizes(x0.shape[0]) if compact else [x0.shape[0]]:
        example = jax.tree.map(lambda a: jax.ShapeDtypeStruct((size,) + a.shape[1:], a.dtype), (x0, inputs))
        closed, phase_consts = jax.closure_convert(fn, *example)
        steps.append((closed, len(phase_consts)))
        consts.extend(phase_consts)
    with _step_named(x0, fn, inputs):
        return _adaptive(tuple(steps), tol, max_steps, check_every, compact, x0, inputs, *consts)


def unroll_adaptive_stream(
    step: Callable[[Array, Any], Array],
    x0: Array,
    inputs: Any,
    *,
    tol: float,
    max_steps: int,
    slots: int,
    check_every: int = 1,
) -> tuple[Array, Array]:
    """Score many patterns with adaptive depth: a fixed batch of ``slots`` in flight,
    converged patterns retired and their slots refilled from the queue (inference).

    ``x0`` (``(N, ...)``) and the pytree ``inputs`` (leading axis ``N``) hold every
    pattern; ``step(x, inputs)`` advances a batch. Plain-Python meaning: exactly
    :func:`unroll_adaptive`'s per-pattern loop for every ``i < N``::

        for i in range(N):
            x, depth = x0[i], 0
            for k in range(max_steps):
                x_new = step(x, inputs[i]); depth += 1
                done = norm(x_new - x) < tol
                x = x_new
                if done:
                    break
            out_x[i], out_depth[i] = x, depth

    Patterns enter the ``slots`` in order; every ``check_every`` steps the finished
    ones are written out and their slots take the next patterns, so the cost follows
    the mean depth times ``N / slots``. Returns ``(out_x, out_depth)``.
    """
    tol = float(check_positive("tol", tol))
    check_int("max_steps", max_steps)
    check_int("check_every", check_every)
    check_int("slots", slots)
    _check_batch(x0)
    n = x0.shape[0]
    _check_inputs(inputs, n, "x0")
    s = min(slots, n)
    chunk = _masked_chunk(step, tol, max_steps, check_every)

    def body(carry):
        x, inp, idx, active, depth, nxt, out_x, out_depth = carry
        x, active, depth = chunk(x, inp, active, depth)
        where = jnp.where(~active & (idx >= 0), idx, n)  # finished slots; n is dropped
        out_x = out_x.at[where].set(x, mode="drop")
        out_depth = out_depth.at[where].set(depth, mode="drop")
        free = ~active
        new = nxt + jnp.cumsum(free, dtype=jnp.int32) - 1
        fill = free & (new < n)
        src = jnp.where(fill, new, 0)
        x = _freeze(fill, x0[src], x)
        inp = jax.tree.map(lambda a, b: _freeze(fill, b[src], a), inp, inputs)
        idx = jnp.where(fill, new, jnp.where(free, jnp.int32(-1), idx))
        depth = jnp.where(fill, 0, depth)
        return x, inp, idx, active | fill, depth, nxt + jnp.sum(fill, dtype=jnp.int32), out_x, out_depth

    first = jnp.arange(s, dtype=jnp.int32)
    init = (
        x0[:s],
        _take(inputs, first),
        first,
        jnp.ones((s,), bool),
        jnp.zeros((s,), jnp.int32),
        jnp.asarray(s, jnp.int32),
        x0,
        jnp.zeros((n,), jnp.int32),
    )
    with _step_named(x0, step, inputs):
        out = lax.while_loop(lambda c: jnp.any(c[3]), body, init)
    return out[6], out[7]


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
    tol = float(check_positive("tol", tol))
    check_int("max_steps", max_steps)
    check_bool("trajectory", trajectory)
    check_scan_unroll(scan_unroll)
    _check_batch(x0)
    batch = x0.shape[0]

    def body(carry, _):
        x, active, depth = carry
        x_new = step(x)
        moved = _pattern_norm(x_new - x)
        depth = depth + active.astype(depth.dtype)
        x = _freeze(active, x_new, x)
        active = jnp.logical_and(active, ~(lax.stop_gradient(moved) < tol))  # a NaN move runs on
        return (x, active, depth), (x if trajectory else None)

    init = (x0, jnp.ones((batch,), bool), jnp.zeros((batch,), jnp.int32))
    with _step_named(x0, step):
        (x, _, depth), traj = lax.scan(body, init, None, length=max_steps, unroll=scan_unroll)
    return (x, depth, traj) if trajectory else (x, depth)
