"""Tests for naisnet_jax.data: IDX parsing, TFDS paths (without tensorflow), digits, and the
device pipeline against numpy float64 references."""

import gzip
import io
import json
import logging
import os
import pathlib
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from naisnet_jax import data

DEBIAN_DIR = pathlib.Path(data.DEBIAN_FASHION_MNIST_DIR)
FASHION_FILES = [
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
]


needs_debian_fashion_mnist = pytest.mark.skipif(
    not all((DEBIAN_DIR / f).is_file() for f in FASHION_FILES),
    reason=f"Fashion-MNIST IDX files absent from {DEBIAN_DIR} (apt-get install dataset-fashion-mnist)",
)


# ---------------------------------------------------------------------------------------------
# Fixture helpers: small IDX files written by hand.


def idx_bytes(array, *, magic=None, dims=None):
    """IDX encoding of a uint8 array; ``magic`` and ``dims`` override the header to corrupt it."""
    array = np.asarray(array, np.uint8)
    if magic is None:
        magic = 0x00000800 | array.ndim
    dims = array.shape if dims is None else dims
    header = magic.to_bytes(4, "big") + b"".join(int(d).to_bytes(4, "big") for d in dims)
    return header + array.tobytes()


def write_idx(path, array, *, gz=True, **kwargs):
    raw = idx_bytes(array, **kwargs)
    path.write_bytes(gzip.compress(raw) if gz else raw)
    return path


