"""Bad input, kind by kind, through the public entry points (``train_and_evaluate``,
``naisnet-train``, ``naisnet-verify``, ``naisnet_jax.checkpoint``, the models and the pure
core). Each must be answered by an error that names what is wrong (the field, file or value),
raised in Python before XLA sees anything, and must leave every file as it was: no workdir
created for a refused run, no checkpoint or metrics record changed by a refused resume.

Kinds (the test names say which):
 1. every config field out of range            2. config fields of the wrong type
 3. NaN and infinite hyper-parameters          4. an empty dataset
 5. a missing data file                        6. an IDX file with a bad magic number
 7. a truncated gzip stream                    8. a file that is not gzip or IDX at all
 9. labels outside the classes                10. images and labels that disagree in number
11. images of the wrong dtype or shape        12. model inputs of the wrong shape
13. model hyper-parameters out of range       14. projection inputs of the wrong shape
15. unroll settings out of range              16. a writer without write_scalars
17. resuming with a checkpoint of another model
18. a truncated checkpoint                    19. a tampered checkpoint (flipped bytes)
20. a checkpoint without its metadata         21. metadata of another format
22. a file where the verifier wants a directory
23. an empty directory for the verifier       24. a pickle planted as a checkpoint
25. a corrupt metrics log on resume           26. a learning rate that makes training diverge
27. non-finite parameters in a checkpoint     28. bad command lines (more in test_cli.py)
...
35. a damaged newest checkpoint: the newest intact step is used, with one warning line
36. no intact checkpoint: refused in one line  37. resuming a run of another dataset or optimiser
38. Orbax's own log lines never reach the user 39. parameters that overflow float32 in the audit
40. ``demo --fresh`` on a folder that is not only a run's
41. the demo's bad flags, and a workdir with a space in it
42. ``~`` in ``naisnet-train``'s and the demo's workdir   43. ``~`` in ``naisnet-verify``'s paths
44. the verifier's bad options and unwritable outputs      45. its unusable checkpoints and data
46. a run's workdir given to the verifier                  47. an empty batch to audit
48. a projection with no block to project

Tests 35-46 run the commands as subprocesses, as a user does: their stderr must hold exactly the
lines the commands write themselves, with no traceback, no ``Event loop is closed`` from Orbax's
reads and no ``ERROR:absl`` line; from 40 on each must end within ``QUICK_S`` seconds.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import math
import os
import pathlib
import pickle
import re
import shlex
import shutil
import struct
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from naisnet_jax.verify import cli as verify_cli

import naisnet_jax as nj
from naisnet_jax import checkpoint as ckpt
from naisnet_jax import data as data_lib
from naisnet_jax import engine, models, train, train_cli
from naisnet_jax.configs import default

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY_ARGS = [
    f"--config={REPO / 'src/naisnet_jax/configs/digits_tiny.py'}",
    "--config.model_kwargs.features=8",
    "--config.model_kwargs.steps=3",
    "--config.limit_train=256",
    "--config.limit_test=100",
    "--config.batch_size=64",
    "--config.eval_batch_size=100",
    "--config.num_epochs=2",
    "--config.progress=false",
]


def tiny_config(**overrides):
    _, config = train_cli.parse(TINY_ARGS + ["--workdir=unused"])
    for key, value in overrides.items():
        config[key] = value
    return config


def snapshot(root) -> dict[str, str]:
    """Every file under ``root`` with the sha256 of its bytes."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, root)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


def run_train(argv) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            train_cli.main(argv)
            code = 0
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


def run_verify(path, *extra) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            verify_cli.main([str(path), "--data=none", *extra])
            code = 0
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


