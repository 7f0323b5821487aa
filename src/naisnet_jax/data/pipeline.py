"""The device-resident input pipeline (pure JAX).

``put_on_device`` keeps a whole split on the accelerator as uint8; ``epoch_batches`` draws an
epoch's shuffled index rows; ``get_batch`` gathers, normalises and optionally augments one row
inside a jitted step, so no batch crosses the host.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


def channel_stats(images: np.ndarray, chunk: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and standard deviation of uint8 ``(N, H, W, C)`` images, in [0, 1] units.

    Computed in float64 numpy, two passes over chunks (no float copy of the whole set); the
    standard deviation is the population one (divides by the pixel count). Use the training set.
    """
    images = np.asarray(images)
    if images.ndim != 4 or images.size == 0:
        raise ValueError(f"images must be a non-empty (N, H, W, C) array, got {images.shape}")
    count = images.size // images.shape[-1]
    total = np.zeros(images.shape[-1])
    for start in range(0, len(images), chunk):
        total += images[start : start + chunk].sum(axis=(0, 1, 2), dtype=np.float64)
    mean = total / count
    squares = np.zeros(images.shape[-1])
    for start in range(0, len(images), chunk):
        centred = images[start : start + chunk].astype(np.float64) - mean
        squares += np.einsum("nhwc,nhwc->c", centred, centred)
    return mean / 255.0, np.sqrt(squares / count) / 255.0


@struct.dataclass
class DeviceData:
    """A whole split on device: ``images`` ``(N, H, W, C)`` uint8, ``labels`` ``(N,)`` int32."""

    images: jax.Array
    labels: jax.Array

    @property
    def num_examples(self) -> int:
        return self.images.shape[0]


def put_on_device(images: np.ndarray, labels: np.ndarray, device=None) -> DeviceData:
    """Copies a split to ``device`` (default: the first), keeping images uint8 (4x smaller)."""
    images, labels = np.asarray(images), np.asarray(labels)
    if images.dtype != np.uint8 or images.ndim != 4:
        raise ValueError(f"images must be (N, H, W, C) uint8, got {images.shape} {images.dtype}")
    if labels.ndim != 1 or len(labels) != len(images):
        raise ValueError(f"labels must be ({len(images)},), got {labels.shape}")
    return DeviceData(
        images=jax.device_put(images, device),
        labels=jax.device_put(labels.astype(np.int32), device),
    )


@functools.partial(jax.jit, static_argnames=("num_examples", "batch_size"))
def epoch_batches(key: jax.Array, num_examples: int, batch_size: int) -> jax.Array:
    """One epoch of shuffled batch indices, ``(num_examples // batch_size, batch_size)`` int32.

    A fresh ``jax.random.permutation`` cut into rows; the last ``num_examples % batch_size``
    shuffled indices are dropped, so an epoch sees every example at most once and, across
    epochs, each one equally often in expectation. Row ``i`` is the ``idx`` of step ``i``.
    """
    steps = num_examples // batch_size
    if batch_size < 1 or steps < 1:
        raise ValueError(f"batch_size must be in [1, num_examples={num_examples}], got {batch_size}")
    perm = jax.random.permutation(key, num_examples)[: steps * batch_size]
    return perm.reshape(steps, batch_size).astype(jnp.int32)


def eval_batches(num_examples: int, batch_size: int) -> tuple[jax.Array, jax.Array]:
    """Ordered indices covering every example once, and the mask of real entries.

    Returns ``idx`` and ``mask``, both ``(ceil(num_examples / batch_size), batch_size)``; the
    last row is padded with index 0 and ``mask`` False, so ``sum(correct * mask)`` over all rows
    counts each example exactly once.
    """
    if num_examples < 1 or batch_size < 1:
        raise ValueError(f"num_examples and batch_size must be >= 1, got {num_examples}, {batch_size}")
    steps = -(-num_examples // batch_size)
    flat = jnp.arange(steps * batch_size, dtype=jnp.int32)
    mask = flat < num_examples
    idx = jnp.where(mask, flat, 0)
    return idx.reshape(steps, batch_size), mask.reshape(steps, batch_size)


def preprocess(images: jax.Array, mean, std, *, dtype=jnp.float32) -> jax.Array:
    """uint8 images to ``dtype``: ``(images / 255 - mean) / std`` with per-channel mean, std."""
    x = images.astype(dtype) / jnp.asarray(255.0, dtype)
    return (x - jnp.asarray(mean, dtype)) / jnp.asarray(std, dtype)


def augment_cifar(key: jax.Array, images: jax.Array, *, pad: int = 4, flip: bool = True) -> jax.Array:
    """Random crop after zero padding, and random horizontal flip, independently per image.

    ``images`` is ``(B, H, W, C)``, already normalised, so the zero padding is the mean colour.
    Each image is padded by ``pad`` on every side, cropped back to ``H x W`` at a uniform offset
    in ``[0, 2 * pad]^2``, and, with ``flip``, mirrored left-right with probability 1/2 (the
    crops are the same either way: the flip draws from a key of its own).
    """
    batch, height, width, channels = images.shape
    key_y, key_x, key_flip = jax.random.split(key, 3)
    dy = jax.random.randint(key_y, (batch,), 0, 2 * pad + 1, dtype=jnp.int32)
    dx = jax.random.randint(key_x, (batch,), 0, 2 * pad + 1, dtype=jnp.int32)
    mirror = jax.random.bernoulli(key_flip, 0.5, (batch,))
    padded = jnp.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)))

    def crop(image, y, x):
        zero = jnp.zeros((), jnp.int32)
        return jax.lax.dynamic_slice(image, (y, x, zero), (height, width, channels))

    cropped = jax.vmap(crop)(padded, dy, dx)
    if not flip:
        return cropped
    return jnp.where(mirror[:, None, None, None], cropped[:, :, ::-1, :], cropped)


def get_batch(
    data: DeviceData,
    idx: jax.Array,
    *,
    mean,
    std,
    key: jax.Array | None = None,
    augment: bool | str = False,
    dtype=jnp.float32,
) -> tuple[jax.Array, jax.Array]:
    """Gathers ``data[idx]`` on device, normalises it and, if ``augment``, augments it
    (:func:`augment_cifar`; ``augment="crop"``: pad and crop without the flip).

    Call inside the jitted step with ``idx`` a row of ``epoch_batches`` (or ``eval_batches``);
    ``augment`` must be static. Returns ``(x, y)``: ``x`` ``(B, H, W, C)`` of ``dtype``, ``y``
    ``(B,)`` int32.
    """
    x = preprocess(jnp.take(data.images, idx, axis=0), mean, std, dtype=dtype)
    y = jnp.take(data.labels, idx, axis=0)
    if augment:
        if key is None:
            raise ValueError("augment=True needs a PRNG key")
        x = augment_cifar(key, x, flip=augment != "crop")
    return x, y