def write_fashion_dir(directory, *, n_train=20, n_test=8, seed=0):
    """Four small Fashion-MNIST-shaped IDX files; returns the arrays written."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, (n,), dtype=np.uint8)
        write_idx(directory / f"{prefix}-images-idx3-ubyte.gz", images)
        write_idx(directory / f"{prefix}-labels-idx1-ubyte.gz", labels)
        arrays[prefix] = (images, labels)
    return arrays


# ---------------------------------------------------------------------------------------------
# IDX files.


@needs_debian_fashion_mnist
def test_real_fashion_mnist_idx(monkeypatch):
    monkeypatch.delenv(data.FASHION_MNIST_ENV, raising=False)
    ds = data.load_dataset("fashion_mnist_idx")
    assert ds.train_images.shape == (60000, 28, 28, 1)
    assert ds.test_images.shape == (10000, 28, 28, 1)
    assert ds.train_images.dtype == np.uint8 and ds.train_labels.dtype == np.int32
    assert ds.num_classes == 10 and ds.name == "fashion_mnist_idx"
    # Fashion-MNIST is balanced: 6000 / 1000 of each class.
    np.testing.assert_array_equal(np.bincount(ds.train_labels, minlength=10), [6000] * 10)
    np.testing.assert_array_equal(np.bincount(ds.test_labels, minlength=10), [1000] * 10)
    assert ds.train_images.max() == 255


def test_read_idx_gzip_and_raw_agree(tmp_path):
    images = np.random.default_rng(1).integers(0, 256, (5, 3, 4), dtype=np.uint8)
    a = data.read_idx(write_idx(tmp_path / "a.gz", images))
    b = data.read_idx(write_idx(tmp_path / "b", images, gz=False))
    np.testing.assert_array_equal(a, images)
    np.testing.assert_array_equal(b, images)
    assert a.dtype == np.uint8 and a.flags.writeable


def test_env_var_and_data_dir(tmp_path, monkeypatch):
    arrays = write_fashion_dir(tmp_path / "idx")
    monkeypatch.setenv(data.FASHION_MNIST_ENV, str(tmp_path / "idx"))
    ds = data.load_dataset("fashion_mnist_idx")
    np.testing.assert_array_equal(ds.train_images[..., 0], arrays["train"][0])
    np.testing.assert_array_equal(ds.test_labels, arrays["t10k"][1])
    # An explicit data_dir wins over the environment variable.
    monkeypatch.setenv(data.FASHION_MNIST_ENV, str(tmp_path / "nowhere"))
    assert len(data.load_dataset("fashion_mnist_idx", data_dir=tmp_path / "idx").test_labels) == 8


CORRUPTIONS = {
    # name: (bytes of the file, words the message must contain)
    "bad_magic": (idx_bytes(np.zeros((2, 3, 3)), magic=0x03080000), ["0x03080000", "0x00000803"]),
    "bad_type": (idx_bytes(np.zeros((2, 3, 3)), magic=0x00000D03), ["0x0d", "expected 0x08"]),
    "truncated": (idx_bytes(np.zeros((2, 3, 3)))[:-5], ["truncated", "need 18", "found 13"]),
    "dims_too_small": (idx_bytes(np.zeros((2, 3, 3)), dims=(1, 3, 3)), ["need 9", "found 18"]),
    "short_header": (idx_bytes(np.zeros((2, 3, 3)))[:9], ["truncated header"]),
}


@pytest.mark.parametrize("gz", [True, False])
@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_read_idx_rejects_corrupt_files(tmp_path, case, gz):
    raw, words = CORRUPTIONS[case]
    path = tmp_path / f"{case}-idx3-ubyte"
    path.write_bytes(gzip.compress(raw) if gz else raw)
    with pytest.raises(ValueError) as info:
        data.read_idx(path)
    for word in [str(path), *words]:
        assert word in str(info.value)


def test_read_idx_rejects_truncated_gzip_stream(tmp_path):
    compressed = gzip.compress(idx_bytes(np.arange(200).reshape(2, 10, 10)))
    path = tmp_path / "cut.gz"
    path.write_bytes(compressed[: len(compressed) // 2])
    with pytest.raises(ValueError, match="truncated gzip") as info:
        data.read_idx(path)
    assert str(path) in str(info.value)


def test_read_idx_rank_demanded(tmp_path):
    path = write_idx(tmp_path / "labels.gz", np.arange(4))
    assert data.read_idx(path, ndim=1).shape == (4,)
    with pytest.raises(ValueError, match="expected 0x00000803") as info:
        data.read_idx(path, ndim=3)
    assert str(path) in str(info.value)


def test_images_labels_count_mismatch(tmp_path):
    write_fashion_dir(tmp_path)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.zeros(7))  # 8 images, 7 labels
    with pytest.raises(ValueError) as info:
        data.load_dataset("fashion_mnist_idx", data_dir=tmp_path)
    message = str(info.value)
    assert "t10k-images-idx3-ubyte.gz" in message and "t10k-labels-idx1-ubyte.gz" in message
    assert "8 images" in message and "7 labels" in message


def test_label_out_of_range(tmp_path):
    write_fashion_dir(tmp_path)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.full(20, 10))
    with pytest.raises(ValueError, match="label 10 found") as info:
        data.load_dataset("fashion_mnist_idx", data_dir=tmp_path)
    assert "train-labels-idx1-ubyte.gz" in str(info.value)


def test_missing_file_says_how_to_get_it(tmp_path):
    write_fashion_dir(tmp_path)
    (tmp_path / "t10k-images-idx3-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError) as info:
        data.load_dataset("fashion_mnist_idx", data_dir=tmp_path)
    message = str(info.value)
    assert str(tmp_path / "t10k-images-idx3-ubyte") in message
    assert "apt-get install dataset-fashion-mnist" in message
    assert data.FASHION_MNIST_ENV in message
    with pytest.raises(FileNotFoundError, match="t10k-images"):
        data.read_idx(tmp_path / "t10k-images-idx3-ubyte.gz")


def test_uncompressed_files_are_found(tmp_path):
    arrays = write_fashion_dir(tmp_path)
    for f in FASHION_FILES:
        gz = tmp_path / f
        gz.with_suffix("").write_bytes(gzip.decompress(gz.read_bytes()))
        gz.unlink()
    ds = data.load_dataset("fashion_mnist_idx", data_dir=tmp_path)
    np.testing.assert_array_equal(ds.train_labels, arrays["train"][1])


# ---------------------------------------------------------------------------------------------
# TFDS, without tensorflow.


def test_tfds_builder_round_trip(tmp_path):
    arrays = write_fashion_dir(tmp_path / "idx", n_train=20, n_test=8)
    direct = data.load_dataset("fashion_mnist_idx", data_dir=tmp_path / "idx")
    via_tfds = data.load_dataset("fashion_mnist_tfds_idx", data_dir=tmp_path / "tfds", idx_dir=tmp_path / "idx")
    assert via_tfds.name == "fashion_mnist_tfds_idx" and via_tfds.num_classes == 10
    for field in ("train_images", "train_labels", "test_images", "test_labels"):
        a, b = getattr(direct, field), getattr(via_tfds, field)
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)  # same order: the builder disables shuffling
    np.testing.assert_array_equal(via_tfds.train_images[..., 0], arrays["train"][0])
    info = json.loads((tmp_path / "tfds/fashion_mnist_idx/1.0.0/dataset_info.json").read_text())
    assert info["fileFormat"] == "array_record"
    # Preparing again is a no-op that reads the same data.
    again = data.load_fashion_mnist_tfds_idx(data_dir=tmp_path / "tfds", idx_dir=tmp_path / "idx")
    np.testing.assert_array_equal(again.test_images, direct.test_images)
    assert "tensorflow" not in sys.modules


@pytest.mark.slow
@needs_debian_fashion_mnist
def test_tfds_builder_real_fashion_mnist(tmp_path):
    """All 70000 real examples through the TFDS builder (about 10 s)."""
    direct = data.load_dataset("fashion_mnist_idx", data_dir=DEBIAN_DIR)
    via_tfds = data.load_dataset("fashion_mnist_tfds_idx", data_dir=tmp_path, idx_dir=DEBIAN_DIR)
    for field in ("train_images", "train_labels", "test_images", "test_labels"):
        np.testing.assert_array_equal(getattr(direct, field), getattr(via_tfds, field))


def test_tfds_builder_missing_idx_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        data.prepare_fashion_mnist_idx(data_dir=tmp_path / "tfds", idx_dir=tmp_path / "empty")
    assert not (tmp_path / "tfds").exists()


@pytest.mark.parametrize(
    "name, shape, num_classes",
    [
        ("mnist", (28, 28, 1), 10),
        ("fashion_mnist", (28, 28, 1), 10),
        ("cifar10", (32, 32, 3), 10),
        ("cifar100", (32, 32, 3), 100),
    ],
)
def test_load_tfds_under_mock_data(tmp_path, name, shape, num_classes):
    tfds = pytest.importorskip("tensorflow_datasets")
    # In tfds 4.9.10, mock_data patches `DatasetBuilder.as_data_source` (so `tfds.data_source`
    # returns ArrayRecordDataSource objects over generated examples) and ignores `data_dir`.
    # USE_CODE takes features from the builder class, so no metadata files are needed. It
    # leaves split names unknown: `split=None` would give an empty dict, hence load_tfds asks
    # for ["train", "test"] explicitly.
    with tfds.testing.mock_data(num_examples=6, policy=tfds.testing.MockPolicy.USE_CODE):
        ds = data.load_dataset(name, data_dir=tmp_path)
    assert ds.name == name and ds.num_classes == num_classes
    assert ds.train_images.shape == (6, *shape) and ds.test_images.shape == (6, *shape)
    assert ds.train_images.dtype == np.uint8 and ds.train_labels.dtype == np.int32
    assert ds.train_labels.min() >= 0 and ds.train_labels.max() < num_classes
    assert ds.train_images.std() > 0  # real generated pixels, not a constant placeholder
    assert "tensorflow" not in sys.modules


def png_bytes(image):
    """PNG encoding through PIL (TFDS would encode a numpy image through tensorflow)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(buffer, format="PNG")
    return buffer.getvalue()