def assert_one_line(err: str, *words: str):
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, (word, err)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A workdir after epoch 1 of 2 (the command line stops it by asking for one epoch)."""
    workdir = tmp_path_factory.mktemp("bad-input") / "base"
    code, err = run_train(TINY_ARGS + [f"--workdir={workdir}", "--config.num_epochs=1"])
    assert code == 0, err
    return workdir


@pytest.fixture
def workdir(trained, tmp_path):
    """A private copy of the trained workdir, resumable with ``TINY_ARGS``."""
    copy = tmp_path / "work"
    shutil.copytree(trained, copy)
    return copy


def _latest_step_dir(workdir) -> pathlib.Path:
    checkpoints = workdir / train.CHECKPOINT_DIR
    return checkpoints / str(max(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()))


def _biggest_state_file(workdir) -> pathlib.Path:
    """The largest file of the latest step's ``state``."""
    files = [p for p in (_latest_step_dir(workdir) / "state").rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


def _state_data_files(workdir) -> list[pathlib.Path]:
    """The OCDBT data files of the latest step's ``state`` that hold the array bytes: those
    under a per-process ``d/`` (the top-level ``d/`` holds the merged index, parts of which a
    read may never open), or every ``d/`` file where the writer made no per-process folder."""
    files = [p for p in (_latest_step_dir(workdir) / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    return [p for p in files if p.parent.parent.name.startswith("ocdbt.process")] or files


# ------------------------------------------------------------------ 1-3. configs

OUT_OF_RANGE = {
    "model": "nope",
    "model_kwargs": {"widht": 8},
    "fast_path": "fast",
    "eps": 0.5,
    "eta": 0.005,
    "relaxed": "yes",
    "h": 1.01,
    "adaptive_tol": -1e-3,
    "max_steps": 0,
    "dataset": "imagenet",
    "data_dir": "/nonexistent",
    "limit_train": 0,
    "limit_test": -5,
    "validation": 0,
    "augment": 2,
    "augment_flip": "no",
    "learning_rate": 0.0,
    "momentum": 1.0,
    "weight_decay": -1e-4,
    "lr_boundaries_epochs": [5, 5],
    "lr_decay_factor": 1.5,
    "lr_warmup_steps": -1,
    "lr_warmup_factor": 0.0,
    "batch_size": 0,
    "eval_batch_size": -1,
    "num_epochs": 0,
    "seed": -1,
    "checkpoint_every_epochs": 0,
    "keep_checkpoints": 0,
    "steps_per_chunk": 0,
    "progress": None,
    "num_seeds": 0,
    "num_devices": 0,
    "seeds_at_once": 0,
    "standardize": "yes",
    "sync_batch_norm": "no",
}


def test_every_config_field_has_an_out_of_range_case():
    missing = set(default.get_config().keys()) - set(OUT_OF_RANGE)
    assert not missing, f"add an out-of-range case for {sorted(missing)}"


def _raw_config(**changes) -> ml_collections.ConfigDict:
    """A config built from a plain dict, as a hand-written config file may do (no type checks)."""
    d = tiny_config().to_dict()
    d.update(changes)
    return ml_collections.ConfigDict(d)


@pytest.mark.parametrize("field", sorted(OUT_OF_RANGE))
def test_1_every_config_field_out_of_range(tmp_path, field):
    if field not in default.get_config():
        pytest.skip(f"config.{field} is not in this branch's default config")
    config = _raw_config(**{field: OUT_OF_RANGE[field]})
    if field == "data_dir":
        config.dataset = "fashion_mnist_idx"
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        train.train_and_evaluate(config, str(tmp_path / "w"))
    message = str(info.value)
    assert f"config.{field}" in message or (field == "data_dir" and "/nonexistent" in message), message
    if field == "model_kwargs":
        assert "widht" in message
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize(
    "field, value",
    [
        ("learning_rate", "0.1"),
        ("batch_size", 64.0),
        ("relaxed", "no"),
        ("seed", 1.5),
        ("lr_boundaries_epochs", [1.5]),
        ("eps", [0.1]),
        ("num_epochs", True),
    ],
)
def test_2_config_fields_of_the_wrong_type(tmp_path, field, value):
    with pytest.raises(ValueError, match=rf"config\.{field}="):
        train.train_and_evaluate(_raw_config(**{field: value}), str(tmp_path / "w"))
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize(
    "field, value",
    [
        ("h", math.nan),
        ("eps", math.inf),
        ("learning_rate", math.nan),
        ("momentum", -math.inf),
        ("weight_decay", math.inf),
        ("adaptive_tol", math.nan),
        ("lr_decay_factor", math.nan),
    ],
)
def test_3_nan_and_infinite_hyper_parameters(tmp_path, field, value):
    with pytest.raises(ValueError, match=rf"config\.{field}=(nan|inf|-inf)"):
        train.train_and_evaluate(tiny_config(**{field: value}), str(tmp_path / "w"))
    assert not (tmp_path / "w").exists()


# ------------------------------------------------------------------ 4-11. data


def _write_idx(path, array, *, magic_dtype=0x08, ndim=None):
    ndim = array.ndim if ndim is None else ndim
    header = struct.pack(">HBB", 0, magic_dtype, ndim) + struct.pack(">" + "I" * array.ndim, *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.tobytes())


def _idx_folder(folder, *, n_train=20, n_test=10, labels=None):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        _write_idx(folder / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 255, (n, 28, 28), dtype=np.uint8))
        y = rng.integers(0, 10, n, dtype=np.uint8) if labels is None else np.full(n, labels, np.uint8)
        _write_idx(folder / f"{prefix}-labels-idx1-ubyte.gz", y)
    return folder


def _train_on(folder, tmp_path):
    config = tiny_config(dataset="fashion_mnist_idx", data_dir=str(folder), batch_size=4, eval_batch_size=4)
    config.limit_train = config.limit_test = None
    return train.train_and_evaluate(config, str(tmp_path / "w"))


def _assert_data_error(folder, tmp_path, error, *words):
    with pytest.raises(error) as info:
        _train_on(folder, tmp_path)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert not (tmp_path / "w").exists()


def test_4_an_empty_dataset(tmp_path):
    folder = _idx_folder(tmp_path / "d", n_train=0, n_test=0)
    _assert_data_error(folder, tmp_path, ValueError, "no training examples", "fashion_mnist_idx")


def test_5_a_missing_data_file(tmp_path):
    folder = _idx_folder(tmp_path / "d")
    (folder / "t10k-labels-idx1-ubyte.gz").unlink()
    _assert_data_error(folder, tmp_path, FileNotFoundError, "t10k-labels-idx1-ubyte")


def test_6_an_idx_file_with_a_bad_magic_number(tmp_path):
    folder = _idx_folder(tmp_path / "d")
    _write_idx(folder / "train-images-idx3-ubyte.gz", np.zeros((20, 28, 28), np.uint8), magic_dtype=0x0D)
    _assert_data_error(folder, tmp_path, ValueError, "train-images-idx3-ubyte")


def test_7_a_truncated_gzip_stream(tmp_path):
    folder = _idx_folder(tmp_path / "d")
    path = folder / "train-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:-40])
    _assert_data_error(folder, tmp_path, ValueError, "train-images-idx3-ubyte", "truncated")


def test_8_a_file_that_is_neither_gzip_nor_idx(tmp_path):
    folder = _idx_folder(tmp_path / "d")
    (folder / "train-labels-idx1-ubyte.gz").write_bytes(b"<html>404 Not Found</html>")
    _assert_data_error(folder, tmp_path, ValueError, "train-labels-idx1-ubyte")


def test_9_labels_outside_the_classes(tmp_path):
    folder = _idx_folder(tmp_path / "d", labels=12)
    _assert_data_error(folder, tmp_path, ValueError, "label", "12")


def test_10_images_and_labels_that_disagree_in_number(tmp_path):
    folder = _idx_folder(tmp_path / "d")
    _write_idx(folder / "train-labels-idx1-ubyte.gz", np.zeros(19, np.uint8))
    _assert_data_error(folder, tmp_path, ValueError, "20", "19")


def test_11_images_of_the_wrong_dtype_or_shape():
    labels = np.zeros(2, np.int32)
    with pytest.raises(ValueError, match="uint8.*float32"):
        data_lib.put_on_device(np.zeros((2, 8, 8, 1), np.float32), labels)
    with pytest.raises(ValueError, match=r"\(N, H, W, C\).*\(2, 8, 8\)"):
        data_lib.put_on_device(np.zeros((2, 8, 8), np.uint8), labels)
    with pytest.raises(ValueError, match=r"labels must be \(2,\)"):
        data_lib.put_on_device(np.zeros((2, 8, 8, 1), np.uint8), np.zeros(3, np.int32))


# ------------------------------------------------------------------ 12-16. models, core, writers


def test_12_model_inputs_of_the_wrong_shape():
    model = models.get_model("naisnet_fc_tiny")
    variables = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((2, 5)))  # shapes only
    with pytest.raises(Exception, match=r"\(7, 6\).*\(5, 6\)") as info:
        jax.eval_shape(model.apply, variables, jnp.zeros((2, 7)))
    assert "flax" in type(info.value).__module__  # Flax names the parameter, before XLA runs


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"h": 1.5}, "h=1.5"),
        ({"h": math.nan}, "h=nan"),
        ({"eps": 0.5}, "eps=0.5"),
        ({"features": 0}, "features=0"),
        ({"steps": 2.5}, "steps=2.5"),
        ({"activation": "swish"}, "swish"),
        ({"eps": -math.inf}, "eps=-inf"),
    ],
)
def test_13_model_hyper_parameters_out_of_range(kwargs, words):
    with pytest.raises(ValueError, match=rf"{words.replace('.', '[.]')}"):
        models.get_model("naisnet_fc_tiny", **kwargs)


