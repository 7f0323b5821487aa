"""Every model starts right: at initialisation it passes its input's spread through every block,
every NAIS block is certified stable, and the 54-block NAIS-Net1 learns at the paper's learning
rate from the first steps.

The spread is measured in training mode on standardised inputs (zero mean, unit variance), as
a training step sees them; a block's input and output are read with ``nn.intercept_methods``
(the blocks' own ``__call__``), so the model is not changed to be measured.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from naisnet_jax.verify import AuditOptions, audit_model

from naisnet_jax import models as M
from naisnet_jax import train
from naisnet_jax.configs import default

BLOCKS = (M.NaisConvBlock, M.NaisDenseBlock, M.ResNetConvBlock)
IMAGES = {"conv": (16, 16, 3), "fc": (28, 28, 1)}


def _image_shape(name: str) -> tuple[int, ...]:
    return IMAGES["conv" if ("cifar" in name or "conv" in name) else "fc"]


def _spreads(model, x):
    """``(logits std, [(block input std, block output std), ...])`` in training mode. A
    ``ResNetFC`` (30 layers, no block modules) is one block from its input to its last state."""
    variables = model.init(jax.random.PRNGKey(1), x, train=False)

    @jax.jit
    def run(variables, x):
        pairs = []

        def record(next_fun, args, kwargs, context):
            out = next_fun(*args, **kwargs)
            if isinstance(context.module, BLOCKS) and context.method_name == "__call__":
                y = out[0] if isinstance(out, tuple) else out
                pairs.append((jnp.std(args[0]), jnp.std(y)))
            return out

        with nn.intercept_methods(record):
            (logits, aux), _ = model.apply(variables, x, train=True, return_aux=True, mutable=["batch_stats"])
        if not pairs:
            pairs.append((jnp.std(x), jnp.std(aux["trajectory"][-1])))
        return jnp.std(logits), pairs

    logits_std, pairs = run(variables, x)
    return float(logits_std), [(float(a), float(b)) for a, b in pairs]


@pytest.mark.parametrize("name", sorted(M.MODELS))
def test_every_block_keeps_its_inputs_spread_at_initialisation(name):
    model = M.get_model(name, num_classes=10)
    x = jax.random.normal(jax.random.PRNGKey(0), (32, *_image_shape(name)))
    logits_std, pairs = _spreads(model, x)
    ratios = np.array([out / inp for inp, out in pairs])
    assert len(ratios) >= 1
    worst = int(np.argmax(np.abs(np.log(ratios))))
    assert np.all((ratios >= 0.25) & (ratios <= 4.0)), f"block {worst}: output/input std {ratios[worst]:.3g}"
    assert 0.1 <= logits_std <= 10.0, f"logits std {logits_std:.3g}"


def test_the_parameter_matched_resnet_keeps_the_spread_at_initialisation():
    """The two-convolution ResNet (section 5.2's parameter-matched row) starts as the paper's does."""
    model = M.get_model("resnet_cifar", num_classes=10, convs=2)
    logits_std, pairs = _spreads(model, jax.random.normal(jax.random.PRNGKey(0), (32, *IMAGES["conv"])))
    ratios = np.array([out / inp for inp, out in pairs])
    assert len(ratios) == 54 and np.all((ratios >= 0.25) & (ratios <= 4.0)), ratios
    assert 0.1 <= logits_std <= 10.0, logits_std


def test_the_former_conv_form_loses_its_signal():
    """The test has teeth: the form the CIFAR nets had before (BatchNorm only where the stage
    changes, drives at LeCun scale, ``x_0 = 0``) halves the second moment at every block, so
    the spread fades over the stages and the logits start near zero."""
    model = M.get_model("naisnet_cifar10", num_classes=10, drive_norm="transitions", drive_init="lecun")
    logits_std, pairs = _spreads(model, jax.random.normal(jax.random.PRNGKey(0), (32, *IMAGES["conv"])))
    assert logits_std < 1e-3
    assert np.prod([out / inp for inp, out in pairs[37:]]) < 1e-2  # the last stage, unnormalised


NAIS = sorted(n for n in M.MODELS if n.startswith("naisnet") or n == "resnet_sh_stable")


@pytest.mark.parametrize("name", NAIS)
def test_every_nais_block_is_certified_at_initialisation(name):
    """``model.init`` alone (no projection afterwards) lands every block in its stable set, and
    the verifier proves it for the float32 parameters (a parameter-level audit)."""
    model = M.get_model(name, num_classes=10)
    shape = _image_shape(name)
    variables = model.init(jax.random.PRNGKey(0), jnp.zeros((1, *shape)), train=False)
    certificate = audit_model(model, variables, options=AuditOptions(input_shape=shape, estimate_conv_radius=False))
    assert certificate.blocks, name
    assert certificate.certified, certificate.table()


def _fashion_mnist_14x14(n: int):
    """The first ``n`` real Fashion-MNIST training images, 2x2 average-pooled to 14x14 and
    standardised (the 54-block net then runs in seconds a step on a CPU)."""
    from naisnet_jax import data as data_lib

    try:
        ds = data_lib.load_dataset("fashion_mnist_idx", limit_train=n, limit_test=1)
    except (FileNotFoundError, ValueError) as e:  # make test installs it (make data)
        pytest.skip(f"Fashion-MNIST IDX files not found: {e}")
    x = ds.train_images.astype(np.float32).reshape(n, 14, 2, 14, 2, 1).mean((2, 4)) / 255
    return (x - x.mean()) / x.std(), ds.train_labels


def test_naisnet_cifar1_learns_at_the_papers_learning_rate():
    """The 54-block NAIS-Net1 at its defaults, SGD at 0.1 with momentum 0.9 and weight decay
    2e-4 (the paper's CIFAR optimisation) and the stability projection after every step: 30
    steps of 32 real images bring the loss well below ln 10."""
    x, y = _fashion_mnist_14x14(2048)
    config = default.get_config()
    config.model, config.h, config.learning_rate, config.weight_decay = "naisnet_cifar1", 1.0, 0.1, 2e-4
    model = train.build_model(config, 10)
    state = train.create_train_state(config, model, x.shape[1:], 64)
    step = jax.jit(train.train_step)
    order = np.random.default_rng(0).permutation(len(x))
    losses = []
    for i in range(30):
        idx = order[32 * i : 32 * (i + 1)]
        state, metrics = step(state, (jnp.asarray(x[idx]), jnp.asarray(y[idx])))
        losses.append(float(metrics["loss"]))
    assert all(math.isfinite(v) for v in losses)
    assert abs(losses[0] - math.log(10)) < 0.5, losses[0]  # it starts near chance, not far above
    assert np.mean(losses[-5:]) < 0.6 * math.log(10), losses