def prepare_tiny_tfds(tfds, name, data_dir, splits):
    """Writes a real array_record copy of TFDS dataset ``name`` holding the given examples.

    Subclasses the registered builder (same name, version, features) but generates our
    examples instead of downloading. Images are handed over as PNG bytes, which TFDS stores
    as is, so no tensorflow is needed.
    """
    base = tfds.builder_cls(name)

    class Tiny(base, skip_registration=True):
        code_path = None  # see the note in data.tfds._fashion_mnist_idx_builder

        def _split_generators(self, dl_manager):
            return {split: self._generate_examples(*arrays) for split, arrays in splits.items()}

        def _generate_examples(self, images, labels):
            for i, (image, label) in enumerate(zip(images, labels)):
                example = {"image": png_bytes(image), "label": int(label)}
                if name.startswith("cifar"):
                    example["id"] = f"tiny_{i}"
                if name == "cifar100":
                    example["coarse_label"] = 0
                yield i, example

    Tiny.name = name
    builder = Tiny(data_dir=str(data_dir), file_format="array_record")
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(try_download_gcs=False))


@pytest.mark.parametrize(
    "name, shape, num_classes",
    [
        ("mnist", (28, 28, 1), 10),
        ("fashion_mnist", (28, 28, 1), 10),
        ("cifar10", (32, 32, 3), 10),
        ("cifar100", (32, 32, 3), 100),
    ],
)
def test_load_tfds_from_real_array_record_files(tmp_path, name, shape, num_classes):
    """No mock: the registered builder reads array_record files and decodes PNGs with PIL."""
    tfds = pytest.importorskip("tensorflow_datasets")
    rng = np.random.default_rng(5)
    splits = {
        split: (rng.integers(0, 256, (n, *shape), dtype=np.uint8), rng.integers(0, 10, n))
        for split, n in (("train", 5), ("test", 3))
    }
    prepare_tiny_tfds(tfds, name, tmp_path, splits)
    ds = data.load_dataset(name, data_dir=tmp_path)
    assert ds.num_classes == num_classes and ds.train_images.shape == (5, *shape)
    for split in ("train", "test"):
        # TFDS shuffles examples when it writes them, so compare as multisets.
        images, labels = getattr(ds, f"{split}_images"), getattr(ds, f"{split}_labels")
        got = sorted((x.tobytes(), int(y)) for x, y in zip(images, labels))
        want = sorted((x.tobytes(), int(y)) for x, y in zip(*splits[split]))
        assert got == want
    assert "tensorflow" not in sys.modules