def test_13b_conv_model_with_an_even_filter():
    with pytest.raises(ValueError, match="kernel_size=4"):
        models.get_model("naisnet_conv_tiny", kernel_size=4)


def test_14_projection_inputs_of_the_wrong_shape():
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        nj.project_fc(jnp.ones(4), eps=0.1)
    with pytest.raises(ValueError, match=r"delta must have shape \(2,\)"):
        nj.project_conv(jnp.ones((3, 3, 2, 2)), jnp.zeros(3), eps=0.1, eta=0.5)
    with pytest.raises(ValueError, match=r"\(3, 3, 2, 4\)"):
        nj.project_params({"b": {"state_kernel": jnp.ones((3, 3, 2, 4))}}, eps=0.1)
    with pytest.raises(ValueError, match="eta=0.05"):
        nj.stability_projection(eps=0.1, eta=0.05)


def test_15_unroll_settings_out_of_range():
    step = lambda x: 0.5 * x  # noqa: E731
    with pytest.raises(ValueError, match="steps=0"):
        nj.unroll(step, jnp.ones((2, 3)), steps=0)
    with pytest.raises(ValueError, match="tol=nan"):
        nj.unroll_adaptive(step, jnp.ones((2, 3)), tol=math.nan, max_steps=10)
    with pytest.raises(ValueError, match="max_steps=0"):
        nj.unroll_adaptive(step, jnp.ones((2, 3)), tol=1e-3, max_steps=0)


def test_16_a_writer_without_write_scalars(tmp_path):
    with pytest.raises(ValueError, match="write_scalars"):
        train.train_and_evaluate(tiny_config(), str(tmp_path / "w"), writer=print)
    assert not (tmp_path / "w").exists()


# ------------------------------------------------------------------ 17-25. checkpoints and logs


def _refused_resume(workdir, *extra, words=()):
    """A resume that must be refused with exit 2 and one line, leaving every file as it was."""
    before = snapshot(workdir)
    code, err = run_train(TINY_ARGS + [f"--workdir={workdir}", *extra])
    assert code == 2, err
    assert_one_line(err, "error: ", *words)
    assert snapshot(workdir) == before


def test_17_resuming_with_a_checkpoint_of_another_model(workdir):
    _refused_resume(workdir, "--config.model_kwargs.features=4", words=("'features': 8", "'features': 4"))


