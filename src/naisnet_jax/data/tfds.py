"""TFDS: datasets a user has prepared in array_record format, and two small builders that prepare
Fashion-MNIST's IDX files and the pinned MNIST pickle the same way, read back with
``tfds.data_source``. tensorflow-datasets is imported inside the functions that need it, so the
package imports where only jax, flax and numpy exist; TFDS runs without tensorflow here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import pathlib
from typing import Any

import numpy as np

from naisnet_jax.data.sources import (
    FASHION_MNIST_HINT,
    MNIST_FILE,
    MNIST_HINT,
    MNIST_WHEEL,
    MNIST_WHEEL_MEMBER,
    Dataset,
    fashion_mnist_dir,
    find_idx_file,
    load_mnist_pinned,
    mnist_dir,
    read_fashion_mnist_split,
)

TFDS_NAMES = ("mnist", "fashion_mnist", "cifar10", "cifar100")


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


class _UnpreparedFolderRecords(logging.Filter):
    """Drops TFDS's warning that a version folder holds no ``dataset_info.json``."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (str(record.msg).startswith("Variant folder") and "dataset_info.json" in record.getMessage())


@contextlib.contextmanager
def _quiet_unprepared_folder(quiet: bool):
    """While TFDS looks for a dataset that is not prepared, keep its warning line about the empty
    version folder off stderr: the error raised then says what is missing and how to prepare it."""
    if not quiet:
        yield
        return
    absl_logger, records = logging.getLogger("absl"), _UnpreparedFolderRecords()
    absl_logger.addFilter(records)
    try:
        yield
    finally:
        absl_logger.removeFilter(records)


def _read_tfds(tfds, name: str, data_dir: pathlib.Path, num_classes: int | None = None):
    """``tfds.data_source`` for train and test, converted to a ``Dataset``; never downloads."""
    try:
        with _quiet_unprepared_folder(not _prepared_info_files(data_dir, name)):
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
        MANUAL_DOWNLOAD_INSTRUCTIONS = FASHION_MNIST_HINT
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
            images, labels = read_fashion_mnist_split(directory, prefix)
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
            find_idx_file(idx_dir, f"{split}-{kind}-ubyte")
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
        MANUAL_DOWNLOAD_INSTRUCTIONS = MNIST_HINT
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
        raise FileNotFoundError(f"MNIST file not found: {source / MNIST_FILE}. {MNIST_HINT}")
    return _prepare_from_manual_dir(tfds, _mnist_pinned_builder(), data_dir, source)


def load_mnist_tfds_pinned(*, data_dir: str | os.PathLike, mnist_data_dir: str | os.PathLike | None = None) -> Dataset:
    """Real MNIST through the TFDS builder: prepare into ``data_dir``, read back as numpy."""
    tfds = _import_tfds()
    prepare_mnist_pinned(data_dir=data_dir, mnist_data_dir=mnist_data_dir)
    ds = _read_tfds(tfds, "mnist_pinned", pathlib.Path(data_dir).expanduser(), 10)
    return dataclasses.replace(ds, name="mnist_tfds_pinned")