def test_load_tfds_missing_is_quick_and_clear(tmp_path):
    pytest.importorskip("tensorflow_datasets")
    start = time.monotonic()
    with pytest.raises(FileNotFoundError) as info:
        data.load_tfds("mnist", data_dir=tmp_path / "tfds")
    assert time.monotonic() - start < 5.0
    message = str(info.value)
    assert str(tmp_path / "tfds") in message
    assert "tfds build mnist --data_dir=DIR --file_format=array_record" in message
    assert not (tmp_path / "tfds").exists()  # nothing created, nothing downloaded


def test_load_tfds_missing_says_it_in_the_error_alone(tmp_path, caplog):
    """TFDS's own warning about the version folder it did not find stays off the log: the error
    says what is missing; a record of any other kind still passes."""
    pytest.importorskip("tensorflow_datasets")
    caplog.set_level(logging.WARNING)
    with pytest.raises(FileNotFoundError):
        data.load_tfds("cifar10", data_dir=tmp_path)
    assert not [r for r in caplog.records if "dataset_info" in r.getMessage()], caplog.text
    logging.getLogger("absl").warning("Variant folder %s has invalid version %s", tmp_path, "x")
    assert "has invalid version x" in caplog.text


def test_load_tfds_wrong_format(tmp_path):
    pytest.importorskip("tensorflow_datasets")
    version_dir = tmp_path / "cifar10/3.0.2"
    version_dir.mkdir(parents=True)
    (version_dir / "dataset_info.json").write_text(json.dumps({"name": "cifar10", "splits": []}))
    with pytest.raises(ValueError, match=r"stored as \['tfrecord'\], expected array_record"):
        data.load_tfds("cifar10", data_dir=tmp_path)


def test_package_imports_without_tfds():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('tensorflow_datasets', 'tensorflow'):\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from naisnet_jax import data\n"
        "try:\n"
        "    data.load_tfds('mnist', data_dir='.')\n"
        "except ImportError as e:\n"
        "    assert 'tensorflow-datasets' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('expected ImportError')\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------------------------------------
# Digits and the entry point.


def test_digits():
    ds = data.load_dataset("digits")
    assert ds.train_images.shape == (1438, 8, 8, 1) and ds.test_images.shape == (359, 8, 8, 1)
    assert ds.train_images.dtype == np.uint8 and ds.train_images.max() == 255
    assert set(np.unique(ds.test_labels)) == set(range(10))
    again = data.load_dataset("digits")
    np.testing.assert_array_equal(ds.test_images, again.test_images)  # split is fixed
    from sklearn.datasets import load_digits

    raw = load_digits()
    np.testing.assert_allclose(ds.test_images[0, ..., 0] / 255 * 16, raw.images[4], atol=0.04)
    assert ds.test_labels[0] == raw.target[4]


def test_unknown_name_and_limits():
    with pytest.raises(ValueError) as info:
        data.load_dataset("imagenet")
    for name in data.DATASET_NAMES:
        assert name in str(info.value)
    small = data.load_dataset("digits", limit_train=100, limit_test=10)
    assert len(small.train_labels) == 100 and small.test_images.shape == (10, 8, 8, 1)
    with pytest.raises(ValueError, match="limit_train"):
        data.load_dataset("digits", limit_train=0)