def test_18_a_truncated_checkpoint(workdir):
    path = _biggest_state_file(workdir)
    os.truncate(path, path.stat().st_size // 2)
    _refused_resume(workdir, words=("corrupt or incomplete",))
    code, err = run_verify(workdir / train.CHECKPOINT_DIR)
    assert code == 2 and "Traceback" not in err and "corrupt" in err


def test_19_a_tampered_checkpoint(workdir):
    # Readable, but not the bytes saved: one byte flipped in the middle of every per-process
    # OCDBT data file. Not only the largest: some of those files are never read by a restore
    # (flipping a byte there loads fine, rightly), and which file is largest varies by run.
    for path in _state_data_files(workdir):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    _refused_resume(workdir, words=("digest", "corrupt"))
    code, err = run_verify(workdir / train.CHECKPOINT_DIR)
    assert code == 2 and "digest" in err


def test_20_a_checkpoint_without_its_metadata(workdir):
    shutil.rmtree(_latest_step_dir(workdir) / "metadata")
    _refused_resume(workdir, words=("metadata",))
    code, err = run_verify(workdir / train.CHECKPOINT_DIR)
    assert code == 2 and "metadata" in err


def test_21_metadata_of_another_format(workdir):
    meta_files = [p for p in (_latest_step_dir(workdir) / "metadata").rglob("*") if p.is_file()]
    (meta_file,) = [p for p in meta_files if b'"format"' in p.read_bytes()]
    meta = json.loads(meta_file.read_text())
    meta["format"] = "somebody-else"
    meta_file.write_text(json.dumps(meta))
    _refused_resume(workdir, words=("not a naisnet-jax checkpoint", "somebody-else"))
    with pytest.raises(ckpt.CheckpointError, match="somebody-else"):
        ckpt.load(str(workdir / train.CHECKPOINT_DIR))


def test_22_a_file_where_the_verifier_wants_a_directory(tmp_path):
    path = tmp_path / "certificate.json"
    path.write_text("{}")
    code, err = run_verify(path)
    assert code == 2 and str(path) in err and "Traceback" not in err
    assert "is a file; expected a checkpoint directory" in err  # named as what it is
    assert path.read_text() == "{}"


def test_23_an_empty_directory_for_the_verifier(tmp_path):
    code, err = run_verify(tmp_path)
    assert code == 2 and "no checkpoint" in err
    assert list(tmp_path.iterdir()) == []


class _Payload:
    """Unpickling this would create the file ``marker``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_24_a_pickle_planted_as_a_checkpoint(tmp_path):
    marker = tmp_path / "unpickled"
    step = tmp_path / "ckpt" / "4"
    for item in ("state", "metadata"):
        (step / item).mkdir(parents=True)
        (step / item / "checkpoint").write_bytes(pickle.dumps(_Payload(marker)))
    code, err = run_verify(tmp_path / "ckpt")
    assert code == 2 and "Traceback" not in err
    with pytest.raises(ckpt.CheckpointError):
        ckpt.load(str(tmp_path / "ckpt"))
    assert not marker.exists()  # nothing was unpickled


def test_25_a_corrupt_metrics_log_on_resume(workdir):
    path = workdir / train.METRICS_FILE
    path.write_text(path.read_text().replace('"epoch": 1', '"epoch": 1,,', 1))
    _refused_resume(workdir, words=(str(path), "line 1"))


# ------------------------------------------------------------------ 26-28. numbers and commands


def test_26_a_learning_rate_that_makes_training_diverge(workdir):
    checkpoints = workdir / train.CHECKPOINT_DIR
    before = snapshot(checkpoints)
    code, err = run_train(TINY_ARGS + [f"--workdir={workdir}", "--config.learning_rate=1e37"])
    assert code == 1
    notice, _, err = err.partition("\n")  # the resume says what it changes first
    assert notice == f"notice: resuming {workdir} with learning_rate 1e+37 (the checkpoint's: 0.1)."
    assert_one_line(err, "error: ", "learning_rate", "epoch 2")
    assert snapshot(checkpoints) == before  # the last good checkpoint, untouched
    assert [json.loads(line)["epoch"] for line in (workdir / train.METRICS_FILE).read_text().splitlines()] == [1]


def test_27_non_finite_parameters_in_a_checkpoint(workdir, tmp_path):
    state, meta = ckpt.load(str(workdir / train.CHECKPOINT_DIR))
    state["params"]["block"]["R"][0, 0] = np.nan
    target = tmp_path / "nan-checkpoint"
    manager = ckpt.manager(str(target))
    ckpt.save(manager, meta["step"], state, ckpt.CheckpointMetadata.from_json(meta))
    manager.close()
    code, err = run_verify(target)
    assert code in (1, 2) and "Traceback" not in err
    assert "block" in err and ("finite" in err or "NaN" in err), err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--config=/nonexistent.py", "--workdir={w}"], ["/nonexistent.py"]),
        (TINY_ARGS + ["--workdir={w}", "--config.learning_rat=0.1"], ["learning_rate"]),
        (TINY_ARGS + ["--workdir={w}", "--config.dataset=mnist", "--config.data_dir={w}-none"], ["mnist"]),
    ],
)
def test_28_bad_command_lines(tmp_path, argv, words):
    w = tmp_path / "w"
    code, err = run_train([a.format(w=w) for a in argv])
    assert code == 2
    assert_one_line(err, "error: ", *words)
    assert not w.exists()


def test_29_model_kwargs_booleans_parse_as_top_level_booleans_do():
    """An untyped ``model_kwargs`` field given ``true`` / ``False`` gets a bool, not the word."""
    for raw, want in (("true", True), ("False", False), ("TRUE", True)):
        _, config = train_cli.parse(TINY_ARGS + ["--workdir=unused", f"--config.model_kwargs.batch_norm={raw}"])
        assert config.model_kwargs.batch_norm is want, raw
    _, config = train_cli.parse(TINY_ARGS + ["--workdir=unused", "--config.model_kwargs.activation=relu"])
    assert config.model_kwargs.activation == "relu"  # a bare word stays a string


def test_30_an_empty_workdir(tmp_path):
    for workdir in ("--workdir=", "--workdir=  "):
        code, err = run_train(TINY_ARGS + [workdir])
        assert code == 2
        assert_one_line(err, "error: ", "--workdir is empty")


def test_31_a_loss_that_grows_by_orders_of_magnitude_is_warned_once(tmp_path):
    """A learning rate of 1e30 keeps the loss finite but drives it up by many orders of
    magnitude over a uniform guess's: one warning line, once, and training goes on."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            train_cli.main(TINY_ARGS + [f"--workdir={tmp_path / 'w'}", "--config.learning_rate=1e30"])
            code = 0
        except SystemExit as e:
            code = e.code
    warnings = [line for line in err.getvalue().splitlines() if "training loss reached" in line]
    assert len(warnings) == 1, err.getvalue()
    assert warnings[0].startswith("warning: ") and "learning_rate" in warnings[0]
    assert code in (0, 1)  # trained on, or stopped as diverged if the loss left the floats
    from naisnet_jax import engine

    growth = engine.LossGrowth(reference=2.3, factor=1e3)
    assert [growth.watch(v) for v in (2.3, 5.0, float("nan"), 2.3e3)] == [None, None, None, None]
    assert growth.watch(2.4e3) is not None and growth.watch(1e9) is None  # once


def test_32_a_workdir_that_cannot_be_written_is_refused_before_training(tmp_path):
    """A workdir under a file, or a file: one line, exit 2, before any data is read (nothing written)."""
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    for target, words in ((a_file / "run", "is a file"), (a_file, "not a directory")):
        code, err = run_train(TINY_ARGS + [f"--workdir={target}"])
        assert code == 2
        assert_one_line(err, "error: ", "--workdir", words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]
    with pytest.raises(ValueError, match="not writable"):  # as a user without the permission sees it
        from naisnet_jax.checks import check_output_dir

        read_only = tmp_path / "read-only"
        read_only.mkdir()
        original = os.access
        try:
            os.access = lambda path, mode: False if str(path) == str(read_only) else original(path, mode)
            check_output_dir("--workdir", str(read_only / "run"))
        finally:
            os.access = original


@pytest.mark.parametrize(
    "flag, target, words",
    [
        ("--json", "{d}", "is a directory"),
        ("--json", "{f}/cert.json", "is a file"),
        ("--figures", "{f}", "not a directory"),
        ("--figures", "{f}/figs", "is a file"),
    ],
)
def test_33_verifier_outputs_are_checked_before_the_audit(workdir, tmp_path, flag, target, words):
    """``--json`` / ``--figures`` that cannot be written: one line, exit 2, before the audit prints
    anything, and nothing left behind (no ``.tmp``)."""
    d, f = tmp_path / "a-dir", tmp_path / "a-file"
    d.mkdir()
    f.write_text("x")
    before = snapshot(tmp_path / "a-dir"), f.read_text()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        with pytest.raises(SystemExit) as e:
            verify_cli.main([str(workdir / train.CHECKPOINT_DIR), "--data=none", f"{flag}={target.format(d=d, f=f)}"])
    assert e.value.code == 2
    assert_one_line(err.getvalue(), "error: ", flag, words)
    assert out.getvalue() == ""  # no verdict printed: the audit never ran
    assert (snapshot(tmp_path / "a-dir"), f.read_text()) == before
    assert not list(tmp_path.rglob("*.tmp"))


def test_34_audit_model_given_no_model_or_non_finite_inputs():
    """``audit_model`` names what it wants: a Flax module (not a string, a dict, a checkpoint path),
    and finite inputs."""
    from naisnet_jax.verify import audit_model

    model = models.get_model("naisnet_fc_tiny")
    x = jnp.ones((4, 8, 8, 1))
    variables = model.init(jax.random.PRNGKey(0), x)
    for wrong in ("runs/demo/checkpoints", {"params": {}}, None):
        with pytest.raises(TypeError, match="expected a Flax Linen module"):
            audit_model(wrong, variables, inputs=x)
    with pytest.raises(ValueError, match="inputs has 1 non-finite"):
        audit_model(model, variables, inputs=x.at[0, 0, 0, 0].set(jnp.inf))


# ------------------------------------------------------------------ 35-39. damaged checkpoints, overflow: commands

BIN = pathlib.Path(sys.executable).parent
NOISE = ("Traceback", "Event loop is closed", "ERROR:absl", "WARNING:absl", "TensorStore")


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("jax-cache")


def command(cache, name, *args) -> tuple[int, str, str]:
    """``naisnet-train`` / ``naisnet-verify`` in a subprocess: ``(exit status, stdout, stderr)``."""
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        JAX_COMPILATION_CACHE_DIR=str(cache),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    done = subprocess.run([str(BIN / name), *map(str, args)], capture_output=True, text=True, env=env, timeout=300)
    return done.returncode, done.stdout, done.stderr


def stderr_lines(err: str, count: int) -> list[str]:
    """The ``count`` lines of ``err``; none of them Orbax's or Python's noise."""
    for noise in NOISE:
        assert noise not in err, err[-3000:]
    lines = err.splitlines()
    assert len(lines) == count, err[-3000:]
    return lines


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A workdir after 2 epochs, a checkpoint after each: steps 4 and 8."""
    workdir = tmp_path_factory.mktemp("two-steps") / "base"
    code, err = run_train(TINY_ARGS + [f"--workdir={workdir}", "--config.checkpoint_every_epochs=1"])
    assert code == 0, err
    assert sorted(p.name for p in (workdir / train.CHECKPOINT_DIR).iterdir()) == ["4", "8"]
    return workdir


@pytest.fixture
def two(two_steps, tmp_path):
    copy = tmp_path / "work"
    shutil.copytree(two_steps, copy)
    return copy


def _array_data_files(step_dir) -> list[pathlib.Path]:
    """As :func:`_state_data_files`, for any step."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    return [p for p in files if p.parent.parent.name.startswith("ocdbt.process")] or files


def _truncate_array_data(step_dir):
    for path in _array_data_files(step_dir):
        os.truncate(path, 10)


def _delete_array_data(step_dir):
    for path in _array_data_files(step_dir):
        path.unlink()


def _garble_metadata(step_dir):
    (step_dir / "metadata" / "metadata").write_bytes(b"garbage{{")


DAMAGE = {
    "truncated arrays": _truncate_array_data,
    "deleted arrays": _delete_array_data,
    "garbage metadata": _garble_metadata,
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_35_a_damaged_newest_checkpoint_gives_way_to_the_newest_intact_one(two, jax_cache, tmp_path, damage):
    """Step 8 damaged, step 4 intact: ``naisnet-verify`` audits step 4 and ``naisnet-train``
    resumes from it, each with one warning line naming the damaged step and a short reason; the
    trainer sets step 8 aside (kept as ``8.damaged``) and saves step 8 again."""
    checkpoints = two / train.CHECKPOINT_DIR
    DAMAGE[damage](checkpoints / "8")
    warning = re.compile(
        rf"warning: checkpoint step 8 in {re.escape(str(checkpoints))} is damaged \((?P<reason>.+)\); using step 4"
    )
    code, out, err = command(jax_cache, "naisnet-verify", checkpoints, "--data=none", f"--json={tmp_path / 'c.json'}")
    assert code == 0, err[-3000:]
    (line,) = stderr_lines(err, 1)
    match = warning.fullmatch(line)
    assert match and len(match["reason"]) <= 2 * ckpt.REASON_CHARS, line
    assert json.loads((tmp_path / "c.json").read_text())["checkpoint"]["step"] == 4
    if damage != "truncated arrays":
        return  # the trainer's fallback is the same code; one damage kind shows it
    code, out, err = command(jax_cache, "naisnet-train", *TINY_ARGS, f"--workdir={two}", "--config.num_epochs=3")
    assert code == 0, err[-3000:]
    (line,) = stderr_lines(err, 1)
    assert line.endswith(f" (set aside as {checkpoints / '8.damaged'})") and warning.match(line), line
    assert f"Resuming from {checkpoints} at epoch 2 (step 4)." in out
    assert sorted(p.name for p in checkpoints.iterdir()) == ["12", "4", "8", "8.damaged"]
    assert [json.loads(r)["epoch"] for r in (two / train.METRICS_FILE).read_text().splitlines()] == [1, 2, 3]
    assert ckpt.load(str(checkpoints))[1]["epoch"] == 3


def test_36_no_intact_checkpoint_is_refused_in_one_line(two, jax_cache):
    checkpoints = two / train.CHECKPOINT_DIR
    _garble_metadata(checkpoints / "8")
    _truncate_array_data(checkpoints / "4")
    before = snapshot(two)
    refusal = re.compile(
        rf"{re.escape(str(checkpoints))} holds no intact checkpoint \(step 8: cannot read the checkpoint metadata "
        r"\(.+\); step 4: the checkpoint's arrays cannot be read \(.+\); it is corrupt or incomplete\); "
        r"restore it from a copy, or use another directory\."
    )
    code, out, err = command(jax_cache, "naisnet-train", *TINY_ARGS, f"--workdir={two}", "--config.num_epochs=3")
    assert code == 2, err[-3000:]
    (line,) = stderr_lines(err, 1)
    assert line.startswith("error: ") and refusal.fullmatch(line[len("error: ") :]), line
    assert snapshot(two) == before  # nothing trained, moved or deleted
    code, out, err = command(jax_cache, "naisnet-verify", checkpoints, "--data=none")
    assert code == 2 and "CERTIFIED" not in out, err[-3000:]
    (line,) = stderr_lines(err, 1)
    prefix = "error: unusable checkpoint: "
    assert line.startswith(prefix) and refusal.fullmatch(line[len(prefix) :]), line
    assert snapshot(two) == before


def test_37_resuming_a_run_of_another_dataset_or_optimiser(two, jax_cache):
    """Said from the checkpoint's metadata, in one line, exit 2, nothing changed; never reported
    as a corrupt checkpoint."""
    for meta_file in (two / train.CHECKPOINT_DIR).glob("*/metadata/metadata"):
        meta = json.loads(meta_file.read_text())
        meta["dataset"] = "fashion_mnist_idx"  # the arrays fit digits: only the metadata can tell
        meta[ckpt.METADATA_DIGEST] = ckpt.metadata_digest(meta)  # as that run would have written it
        meta_file.write_text(json.dumps(meta))
    before = snapshot(two)
    code, out, err = command(jax_cache, "naisnet-train", *TINY_ARGS, f"--workdir={two}", "--config.num_epochs=3")
    assert code == 2, err[-3000:]
    assert stderr_lines(err, 1) == [
        f"error: {two} holds a run that differs from this one (dataset: checkpoint 'fashion_mnist_idx', "
        "now 'digits'): use another workdir, or the checkpoint's settings, to resume."
    ]
    assert snapshot(two) == before
    for meta_file in (two / train.CHECKPOINT_DIR).glob("*/metadata/metadata"):
        meta = json.loads(meta_file.read_text())
        meta["dataset"] = "digits"
        meta[ckpt.METADATA_DIGEST] = ckpt.metadata_digest(meta)
        meta_file.write_text(json.dumps(meta))
    before = snapshot(two)
    code, err = run_train(TINY_ARGS + [f"--workdir={two}", "--config.num_epochs=3", "--config.momentum=0"])
    assert code == 2
    assert_one_line(err, f"error: {two / train.CHECKPOINT_DIR} (step 8): the checkpoint's arrays are not the ones ")
    assert "it also holds opt_state/" in err and err.endswith(
        ": use another workdir, or the checkpoint's config, to resume.\n"
    )
    assert "corrupt" not in err
    assert snapshot(two) == before


def test_38_orbax_log_lines_never_reach_the_user(two, jax_cache):
    """Orbax logs an unreadable or missing ``_CHECKPOINT_METADATA`` (its own bookkeeping; the
    step restores whole) at ERROR and WARNING: neither command shows it, nor anything else."""
    checkpoints = two / train.CHECKPOINT_DIR
    (checkpoints / "8" / "_CHECKPOINT_METADATA").write_bytes(b"\x89 not json")
    (checkpoints / "4" / "_CHECKPOINT_METADATA").unlink()
    code, out, err = command(jax_cache, "naisnet-verify", checkpoints, "--data=none")
    assert code == 0, err[-3000:]
    stderr_lines(err, 0)
    code, out, err = command(jax_cache, "naisnet-train", *TINY_ARGS, f"--workdir={two}", "--config.num_epochs=3")
    assert code == 0 and f"Resuming from {checkpoints} at epoch 3 (step 8)." in out, err[-3000:]
    stderr_lines(err, 0)


def test_39_parameters_that_overflow_float32_are_not_certified_with_the_reason(trained, jax_cache, tmp_path):
    """Finite parameters whose float32 operator overflows (``R^T R`` of an ``R`` of 1e30 is inf):
    the verdict is "not certified", the certificate says why; no exception, nothing on stderr."""
    state, meta = ckpt.load(str(trained / train.CHECKPOINT_DIR))
    state["params"]["block"]["R"][...] = 1e30
    target = tmp_path / "huge"
    manager = ckpt.manager(str(target))
    ckpt.save(manager, meta["step"], state, ckpt.CheckpointMetadata.from_json(meta))
    manager.close()
    code, out, err = command(jax_cache, "naisnet-verify", target, "--data=none", f"--json={tmp_path / 'c.json'}")
    assert code == 1, err[-3000:]
    stderr_lines(err, 0)
    assert "NOT CERTIFIED: not proven stable: block (its float32 operator overflows)  (0/1 blocks;" in out
    (verdict,) = [line for line in out.splitlines() if "CERTIFIED" in line]
    assert verdict.lower().count("not certified") == 1  # the verdict says it once
    (block,) = json.loads((tmp_path / "c.json").read_text())["blocks"]
    assert block["verdict"] == "not proven" and block["certified"] is False
    assert block["reason"].startswith("the float32 operator A has 64 non-finite entries (NaN or inf) out of 64: ")
    assert "the parameters overflow float32 (largest |R| = 1e+30;" in block["reason"]
    assert block["parameter"]["condition1_proven"] is False and block["spectrum"] is None

    from naisnet_jax.verify import Certificate, audit_model

    model = models.get_model("naisnet_fc_tiny")
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 8, 8, 1))
    variables = model.init(jax.random.PRNGKey(1), x)
    R = variables["params"]["block"]["R"]
    assert audit_model(model, variables, inputs=x).certified  # as initialised
    variables["params"]["block"]["R"] = R * 1e20  # finite; R^T R is not
    cert = audit_model(model, variables, inputs=x)
    assert not cert.certified and cert.reason == "not proven stable: block (its float32 operator overflows)"
    (report,) = cert.blocks
    assert not report.certified and "the parameters overflow float32" in report.reason
    assert report.trajectory.skipped == "the float32 operator is not finite"
    assert Certificate.from_json(cert.to_json()).blocks[0].reason == report.reason


