"""NAIS-Net's Flax modules: the dense and convolutional blocks, unrolled by :mod:`naisnet_jax.unroll`
or by a tied block's hand-written VJP or fused kernels, and the networks built from them."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from naisnet_jax import probe
from naisnet_jax.cell import ACTIVATIONS, conv_step, fc_step
from naisnet_jax.checks import check_bool, check_int
from naisnet_jax.kernels import (
    KernelPolicy,
    conv_op,
    dense_op,
    side_stream_conv,
    unroll_tied,
    unroll_tied_conv,
    unroll_tied_dense,
)
from naisnet_jax.models.layers import (
    BN_EPSILON,
    PARAM_DTYPE,
    batch_norm,
    compute_dtype,
    conv_init,
    drive_init,
    fc_init,
    initial_state_x0,
)
from naisnet_jax.models.options import (
    BLOCK_VJP,
    Classifier,
    ConvOptions,
    DenseOptions,
    DriveNorm,
    Stages,
    net_chose_zero_start,
    options_of,
)
from naisnet_jax.parametrize import conv_state_kernel, fc_state_matrix, zero_delta
from naisnet_jax.unroll import (
    unroll,
    unroll_adaptive,
    unroll_adaptive_bounded,
    unroll_adaptive_stream,
)

Array = jax.Array


# ------------------------------------------------------------------ unrolling


class Tied(NamedTuple):
    """A tied block's step in parts, ``x_{k+1} = x_k + h act(op(x_k, W) + drive)``, for its fast
    paths and its adaptive unrolls; ``kind`` names ``op``: ``"dense"`` (``x @ W.T``) or ``"conv"``
    (``conv(x, W)``, stride 1, SAME)."""

    kind: str
    drive: Array
    W: Array
    h: float
    activation: str

    @property
    def op(self) -> Callable[[Array, Array], Array]:
        return conv_op if self.kind == "conv" else dense_op

    def driven(self, x: Array, drive: Array) -> Array:
        """One step with the drive ``drive`` (the adaptive unrolls move it along with the state)."""
        return x + self.h * ACTIVATIONS[self.activation](self.op(x, self.W) + drive)


def _unroll(block, step, x0, *, steps, xs, train, trajectory, tied: Tied):
    """``block``'s unroll of ``step`` from ``x0``, as its options say; returns ``(x_K, depth,
    states or None)``.

    Fixed depth (``adaptive_tol=None``): :func:`_unroll_fixed`, the plain ``lax.scan`` or the tied
    fast path ``block_vjp`` picks. Adaptive: :func:`_unroll_to_tolerance`. ``remat`` wraps the
    whole unroll (``"block"``) or each step (``"step"``) in ``jax.checkpoint``."""
    if block.remat == "step":
        step = jax.checkpoint(step, prevent_cse=False)  # inside a scan: no CSE to prevent
    if block.adaptive_tol is None:
        return _unroll_fixed(block, step, x0, steps=steps, xs=xs, trajectory=trajectory, tied=tied)
    return _unroll_to_tolerance(block, step, x0, train=train, trajectory=trajectory, tied=tied)


def _checkpointed(block, run: Callable) -> Callable:
    """``run`` in ``jax.checkpoint`` with ``remat="block"``, else ``run``."""
    return jax.checkpoint(run) if block.remat == "block" else run


def _kernel_policy(block, kind: str) -> KernelPolicy:
    """The fused kernels' policy of a ``kind`` (``"dense"`` or ``"conv"``) block: the conv
    blocks' ``kernel_engine``; with ``kernel_interpret``, Pallas' interpreter for the blocks
    the kernels take and the stacked VJP for the others."""
    engine = block.kernel_engine if kind == "conv" else None
    if block.kernel_interpret:
        return KernelPolicy(engine=engine, interpret=True, strict=False)
    return KernelPolicy(engine=engine)


def _fast_path(block, tied: Tied) -> Callable | None:
    """``(x0, *, steps) -> x_K``: the tied fast path ``block.block_vjp`` picks (the fused kernels,
    or the stacked VJP storing or recomputing its residuals); ``None`` for plain autodiff."""
    if block.block_vjp == "autodiff":
        return None
    common = dict(drive=tied.drive, h=tied.h, activation=tied.activation, scan_unroll=block.scan_unroll)
    if block.block_vjp == "fused" and tied.kind == "conv":
        return functools.partial(unroll_tied_conv, kernel=tied.W, policy=_kernel_policy(block, "conv"), **common)
    if block.block_vjp == "fused":
        return functools.partial(unroll_tied_dense, A=tied.W, policy=_kernel_policy(block, "dense"), **common)
    return functools.partial(unroll_tied, tied.op, W=tied.W, residuals=BLOCK_VJP[block.block_vjp], **common)


def _unroll_fixed(block, step, x0, *, steps, xs, trajectory, tied: Tied):
    """``steps`` steps: the tied fast path where one applies (no trajectory asked for), from
    ``x_1`` when the block starts at ``x_0 = 0`` (:func:`_from_first_step`); else ``lax.scan``."""
    fast = None if trajectory else _fast_path(block, tied)
    if fast is None:
        run = functools.partial(unroll, step, steps=steps, trajectory=trajectory, xs=xs, scan_unroll=block.scan_unroll)
    elif block.initial_state == "zero":
        run = _from_first_step(fast, tied.drive, tied.h, tied.activation, steps)
    else:
        run = functools.partial(fast, steps=steps)
    out = _checkpointed(block, run)(x0)
    x, states = out if trajectory else (out, None)
    return x, jnp.full((x0.shape[0],), steps, jnp.int32), states


def _unroll_to_tolerance(block, step, x0, *, train, trajectory, tied: Tied):
    """Pattern-dependent depth: training uses the masked scan (differentiable), evaluation the
    ``while_loop``; a requested trajectory always takes the masked scan, whose values and depths
    are those of the ``while_loop``. ``check_every``, ``compact`` and ``stream_slots`` (a batch
    larger than the slots) run the tied step with its drive moved along with each pattern."""
    tol, max_steps = block.adaptive_tol, block.max_steps
    if train or trajectory:
        run = functools.partial(
            unroll_adaptive_bounded,
            step,
            tol=tol,
            max_steps=max_steps,
            trajectory=trajectory,
            scan_unroll=block.scan_unroll,
        )
        out = _checkpointed(block, run)(x0)
        return out if trajectory else (*out, None)
    streaming = block.stream_slots is not None and x0.shape[0] > block.stream_slots
    if block.check_every == 1 and not block.compact and not streaming:
        x, depth = unroll_adaptive(step, x0, tol=tol, max_steps=max_steps)
        return x, depth, None

    def driven(x, d):  # a function of its own: the loops take the step as a static argument
        return tied.driven(x, d)

    drives = jnp.broadcast_to(tied.drive, x0.shape)
    common = dict(tol=tol, max_steps=max_steps, check_every=block.check_every)
    if streaming:
        x, depth = unroll_adaptive_stream(driven, x0, drives, slots=block.stream_slots, **common)
    else:
        x, depth = unroll_adaptive(driven, x0, inputs=drives, compact=block.compact, **common)
    return x, depth, None


def _from_first_step(tied_run: Callable, drive, h: float, activation: str, steps: int) -> Callable:
    """``x0 -> x_K`` of a tied block started at ``x_0 = 0``, as ``tied_run(x_1, steps=K - 1)``.

    From zero the state term vanishes: ``x_1 = 0 + h act(A 0 + drive) = h act(drive)``, the
    same value bit for bit. So the fast path runs the other ``K - 1`` steps from ``x_1``: one
    step of state products fewer forward and backward, a state fewer saved, and no weight
    gradient term ``x_0^T s_0``, which is zero. Autodiff carries the gradient through
    ``x_1`` to the drive. ``x0`` gives only the shape and dtype.
    """

    def run(x0):
        x1 = jnp.broadcast_to(h * ACTIVATIONS[activation](drive), x0.shape).astype(x0.dtype)
        return tied_run(x1, steps=steps - 1) if steps > 1 else x1

    return run


def _untied_step(step: Callable) -> Callable:
    """``step(x, drive, op)`` -> ``(x, (drive_k, op_k)) -> x_next`` for ``unroll(xs=...)``."""
    return lambda x, params_k: step(x, *params_k)


def _block_output(x, depth, states, x0, return_aux):
    return (x, {"trajectory": states, "initial_state": x0, "depth": depth}) if return_aux else x


# --------------------------------------------------------------- NAIS blocks


class NaisDenseBlock(DenseOptions):
    """Fully connected NAIS block: ``x_{k+1} = x_k + h act(x_k A^T + u B^T + b)``, ``x_0 = 0``
    (or ``x_0 = u`` with ``initial_state="input"``, which needs ``m = n``).

    ``A = -R^T R - eps I`` with ``R`` of shape ``(r, n)``, ``r = rank or n``.
    Parameters: ``"R"`` ``(r, n)`` and ``"input"`` (Dense ``m -> n``: kernel
    ``B^T``, bias ``b``). Untied (per-step ``A(k), B(k), b(k)``): ``"R"``
    ``(K, r, n)`` and ``"input"`` a Dense ``m -> K n`` read as ``(K, n)``.
    ``R`` starts inside Algorithm 1's set. Returns ``x_K``, or ``(x_K, aux)``
    with ``aux = {"trajectory": (K, batch, n), "initial_state": (batch, n), "depth": (batch,)}``.
    """

    features: int

    @nn.nowrap
    def _check_fields(self):
        self._warn_if_state_unused()

    @nn.compact
    def __call__(self, u: Array, *, train: bool = False, return_aux: bool = False):
        if u.ndim != 2:
            raise ValueError(f"NaisDenseBlock input must be (batch, m); got shape {u.shape}.")
        n, K = self.features, self.steps
        per_step = (K,) if self.untied else ()
        R = self.param("R", fc_init(self.eps), per_step + (self.rank or n, n), PARAM_DTYPE)
        A = fc_state_matrix(R, self.eps)
        dtype = compute_dtype(self.dtype)
        drive = nn.Dense(n * K if self.untied else n, dtype=dtype, name="input")(u)
        A = A if dtype is None else A.astype(dtype)
        x0 = initial_state_x0(u, (u.shape[0], n), jnp.result_type(drive, A), self.initial_state, "NaisDenseBlock")
        step = functools.partial(fc_step, h=self.h, activation=self.activation)
        if self.untied:
            drives = jnp.moveaxis(drive.reshape(u.shape[0], K, n), 1, 0)  # (K, batch, n)
            step, xs = _untied_step(step), (drives, A)
        else:
            step, xs = functools.partial(step, drive=drive, A=A), None
        x, depth, states = _unroll(
            self,
            step,
            x0,
            steps=K,
            xs=xs,
            train=train,
            trajectory=return_aux or probe.auditing(self),
            tied=Tied("dense", drive, A, self.h, self.activation),
        )
        if probe.auditing(self):
            probe.sow_block(
                self,
                kind="dense",
                activation=self.activation,
                h=self.h,
                eps=self.eps,
                untied=self.untied,
                operator=A,
                factor=R,
                u=u,
                x0=x0,
                states=states,
                drive=xs[0] if self.untied else drive,
                input_kernel=self.variables["params"]["input"]["kernel"],
            )
        return _block_output(x, depth, states, x0, return_aux)


class NaisConvBlock(ConvOptions):
    """Convolutional NAIS block: ``X_{k+1} = X_k + h act(conv(X_k, C) + conv(U, D) + E)``.

    ``X_0 = 0``, or ``X_0 = U`` with ``initial_state="input"`` (needs ``strides == 1``
    and ``U`` of ``features`` channels). The state convolution has stride 1, SAME
    padding and an odd ``k x k`` filter whose centre taps are ``-1 - delta_c`` (``delta = 0`` unless
    ``learn_delta``). The input convolution ``D`` (``"input"``) has
    ``strides``, so a stride-2 block halves the resolution. Parameters:
    ``"state_kernel"`` ``(k, k, C, C)``, ``"delta"`` ``(C,)`` if
    ``learn_delta``, ``"input"`` (Conv, kernel ``D``, bias ``E``); untied adds
    a leading ``K`` axis to the first two and gives ``"input"`` ``K C``
    outputs read as ``(K, C)``. ``normalize_drive`` applies BatchNorm
    (``"drive_norm"``) to the drive, whose offset then plays ``E`` (the conv
    has no bias). The state kernel starts inside Algorithm 2's set. Returns
    ``X_K``, or ``(X_K, aux)`` with ``aux = {"trajectory": (K, batch, H, W, C),
    "initial_state": (batch, H, W, C), "depth": (batch,)}``.
    """

    features: int
    strides: int = dataclasses.field(default=1, kw_only=True)
    normalize_drive: bool = dataclasses.field(default=False, kw_only=True)

    @nn.nowrap
    def _check_fields(self):
        check_int("features", self.features)
        check_int("strides", self.strides)
        check_bool("normalize_drive", self.normalize_drive)
        if self.initial_state == "input" and self.strides != 1:
            raise ValueError(
                f"initial_state='input' with strides={self.strides}: x_0 = U needs the input at "
                f"the state's resolution (strides=1); use initial_state='zero'."
            )
        self._warn_if_state_unused()

    @nn.compact
    def __call__(self, u: Array, *, train: bool = False, return_aux: bool = False):
        if u.ndim != 4:
            raise ValueError(f"NaisConvBlock input must be NHWC; got shape {u.shape}.")
        C, K, k = self.features, self.steps, self.kernel_size
        per_step = (K,) if self.untied else ()
        kernel = self.param("state_kernel", conv_init(self.eps, self.eta), per_step + (k, k, C, C), PARAM_DTYPE)
        if self.learn_delta:
            delta = self.param("delta", nn.initializers.zeros, per_step + (C,), PARAM_DTYPE)
        else:
            delta = zero_delta(kernel.shape, kernel.dtype)
        kernel = conv_state_kernel(kernel, delta)
        drive = nn.Conv(
            C * K if self.untied else C,
            (k, k),
            strides=(self.strides, self.strides),
            padding="SAME",
            use_bias=not self.normalize_drive,
            kernel_init=drive_init(self.drive_init),
            dtype=compute_dtype(self.dtype),
            # the fast paths: the drive's kernel gradient beside the backward chain, as the block's
            conv_general_dilated=None if self.block_vjp == "autodiff" else side_stream_conv,
            name="input",
        )(u)
        if self.normalize_drive:
            zero_scale = self.zero_init_drive and self.initial_state == "input"
            drive = batch_norm(train, "drive_norm", self.dtype, zero_scale=zero_scale, axis_name=self.batch_axis)(drive)
        batch, height, width = drive.shape[:3]
        dtype = compute_dtype(self.dtype) or jnp.result_type(drive, kernel)  # conv: equal dtypes
        drive, kernel = drive.astype(dtype), kernel.astype(dtype)
        x0 = initial_state_x0(u, (batch, height, width, C), dtype, self.initial_state, "NaisConvBlock")
        step = functools.partial(conv_step, h=self.h, activation=self.activation)
        if self.untied:
            drives = jnp.moveaxis(drive.reshape(batch, height, width, K, C), 3, 0)
            step, xs = _untied_step(step), (drives, kernel)
        else:
            step, xs = functools.partial(step, drive=drive, kernel=kernel), None
        x, depth, states = _unroll(
            self,
            step,
            x0,
            steps=K,
            xs=xs,
            train=train,
            trajectory=return_aux or probe.auditing(self),
            tied=Tied("conv", drive, kernel, self.h, self.activation),
        )
        if probe.auditing(self):
            probe.sow_block(
                self,
                kind="conv",
                activation=self.activation,
                h=self.h,
                eps=self.eps,
                eta=self.eta,
                untied=self.untied,
                learn_delta=self.learn_delta,
                operator=kernel,
                factor=delta,
                u=u,
                x0=x0,
                states=states,
                drive=xs[0] if self.untied else drive,
                input_stride=self.strides,
                input_kernel=self.variables["params"]["input"]["kernel"],
                input_scale=probe.batch_norm_multiplier(self, "drive_norm", epsilon=BN_EPSILON)
                if self.normalize_drive
                else None,
            )
        return _block_output(x, depth, states, x0, return_aux)


# ----------------------------------------------------------------- NAIS-Nets


class NaisNetFC(DenseOptions, Classifier, kw_only=True):
    """The paper's MNIST net: flatten, one NaisDenseBlock (``"block"``), Dense classifier.

    Parameters: ``"block"`` (see :class:`NaisDenseBlock`) and ``"classifier"``.
    ``initial_state="input"`` (``x_0 = u``) needs ``features`` equal to the flattened input size.
    """

    features: int = 128

    @nn.compact
    def __call__(self, x: Array, *, train: bool = False, return_aux: bool = False):
        u = self._patterns(x)
        block = NaisDenseBlock(self.features, name="block", **options_of(self, DenseOptions))
        classifier = nn.Dense(self.num_classes, name="classifier")
        if not return_aux:
            return classifier(block(u, train=train))
        _, aux = block(u, train=train, return_aux=True)
        states = aux["trajectory"]
        step_logits = classifier(states)  # states[-1] is x_K
        return step_logits[-1], {
            "step_logits": step_logits,
            "trajectory": states,
            "initial_state": aux["initial_state"],
            "depth": aux["depth"][None],
        }


class NaisNetConv(ConvOptions, DriveNorm, Classifier, Stages, kw_only=True):
    """Stacked convolutional NAIS-Net: stem, stages of NaisConvBlocks, pool, Dense.

    ``stem`` (3x3 conv to ``filters[0]``) -> BatchNorm (``"stem_bn"``) -> act;
    then stage ``i`` has ``stage_sizes[i]`` blocks of ``filters[i]`` channels
    (``"stage{i}_block{j}"``), each block's ``x_K`` the next block's ``u``.
    The first block of every later stage has a stride-2 input convolution. Every
    block's drive is BatchNormed (``drive_norm``, :class:`DriveNorm`: also only at
    those stage changes, or nowhere). Normalisation acts only on drives and at the stem,
    never inside the state dynamics, so every block keeps its stability
    guarantee. Then global average pooling and ``"classifier"``.

    ``initial_state="input"`` starts every block whose input has its state's
    shape at ``x_0 = u``: all blocks except the first of each later stage,
    whose stride-2 input changes resolution and width (those start at
    ``x_0 = 0``; with one step their state kernel does not act, and they do not
    warn). The first block of stage 0 starts at the stem's output, which has
    ``filters[0]`` channels at full resolution.
    """

    @nn.compact
    def __call__(self, x: Array, *, train: bool = False, return_aux: bool = False):
        self._check_images(x)
        dtype = compute_dtype(self.dtype)
        x = nn.Conv(self.filters[0], (3, 3), padding="SAME", use_bias=False, dtype=dtype, name="stem")(x)
        x = ACTIVATIONS[self.activation](batch_norm(train, "stem_bn", self.dtype, axis_name=self.batch_axis)(x))
        states, depths = [], []
        options = options_of(self, ConvOptions)
        for i, (size, width) in enumerate(zip(self.stage_sizes, self.filters)):
            for j in range(size):
                change = i > 0 and j == 0
                with net_chose_zero_start(change):  # x_0 = 0 there is the net's choice (see above)
                    block = NaisConvBlock(
                        width,
                        strides=2 if change else 1,
                        normalize_drive=self._normalises_drive(change),
                        name=f"stage{i}_block{j}",
                        **{**options, "initial_state": "zero" if change else self.initial_state},
                    )
                if return_aux:
                    x, aux = block(x, train=train, return_aux=True)
                    states.append(aux["trajectory"])
                    depths.append(aux["depth"])
                else:
                    x = block(x, train=train)
        x = x if dtype is None else x.astype(jnp.float32)  # pool and classify in float32
        logits = nn.Dense(self.num_classes, name="classifier")(jnp.mean(x, axis=(1, 2)))
        if not return_aux:
            return logits
        return logits, {"trajectory": tuple(states), "depth": jnp.stack(depths)}
