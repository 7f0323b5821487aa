"""The paper's ResNet baselines: the 30-layer FC ResNets of section 5.1's ablation and the
convolutional ResNet of section 5.2."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from naisnet_jax import probe
from naisnet_jax.cell import ACTIVATIONS
from naisnet_jax.checks import check_bool, check_int
from naisnet_jax.models.layers import BN_EPSILON, PARAM_DTYPE, batch_norm, compute_dtype, fc_init
from naisnet_jax.models.options import BatchAxis, Classifier, ResNetConvOptions, Stages, StepOptions, options_of
from naisnet_jax.parametrize import fc_state_matrix

Array = jax.Array


# ------------------------------------------------------------ ResNet baselines


class ResNetFC(StepOptions, BatchAxis, Classifier, kw_only=True):
    """The 30-layer fully connected ResNets of the paper's MNIST ablation.

    Layer ``k``: ``x_{k+1} = x_k + h act(BN_k(x_k W_k^T [+ u B_k^T] + b_k))``.

    - ``shared`` (SH): one ``W``, ``b`` (and ``B``) used by every layer;
      otherwise a leading ``depth`` axis, one set per layer.
    - ``nonautonomous`` (NA): ``x_0 = 0`` and ``u`` drives every layer through
      ``"input"`` (Dense: kernel ``B^T``, bias ``b``; ``depth n`` outputs if not
      shared); else ``x_0 = act(u E^T + e)`` (``"embed"``: the input layer of an
      ordinary MLP), a bias ``"b"``, and ``u`` is never seen again. (A linear
      ``x_0`` would hand the classifier an unbounded linear path from ``u``: at
      the paper's learning rate 0.1 that path diverged in every seed of
      ResNet-SH, ResNet-BN and ResNet-SH-BN on MNIST.)
    - ``batch_norm`` (BN): BatchNorm ``"bn{k}"`` on layer ``k``'s
      pre-activation, one per layer even when shared (the statistics change
      with depth).
    - ``stable``: ``W = -R^T R - eps I`` with parameter ``"R"`` (otherwise the
      parameter is ``"W"``), so ``project_params`` applies Algorithm 1.

    ``ResNetSHNA`` is therefore a NAIS-Net block without the stability
    parametrisation. Parameters also include ``"classifier"``.
    """

    features: int = 128
    depth: int = 30
    shared: bool = False
    nonautonomous: bool = False
    batch_norm: bool = False
    stable: bool = False

    @nn.nowrap
    def _check_fields(self):
        check_int("features", self.features)
        check_int("depth", self.depth)
        for switch in ("shared", "nonautonomous", "batch_norm", "stable"):
            check_bool(switch, getattr(self, switch))
        if self.stable and self.batch_norm:
            raise ValueError(
                "stable=True with batch_norm=True is refused: BatchNorm inside the dynamics makes "
                "the Jacobian I + h diag(g act') A with g = gamma / sqrt(var + eps), a data-dependent "
                "scale the projection does not control (var = 1e-4 gives g ~ 95 and rho ~ 68), so "
                "no stability guarantee holds. Use batch_norm=False (NAIS-Net normalises only where "
                "the dimension changes)."
            )

    @nn.compact
    def __call__(self, x: Array, *, train: bool = False, return_aux: bool = False):
        u = self._patterns(x)
        n, L, batch = self.features, self.depth, u.shape[0]
        per_layer = () if self.shared else (L,)
        if self.stable:
            R = self.param("R", fc_init(self.eps), per_layer + (n, n), PARAM_DTYPE)
            W = fc_state_matrix(R, self.eps)
        else:
            batch_axis = () if self.shared else (0,)
            init = nn.initializers.lecun_normal(in_axis=-1, out_axis=-2, batch_axis=batch_axis)
            W = self.param("W", init, per_layer + (n, n), PARAM_DTYPE)
        if self.nonautonomous:
            drive = nn.Dense(n if self.shared else L * n, name="input")(u)
            if not self.shared:
                drive = jnp.moveaxis(drive.reshape(batch, L, n), 1, 0)  # (L, batch, n)
            x = jnp.zeros((batch, n), jnp.result_type(drive, W))
        else:
            drive = self.param("b", nn.initializers.zeros, per_layer + (n,), PARAM_DTYPE)
        act = ACTIVATIONS[self.activation]
        if not self.nonautonomous:
            x = act(nn.Dense(n, name="embed")(u))
        x0 = x
        states = []
        for k in range(L):
            W_k, d_k = (W, drive) if self.shared else (W[k], drive[k])
            pre = x @ W_k.T + d_k
            if self.batch_norm:
                pre = batch_norm(train, f"bn{k}", axis_name=self.batch_axis)(pre)
            x = x + self.h * act(pre)
            states.append(x)
        if probe.auditing(self):
            self._sow_probe(u, W, drive, x0, jnp.stack(states))
        classifier = nn.Dense(self.num_classes, name="classifier")
        if not return_aux:
            return classifier(x)
        states = jnp.stack(states)
        step_logits = classifier(states)
        return step_logits[-1], {
            "step_logits": step_logits,
            "trajectory": states,
            "initial_state": x0,
            "depth": jnp.full((1, batch), L, jnp.int32),
        }

    def _sow_probe(self, u, W, drive, x0, states):
        """The residual map's weights for the verifier (stable: a dense NAIS-type block)."""
        variables, batch = self.variables["params"], u.shape[0]
        common = dict(
            activation=self.activation, h=self.h, untied=not self.shared, u=u, x0=x0, states=states, operator=W
        )
        if not self.stable:
            scale = None
            if self.batch_norm:
                scale = jnp.stack(
                    [probe.batch_norm_multiplier(self, f"bn{k}", epsilon=BN_EPSILON) for k in range(self.depth)]
                )
            probe.sow_block(self, kind="dense-baseline", scale=scale, **common)
            return
        if drive.ndim == W.ndim - 1:  # autonomous: the bias b, one per pattern
            drive = jnp.broadcast_to(drive[..., None, :], drive.shape[:-1] + (batch, drive.shape[-1]))
        probe.sow_block(
            self,
            kind="dense",
            eps=self.eps,
            factor=variables["R"],
            drive=drive,
            input_kernel=variables["input"]["kernel"] if self.nonautonomous else None,
            **common,
        )