# -------------------------------------------------------- 40-48. the demo, ~ in paths, the verifier, projections

QUICK_S = 45  # every subprocess below refuses or audits a tiny model: a hang is a failure


def demo(*args, env=None) -> tuple[int, str, str]:
    """``python -m experiments.demo ARGS`` from the repository root: ``(exit status, stdout, stderr)``.
    The Fashion-MNIST folder points at an empty one, so a demo that is not refused stops at the
    data, in one line, instead of training."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", **(env or {}))
    env.setdefault("NAISNET_FASHION_MNIST_DIR", os.path.join(env.get("HOME", "/nonexistent"), "no-fashion-mnist"))
    done = subprocess.run(
        [sys.executable, "-m", "experiments.demo", *map(str, args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=QUICK_S,
    )
    return done.returncode, done.stdout, done.stderr


def quick(name, *args, env=None, cwd=None) -> tuple[int, str, str]:
    """``naisnet-train`` / ``naisnet-verify`` in a subprocess, with the test session's compilation
    cache and ``QUICK_S`` to finish."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", **(env or {}))
    done = subprocess.run(
        [str(BIN / name), *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True, timeout=QUICK_S
    )
    return done.returncode, done.stdout, done.stderr


def one_error_line(err: str) -> str:
    """The one line of ``err``, which starts ``error: ``; no traceback or absl noise."""
    (line,) = stderr_lines(err, 1)
    assert line.startswith("error: "), line
    return line


def fake_run(workdir: pathlib.Path) -> None:
    """What a finished demo leaves in its workdir (the files' contents do not matter here)."""
    (workdir / "checkpoints" / "4").mkdir(parents=True)
    (workdir / "checkpoints" / "4" / "state").write_text("x")
    for name in ("metrics.jsonl", "scalars.jsonl", "training_curves.png", "per_step_loss.png", "certificate.json"):
        (workdir / name).write_text("x")
    (workdir / "audit").mkdir()
    (workdir / "audit" / "block.png").write_text("x")
    (workdir / engine.LOCK_FILE).write_text("")


def test_40_demo_fresh_deletes_only_a_run_and_refuses_anything_else(tmp_path):
    """``--fresh`` deletes the files a run writes and nothing else: a workdir that also holds an
    unrelated file, or holds no run, is refused in one line, exit 2, with every file kept."""
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home)}
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    fake_run(mixed)
    (mixed / "notes.txt").write_text("mine")
    before = snapshot(mixed)
    code, out, err = demo("--fresh", f"--workdir={mixed}", env=env)
    assert code == 2 and out == "", err
    line = one_error_line(err)
    assert line.startswith(f"error: --fresh: --workdir='{mixed}' holds 'notes.txt', which --fresh does not delete ")
    assert line.endswith("Nothing was deleted: move those away or use another workdir.")
    assert snapshot(mixed) == before

    no_run = tmp_path / "no-run"
    no_run.mkdir()
    (no_run / "training_curves.png").write_text("a figure, but no run")
    code, out, err = demo("--fresh", f"--workdir={no_run}", env=env)
    assert code == 2
    assert one_error_line(err) == (
        f"error: --fresh: --workdir='{no_run}' holds no run (no checkpoints/ or metrics.jsonl), only "
        "training_curves.png. Nothing was deleted: delete them yourself or use another workdir."
    )
    assert (no_run / "training_curves.png").exists()

    run = tmp_path / "run"
    run.mkdir()
    fake_run(run)
    code, out, err = demo("--fresh", f"--workdir={run}", env=env)  # deleted, then stops at the missing data
    assert code == 2 and "Fashion-MNIST file not found" in one_error_line(err), err
    assert sorted(p.name for p in run.iterdir()) == [engine.LOCK_FILE]  # the lock file stays

    for workdir in (tmp_path / "missing", tmp_path / "empty"):  # simply used
        if workdir.name == "empty":
            workdir.mkdir()
        code, out, err = demo("--fresh", f"--workdir={workdir}", env=env)
        assert code == 2 and "Fashion-MNIST file not found" in one_error_line(err), err