def test_validation_holds_out_the_end_of_the_training_set():
    full = data.load_dataset("digits")
    held = data.load_dataset("digits", validation=300)
    np.testing.assert_array_equal(held.train_images, full.train_images[:-300])
    np.testing.assert_array_equal(held.train_labels, full.train_labels[:-300])
    np.testing.assert_array_equal(held.test_images, full.train_images[-300:])  # the evaluation split
    np.testing.assert_array_equal(held.test_labels, full.train_labels[-300:])
    assert held.name == "digits[:-300]" and held.num_classes == full.num_classes
    # No test image is left in either split (the digits' splits share no image).
    test_rows = {bytes(x) for x in full.test_images}
    assert not test_rows & {bytes(x) for x in np.concatenate([held.train_images, held.test_images])}
    # The limits apply after the hold-out.
    small = data.load_dataset("digits", validation=300, limit_train=100, limit_test=10)
    np.testing.assert_array_equal(small.test_images, full.train_images[-300:-290])
    assert len(small.train_labels) == 100
    for bad in (0, len(full.train_labels), 1.5, True):
        with pytest.raises(ValueError, match=r"validation=.* must be an integer in \[1, 1437\]"):
            data.load_dataset("digits", validation=bad)


def test_dataset_validates():
    images, labels = np.zeros((3, 2, 2, 1), np.uint8), np.array([0, 1, 2], np.int32)
    with pytest.raises(ValueError, match="int32"):
        data.Dataset(images, labels.astype(np.int64), images, labels, 3, "x")
    with pytest.raises(ValueError, match=r"expected \[0, 1\]"):
        data.Dataset(images, labels, images, labels, 2, "x")


# ---------------------------------------------------------------------------------------------
# Device pipeline.


def test_channel_stats_matches_float64():
    images = np.random.default_rng(2).integers(0, 256, (37, 5, 4, 3), dtype=np.uint8)
    mean, std = data.channel_stats(images, chunk=8)  # several chunks
    x = images.astype(np.float64) / 255
    np.testing.assert_allclose(mean, x.mean(axis=(0, 1, 2)), rtol=1e-13)
    np.testing.assert_allclose(std, x.std(axis=(0, 1, 2)), rtol=1e-12)


@pytest.mark.parametrize("dtype, rtol", [(jnp.float64, 1e-12), (jnp.float32, 1e-5)])
def test_preprocess_matches_numpy(dtype, rtol):
    images = np.random.default_rng(3).integers(0, 256, (4, 6, 6, 3), dtype=np.uint8)
    mean, std = data.channel_stats(images)
    out = jax.jit(lambda x: data.preprocess(x, mean, std, dtype=dtype))(images)
    assert out.dtype == dtype
    expected = (images.astype(np.float64) / 255 - mean) / std
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=rtol, atol=rtol)


def test_epoch_batches_is_a_permutation():
    rows = data.epoch_batches(jax.random.key(0), 60, 12)
    assert rows.shape == (5, 12) and rows.dtype == jnp.int32
    np.testing.assert_array_equal(np.sort(np.asarray(rows).ravel()), np.arange(60))
    other = data.epoch_batches(jax.random.key(1), 60, 12)
    assert not np.array_equal(rows, other)
    np.testing.assert_array_equal(rows, data.epoch_batches(jax.random.key(0), 60, 12))
    # A remainder is dropped: 62 // 12 = 5 rows of distinct indices.
    rows = np.asarray(data.epoch_batches(jax.random.key(2), 62, 12)).ravel()
    assert rows.shape == (60,) and len(np.unique(rows)) == 60 and rows.max() < 62
    with pytest.raises(ValueError, match="batch_size"):
        data.epoch_batches(jax.random.key(0), 10, 11)