class ResNetConvBlock(ResNetConvOptions):
    """Single-convolution residual block ``relu(x + BN(conv(x)))``: He et al.'s block with one
    convolution, as the paper's section 5.2 uses (the ReLU after the sum, as theirs); with
    ``convs=2`` their basic block ``relu(x + BN(conv2(relu(BN(conv(x))))))`` (parameters
    ``"conv2"``, ``"bn2"`` besides; the stride on the first convolution).

    Where width or resolution changes, the shortcut is a strided 1x1
    projection (``"shortcut"``). Parameters: ``"conv"``, ``"bn"``. The Jacobian at a
    state is ``diag(relu') (I + diag(g) C)`` (``g`` BatchNorm's eval multiplier): the
    verifier reports ``rho(I + diag(g) C)``, its value where every unit is active. A
    two-convolution block is not reported (its Jacobian is no single convolution).
    (The form ``x + relu(BN(conv(x)))`` adds a non-negative branch in every block: the
    stream grows by about 0.4 per block and channel, and the 54-block net diverges at
    learning rate 0.1.)
    """

    features: int
    strides: int = dataclasses.field(default=1, kw_only=True)

    @nn.nowrap
    def _check_fields(self):
        check_int("features", self.features)
        check_int("strides", self.strides)

    @nn.compact
    def __call__(self, x: Array, *, train: bool = False) -> Array:
        s, k, dtype = self.strides, self.kernel_size, compute_dtype(self.dtype)
        y = nn.Conv(self.features, (k, k), strides=(s, s), padding="SAME", use_bias=False, dtype=dtype, name="conv")(x)
        last = self.convs == 1
        y = batch_norm(train, "bn", self.dtype, zero_scale=self.zero_init_residual and last, axis_name=self.batch_axis)(
            y
        )
        if not last:
            y = nn.Conv(self.features, (k, k), padding="SAME", use_bias=False, dtype=dtype, name="conv2")(nn.relu(y))
            y = batch_norm(train, "bn2", self.dtype, zero_scale=self.zero_init_residual, axis_name=self.batch_axis)(y)
        square = s == 1 and x.shape[-1] == self.features
        if probe.auditing(self) and last:
            probe.sow_block(
                self,
                kind="conv-baseline",
                activation="relu",
                h=1.0,
                square=square,
                u=x,
                operator=self.variables["params"]["conv"]["kernel"],
                scale=probe.batch_norm_multiplier(self, "bn", epsilon=BN_EPSILON),
            )
        if not square:
            x = nn.Conv(self.features, (1, 1), strides=(s, s), use_bias=False, dtype=dtype, name="shortcut")(x)
        return nn.relu(x + y)


class ResNetConv(ResNetConvOptions, Classifier, Stages, kw_only=True):
    """The paper's CIFAR ResNet baseline (one convolution per block, section 5.2).

    ``stem`` -> ``"stem_bn"`` -> relu, stages of :class:`ResNetConvBlock`
    (``"stage{i}_block{j}"``, stride 2 at the first block of every later
    stage), global average pooling, ``"classifier"``. Each block is one step:
    ``aux["trajectory"]`` holds ``(1, batch, H, W, C)`` per block.
    """

    @nn.compact
    def __call__(self, x: Array, *, train: bool = False, return_aux: bool = False):
        self._check_images(x)
        dtype = compute_dtype(self.dtype)
        x = nn.Conv(self.filters[0], (3, 3), padding="SAME", use_bias=False, dtype=dtype, name="stem")(x)
        x = nn.relu(batch_norm(train, "stem_bn", self.dtype, axis_name=self.batch_axis)(x))
        states, options = [], options_of(self, ResNetConvOptions)
        for i, (size, width) in enumerate(zip(self.stage_sizes, self.filters)):
            for j in range(size):
                strides = 2 if i > 0 and j == 0 else 1
                x = ResNetConvBlock(width, strides=strides, name=f"stage{i}_block{j}", **options)(x, train=train)
                states.append(x[None])
        x = x if dtype is None else x.astype(jnp.float32)  # pool and classify in float32
        logits = nn.Dense(self.num_classes, name="classifier")(jnp.mean(x, axis=(1, 2)))
        if not return_aux:
            return logits
        depth = jnp.ones((len(states), x.shape[0]), jnp.int32)
        return logits, {"trajectory": tuple(states), "depth": depth}