def test_41_demo_command_line(tmp_path):
    """The demo's flags get the command line's checks: one ``error:`` line, exit 2, nothing
    written; a path with a space is one path, through ``make demo WORKDIR=...`` too."""
    env = {"HOME": str(tmp_path)}
    for epochs in ("0", "-2"):
        code, out, err = demo(f"--epochs={epochs}", f"--workdir={tmp_path / 'w'}", env=env)
        assert code == 2
        assert one_error_line(err) == f"error: --epochs={epochs} must be a positive integer."
    code, out, err = demo("--epochs=x", env=env)
    assert code == 2
    assert one_error_line(err).startswith("error: flag --epochs=x: invalid literal for int()")
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    code, out, err = demo(f"--workdir={a_file}", env=env)
    assert code == 2
    assert one_error_line(err) == f"error: --workdir='{a_file}' exists and is not a directory."
    assert not (tmp_path / "w").exists() and a_file.read_text() == "x"

    spaced = tmp_path / "my demo"
    spaced.mkdir()
    (spaced / "keep.txt").write_text("x")
    code, out, err = demo("--fresh", f"--workdir={spaced}", env=env)
    assert code == 2 and one_error_line(err).startswith(f"error: --fresh: --workdir='{spaced}' holds 'keep.txt'")

    make = shutil.which("make")
    if make is None:
        pytest.skip("no make here")
    done = subprocess.run(
        [make, "-n", "demo", "WORKDIR=runs/my demo"], cwd=REPO, capture_output=True, text=True, timeout=QUICK_S
    )
    assert done.returncode == 0, done.stderr
    (line,) = [line for line in done.stdout.splitlines() if "experiments.demo" in line]
    assert shlex.split(line)[-3:] == ["-m", "experiments.demo", "--workdir=runs/my demo"], line