def test_eval_batches_cover_every_example_once():
    for n, b in [(10, 4), (12, 4), (1, 8), (7, 1)]:
        idx, mask = data.eval_batches(n, b)
        assert idx.shape == mask.shape == (-(-n // b), b)
        counts = np.bincount(np.asarray(idx)[np.asarray(mask)], minlength=n)
        np.testing.assert_array_equal(counts, np.ones(n))
        assert int(mask.sum()) == n


def crops_reference(image, pad):
    """All (2 pad + 1)^2 crops of the zero-padded image and of its mirror, as numpy."""
    h, w, _ = image.shape
    padded = np.pad(image, ((pad, pad), (pad, pad), (0, 0)))
    crops = [padded[y : y + h, x : x + w] for y in range(2 * pad + 1) for x in range(2 * pad + 1)]
    return np.stack(crops), np.stack([c[:, ::-1] for c in crops])


@pytest.mark.parametrize("shape", [(32, 32, 3), (7, 5, 2)])
def test_augment_cifar_outputs_are_crops(shape):
    images = np.random.default_rng(4).standard_normal((64, *shape))
    out = np.asarray(jax.jit(data.augment_cifar)(jax.random.key(5), jnp.asarray(images)))
    assert out.shape == images.shape
    offsets, flips = set(), set()
    for image, result in zip(images, out):
        plain, mirrored = crops_reference(image, 4)
        hits = [
            (flipped, k)
            for flipped, crops in ((False, plain), (True, mirrored))
            for k in range(len(crops))
            if np.array_equal(crops[k], result)
        ]
        assert len(hits) == 1, "output is not exactly one crop of the padded (flipped) image"
        flips.add(hits[0][0])
        offsets.add(hits[0][1])
    assert flips == {False, True} and len(offsets) > 20  # both flips, many offsets drawn
    again = np.asarray(data.augment_cifar(jax.random.key(5), jnp.asarray(images)))
    np.testing.assert_array_equal(out, again)


def test_augment_crop_only_draws_the_same_crops_unmirrored():
    """``flip=False`` (``get_batch(augment="crop")``): the same crops as with the flip, none
    mirrored; a mirrored digit is another digit or none."""
    images = np.random.default_rng(4).standard_normal((64, 7, 5, 2))
    key = jax.random.key(5)
    crops = np.asarray(data.augment_cifar(key, jnp.asarray(images), flip=False))
    both = np.asarray(data.augment_cifar(key, jnp.asarray(images)))
    mirrored = 0
    for image, crop, result in zip(images, crops, both):
        plain, _ = crops_reference(image, 4)
        assert any(np.array_equal(c, crop) for c in plain)
        assert np.array_equal(result, crop) or np.array_equal(result, crop[:, ::-1])
        mirrored += not np.array_equal(result, crop)
    assert 10 < mirrored < 54  # the flip is drawn per image; without it nothing is mirrored
    rng = np.random.default_rng(6)
    device_data = data.put_on_device(rng.integers(0, 256, (20, 7, 5, 2), dtype=np.uint8), np.zeros(20, np.int32))
    idx = jnp.arange(20)
    x, _ = data.get_batch(device_data, idx, mean=0.0, std=1.0, key=key, augment="crop")
    np.testing.assert_array_equal(x, data.augment_cifar(key, data.preprocess(device_data.images, 0.0, 1.0), flip=False))


def test_get_batch_inside_jit():
    rng = np.random.default_rng(6)
    images = rng.integers(0, 256, (50, 6, 6, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, 50).astype(np.int32)
    device_data = data.put_on_device(images, labels)
    assert device_data.images.dtype == jnp.uint8 and device_data.labels.dtype == jnp.int32
    assert device_data.num_examples == 50
    mean, std = data.channel_stats(images)

    @jax.jit
    def step(d, idx, key):
        plain = data.get_batch(d, idx, mean=mean, std=std)
        augmented = data.get_batch(d, idx, mean=mean, std=std, key=key, augment=True)
        return plain, augmented

    idx = data.epoch_batches(jax.random.key(7), 50, 16)[0]
    (x, y), (xa, ya) = step(device_data, idx, jax.random.key(8))
    expected = (images[np.asarray(idx)] / 255 - mean) / std
    np.testing.assert_allclose(x, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(y, labels[np.asarray(idx)])
    np.testing.assert_array_equal(ya, y)
    assert x.dtype == xa.dtype == jnp.float32 and xa.shape == x.shape
    with pytest.raises(ValueError, match="PRNG key"):
        data.get_batch(device_data, idx, mean=mean, std=std, augment=True)


def test_epoch_as_one_scan():
    """A whole epoch inside jit: every example's label is summed exactly once."""
    labels = np.arange(40, dtype=np.int32) % 7
    device_data = data.put_on_device(np.zeros((40, 2, 2, 1), np.uint8), labels)

    @jax.jit
    def epoch(d, key):
        def body(total, idx):
            _, y = data.get_batch(d, idx, mean=0.5, std=0.25)
            return total + y.sum(dtype=jnp.int32), None

        return jax.lax.scan(body, jnp.int32(0), data.epoch_batches(key, 40, 8))[0]

    assert int(epoch(device_data, jax.random.key(9))) == labels.sum()