def test_42_a_workdir_under_home_is_the_same_path_for_the_checks_and_the_run(tmp_path):
    """``--workdir='~/x'`` (quoted: the shell leaves it) trains in ``$HOME/x``, never in a
    directory named ``~`` under the current one; the demo reads it the same way."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    code, out, err = quick(
        "naisnet-train", *TINY_ARGS, "--config.num_epochs=1", "--workdir=~/x", env={"HOME": str(home)}, cwd=cwd
    )
    assert code == 0, err[-3000:]
    assert sorted(p.name for p in (home / "x").iterdir()) == [
        engine.LOCK_FILE,
        train.CHECKPOINT_DIR,
        train.METRICS_FILE,
        "scalars.jsonl",
    ]
    assert list(cwd.iterdir()) == []  # no ./~/x

    fake_run(home / "mine")
    (home / "mine" / "notes.txt").write_text("x")
    code, out, err = demo("--fresh", "--workdir=~/mine", env={"HOME": str(home)})
    assert code == 2 and one_error_line(err).startswith(
        f"error: --fresh: --workdir='{home / 'mine'}' holds 'notes.txt'"
    )


def test_43_the_verifier_reads_home_in_its_paths(trained, tmp_path):
    """``naisnet-verify '~/ck' --json='~/c.json'`` audits ``$HOME/ck`` and writes ``$HOME/c.json``."""
    home = tmp_path / "home"
    shutil.copytree(trained / train.CHECKPOINT_DIR, home / "ck")
    code, out, err = quick(
        "naisnet-verify", "~/ck", "--data=none", "--json=~/c.json", env={"HOME": str(home)}, cwd=tmp_path
    )
    assert code == 0, err[-3000:]
    stderr_lines(err, 0)
    assert json.loads((home / "c.json").read_text())["checkpoint"]["path"] == str(home / "ck")
    assert f"certificate: {home / 'c.json'}" in out
    assert not (tmp_path / "~").exists()


@pytest.mark.parametrize(
    "args, first_line",
    [
        (
            ["--data=mnistt"],
            "error: --data='mnistt' is not a dataset name; expected 'random', 'none' or one of "
            + ", ".join(data_lib.DATASET_NAMES)
            + ".",
        ),
        (["--samples=0"], "error: --samples=0 must be a positive integer."),
        (["--no-such-flag"], "error: unrecognized arguments: --no-such-flag (see naisnet-verify --help)"),
        (["--json={d}"], "error: --json='{d}' is a directory; expected a file name."),
        (
            ["--data=none", "--json=/sys/x.json"],
            "error: --json='/sys/x.json': /sys is not writable, so the file cannot be created there.",
        ),
        (
            ["--data=none", "--json=/sys/no-such-dir/x.json"],
            "error: --json='/sys/no-such-dir/x.json': /sys is not writable, so the file cannot be created there.",
        ),
        (
            ["--data=none", "--figures=/sys/figures"],
            "error: --figures='/sys/figures': /sys is not writable, so the directory cannot be created there.",
        ),
    ],
)
def test_44_every_refusal_of_the_verifier_is_one_error_line_before_the_audit(trained, tmp_path, args, first_line):
    """Bad options and outputs that cannot be written: ``error: ...``, exit 2, no verdict, nothing
    written (exit 1 means "not certified" and nothing else)."""
    if any("/sys" in a for a in args) and not os.path.isdir("/sys"):
        pytest.skip("no /sys here (sysfs refuses new files, to root too)")
    d = tmp_path / "a-dir"
    d.mkdir()
    args = [a.format(d=d) for a in args]
    code, out, err = quick("naisnet-verify", trained / train.CHECKPOINT_DIR, *args)
    assert (code, one_error_line(err)) == (2, first_line.format(d=d))
    assert out == "" and list(d.iterdir()) == []


def test_45_the_verifier_names_unusable_input_as_error_lines(trained, tmp_path):
    """A missing checkpoint, data that cannot be read or does not fit the model: ``error:`` lines
    too, each saying what is wrong (a --data whose images the model cannot take is not an
    unusable checkpoint)."""
    code, out, err = quick("naisnet-verify", tmp_path / "nothing", "--data=none")
    assert (code, one_error_line(err)) == (
        2,
        f"error: unusable checkpoint: {tmp_path / 'nothing'}: no such checkpoint directory.",
    )
    code, out, err = quick(
        "naisnet-verify",
        trained / train.CHECKPOINT_DIR,
        "--data=mnist_pinned",
        env={"NAISNET_MNIST_DIR": str(tmp_path)},
    )
    assert code == 2 and out == ""
    line = one_error_line(err)
    assert line.startswith("error: cannot read --data=mnist_pinned (MNIST file not found: ")
    assert line.endswith("; pass --data=random or --data=none")
    folder = _idx_folder(tmp_path / "fashion")  # 28 x 28 images for a model of 8 x 8 digits
    code, out, err = quick(
        "naisnet-verify", trained / train.CHECKPOINT_DIR, "--data=fashion_mnist_idx", f"--data-dir={folder}"
    )
    assert (code, out, one_error_line(err)) == (
        2,
        "",
        "error: --data=fashion_mnist_idx: its images have shape (28, 28, 1), but the checkpoint's model "
        "(naisnet_mnist, trained on 'digits') takes inputs of shape (8, 8, 1); pass --data=random or --data=none",
    )


def test_46_the_verifier_given_a_run_workdir_audits_its_checkpoints(trained, tmp_path):
    """A workdir instead of its ``checkpoints/``: audited, with one line on stderr saying so."""
    code, out, err = quick("naisnet-verify", trained, "--data=none", f"--json={tmp_path / 'c.json'}")
    assert code == 0, err[-3000:]
    assert stderr_lines(err, 1) == [
        f"note: {trained} is a run's workdir; auditing its checkpoints in {trained / train.CHECKPOINT_DIR}"
    ]
    assert json.loads((tmp_path / "c.json").read_text())["checkpoint"]["path"] == str(trained / train.CHECKPOINT_DIR)
    assert "CERTIFIED: every block certified stable" in out


def test_47_audit_model_given_an_empty_batch():
    """``audit_model`` given an empty batch says so (it divided by zero)."""
    from naisnet_jax.verify import audit_model

    model = models.get_model("naisnet_fc_tiny")
    variables = model.init(jax.random.PRNGKey(0), jnp.ones((4, 8, 8, 1)))
    with pytest.raises(ValueError) as e:
        audit_model(model, variables, inputs=jnp.ones((0, 8, 8, 1)))
    assert str(e.value) == (
        "inputs has shape (0, 8, 8, 1): no input to unroll; expected a batch of at least one input (shape "
        "(n, ...), n >= 1), or inputs=None with options.input_shape for the parameter-level audit only."
    )


def test_48_a_projection_with_no_block_to_project():
    """``stability_projection`` initialised on parameters without a NAIS block warns once, and not
    when told that is meant (``expect_blocks=False``) or when there is a block."""
    plain = {"dense": {"kernel": jnp.ones((3, 3)), "bias": jnp.zeros(3)}}
    tx = optax.chain(optax.sgd(0.1), nj.stability_projection(eps=0.1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tx.init(plain)
    assert [(w.category, str(w.message)) for w in caught] == [
        (
            nj.NoNaisBlockWarning,
            "stability_projection: the parameters hold no NAIS block (no leaf named 'R' or 'state_kernel'), so "
            "it projects nothing; pass expect_blocks=False if that is meant (a baseline without the stable "
            "parametrisation).",
        )
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nj.stability_projection(eps=0.1, expect_blocks=False).init(plain)
        nj.stability_projection(eps=0.1).init({"block": {"R": jnp.eye(3)}})


def test_48b_the_trainer_projects_a_baseline_without_a_warning():
    """The trainer's optimiser ends with the projection for every model; on a ResNet baseline it
    has nothing to project, which is meant, so its state is made without a warning."""
    config = tiny_config()
    config.model = "resnet"
    config.model_kwargs = ml_collections.ConfigDict({"features": 8, "depth": 3})
    net = train.build_model(config, 10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = train.create_train_state(config, net, (8, 8, 1), steps_per_epoch=4)
    assert "W" in state.params and "R" not in state.params


def test_49_a_checkpoints_path_that_is_a_file(jax_cache, tmp_path):
    """Refused before training, in one line, exit 2; nothing else is written (it used to sit for
    minutes in Orbax's writer threads)."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / train.CHECKPOINT_DIR).write_text("not a directory")
    start = time.time()
    code, out, err = command(jax_cache, "naisnet-train", *TINY_ARGS, f"--workdir={workdir}")
    assert code == 2, err[-3000:]
    assert stderr_lines(err, 1) == [
        f"error: cannot write checkpoints to {workdir / train.CHECKPOINT_DIR}: it is a file, not a directory."
    ]
    assert time.time() - start < 60
    assert sorted(p.name for p in workdir.iterdir()) == [".trainer.lock", train.CHECKPOINT_DIR]


@pytest.mark.parametrize(
    "command, words",
    [
        (["experiments.conv", "--variants=naisnet3"], "--variants has unknown names ['naisnet3']; valid: ['resnet',"),
        (["experiments.conv", "--smoke", "--seeds_at_once=0"], "--seeds_at_once=0 must be a positive integer."),
        (["experiments.conv", "--epochs=0"], "--epochs=0 must be a positive integer."),
        (["experiments.ablation", "--hs=1,1/0"], "--hs has '1/0'; expected a step size above 0"),
        (["experiments.tuned", "--models=resnett"], "--models has unknown names ['resnett']; valid: ['naisnet_mnist',"),
        (["experiments.fc_spectrum", "--drive_probe", "--probe_eps=x"], "--probe_eps has 'x'; expected a number in"),
        (["experiments.signal", "--variants=nais2"], "--variants ['nais2'] unknown; choose from ['nais10',"),
        (["experiments.depth", "--datasets=cifar10"], "--datasets has unknown names ['cifar10']; valid:"),
        (["experiments.depth", "--epochs=0"], "--epochs=0 must be a positive integer."),
    ],
    ids=lambda v: v[0] if isinstance(v, list) else None,
)
def test_50_an_experiment_refuses_bad_flags_in_one_line_and_leaves_nothing(tmp_path, command, words):
    """Every experiment command ends on a bad flag as naisnet-train does: ``error: ...`` in one
    line (not absl's page of usage) and nothing said before it, exit status 2, and no workdir or
    compilation cache left behind; a workdir that was there before stays."""
    for workdir in (tmp_path / "new" / "run", tmp_path):
        done = subprocess.run(
            [sys.executable, "-m", *command, f"--workdir={workdir}"],
            cwd=REPO,
            env=dict(os.environ, JAX_PLATFORMS="cpu"),
            capture_output=True,
            text=True,
            timeout=QUICK_S,
        )
        assert done.returncode == 2, done.stderr[-3000:]
        assert one_error_line(done.stderr).startswith(f"error: {words}"), done.stderr
        assert done.stdout == "", done.stdout
    assert not (tmp_path / "new").exists() and list(tmp_path.iterdir()) == []
