"""Metric writers: the JSONL writer appends (and only rewrites to drop what a resumed run
repeats), TensorBoard event files read back with a plain TFRecord reader, and
``train_and_evaluate(writer=...)`` sends the documented scalars to any object with
``write_scalars``."""

from __future__ import annotations

import json
import os
import struct
import sys

import numpy as np
import pytest

from naisnet_jax import metric_writers as mw
from naisnet_jax import train
from naisnet_jax.configs import default


class Recorder:
    """The smallest writer: remembers every call."""

    def __init__(self):
        self.calls = []

    def write_scalars(self, step, scalars):
        self.calls.append((step, dict(scalars)))


def tiny_config(**overrides):
    """Digits, 256 train / 100 test, batch 64 (4 steps an epoch, chunks of 3 and 1), an 8-unit block."""
    config = default.get_config()
    config.dataset = "digits"
    config.model_kwargs.features = 8
    config.model_kwargs.steps = 3
    config.limit_train, config.limit_test = 256, 100
    config.batch_size, config.eval_batch_size = 64, 64
    config.steps_per_chunk = 3
    config.num_epochs = 2
    config.h, config.learning_rate = 0.5, 0.05
    config.lr_boundaries_epochs = [1]  # steps 5.. run at learning_rate * lr_decay_factor
    config.progress = False
    for key, value in overrides.items():
        config[key] = value
    return config


# ----------------------------------------------------------------- JSONL


def test_jsonl_writer_appends_and_writes_strict_json(tmp_path):
    path = tmp_path / "s.jsonl"
    w = mw.JsonlWriter(path)
    w.write_scalars(1, {"a": 1.5, "b": float("nan"), "n": 3})
    w.close()
    before, inode = path.read_bytes(), os.stat(path).st_ino
    w = mw.JsonlWriter(path)
    w.write_scalars(2, {"a": np.float32(2.0), "c": float("inf")})
    w.close()
    assert path.read_bytes().startswith(before) and os.stat(path).st_ino == inode
    assert mw.read_jsonl(path) == [{"step": 1, "a": 1.5, "b": None, "n": 3}, {"step": 2, "a": 2.0, "c": None}]
    with pytest.raises(ValueError, match="'x'"):
        w.write_scalars(3, {"x": "text"})


def test_truncate_after_drops_later_steps_and_a_cut_line_and_otherwise_leaves_the_file(tmp_path):
    path = tmp_path / "s.jsonl"
    w = mw.JsonlWriter(path)
    for step in (1, 2, 3):
        w.write_scalars(step, {"v": step})
    w.close()
    inode = os.stat(path).st_ino
    w.truncate_after(3)  # nothing to drop: the very same file
    assert os.stat(path).st_ino == inode and len(mw.read_jsonl(path)) == 3
    with open(path, "a") as f:
        f.write('{"step": 4, "v"')  # a line cut short by a crash
    assert [r["step"] for r in mw.read_jsonl(path)] == [1, 2, 3]  # the cut line is not a record
    w.truncate_after(2)
    assert path.read_text() == '{"step": 1, "v": 1}\n{"step": 2, "v": 2}\n'
    assert not (tmp_path / "s.jsonl.tmp").exists()


def test_a_corrupt_line_inside_the_file_is_an_error_naming_file_and_line(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"s\.jsonl, line 2"):
        mw.read_jsonl(path)


# ----------------------------------------------------------------- TensorBoard


def read_tensorboard_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files of ``logdir``, by tag: ``[(step, value), ...]``.

    TFRecord framing read by hand (length, its CRC, payload, its CRC); the payload is an
    ``Event`` protocol buffer."""
    from tensorboardX.proto import event_pb2

    out: dict[str, list] = {}
    for name in sorted(os.listdir(logdir)):
        data = open(os.path.join(logdir, name), "rb").read()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_tensorboard_writer_writes_event_files_without_tensorflow(tmp_path):
    pytest.importorskip("tensorboardX")  # the [tensorboard] extra; the test extra installs it
    logdir = tmp_path / "tb"
    w = mw.TensorBoardWriter(logdir)
    assert not logdir.exists()  # nothing until the first write
    w.write_scalars(3, {"train/loss": 0.5, "rho_max": float("nan")})
    w.write_scalars(7, {"train/loss": 0.25})
    w.close()
    assert read_tensorboard_scalars(logdir) == {"train/loss": [(3, 0.5), (7, 0.25)]}
    assert "tensorflow" not in sys.modules


def test_tensorboard_writer_without_tensorboardx_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    with pytest.raises(ImportError, match=r"naisnet-jax\[tensorboard\]"):
        mw.TensorBoardWriter("unused")


def test_a_writer_without_write_scalars_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="write_scalars"):
        train.train_and_evaluate(tiny_config(), str(tmp_path / "w"), writer=object())
    assert not (tmp_path / "w").exists()


# ----------------------------------------------------------------- train_and_evaluate


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Epoch 1 with the default writer; epoch 2, resumed, with a Recorder and TensorBoard."""
    workdir = tmp_path_factory.mktemp("writers")
    train.train_and_evaluate(tiny_config(), str(workdir), stop_after_epochs=1)
    metrics_path = workdir / train.METRICS_FILE
    after_one = (metrics_path.read_bytes(), os.stat(metrics_path).st_ino)
    recorder = Recorder()
    writers = [recorder]
    if _has_tensorboardx():
        writers.append(mw.TensorBoardWriter(workdir / "tb"))
    train.train_and_evaluate(tiny_config(), str(workdir), writer=mw.MultiWriter(writers))
    for w in writers[1:]:
        w.close()
    epoch_one = [(r.pop("step"), r) for r in mw.read_jsonl(workdir / mw.SCALARS_FILE)]
    return workdir, after_one, epoch_one + recorder.calls


def _has_tensorboardx():
    try:
        import tensorboardX  # noqa: F401
    except ImportError:
        return False
    return True


def test_metrics_jsonl_is_appended_not_rewritten(two_runs):
    workdir, (bytes_one, inode_one), _ = two_runs
    path = workdir / train.METRICS_FILE
    assert os.stat(path).st_ino == inode_one and path.read_bytes().startswith(bytes_one)
    assert [r["epoch"] for r in mw.read_jsonl(path)] == [1, 2]


def test_the_writer_gets_chunk_scalars_and_epoch_records(two_runs):
    workdir, _, calls = two_runs
    config = tiny_config()
    chunks = [(s, c) for s, c in calls if "train/loss" in c]
    epochs = [(s, c) for s, c in calls if "epoch/epoch" in c]
    assert [s for s, _ in chunks] == [3, 4, 7, 8]  # chunks of 3 and 1 steps, two epochs
    for step, c in chunks:
        assert set(c) == {"train/loss", "train/accuracy", "train/learning_rate", "train/steps_per_second"}
        decayed = step - 1 >= 4  # lr_boundaries_epochs = [1], 4 steps an epoch
        expected = config.learning_rate * (config.lr_decay_factor if decayed else 1.0)
        assert c["train/learning_rate"] == pytest.approx(expected, rel=1e-6)
        assert np.isfinite(c["train/steps_per_second"]) and c["train/steps_per_second"] > 0
    records = mw.read_jsonl(workdir / train.METRICS_FILE)
    assert [s for s, _ in epochs] == [r["step"] for r in records] == [4, 8]
    for (_, e), record in zip(epochs, records):
        for key in ("test_loss", "test_accuracy", "train_accuracy", "rho_max", "generalisation_gap"):
            assert e[f"epoch/{key}"] == pytest.approx(record[key], rel=1e-12)
    # the epoch's train loss is the mean of its chunks' losses, weighted by their steps
    for epoch, record in enumerate(records):
        (_, first), (_, second) = chunks[2 * epoch : 2 * epoch + 2]
        weighted = (3 * first["train/loss"] + 1 * second["train/loss"]) / 4
        assert record["train_loss"] == pytest.approx(weighted, rel=1e-6)


def test_tensorboard_events_match_the_recorded_scalars(two_runs):
    pytest.importorskip("tensorboardX")
    workdir, _, calls = two_runs
    events = read_tensorboard_scalars(workdir / "tb")
    epoch_two = [(s, c) for s, c in calls if s > 4]
    assert events["train/loss"] == [
        (s, pytest.approx(c["train/loss"], rel=1e-6)) for s, c in epoch_two if "train/loss" in c
    ]
    assert events["epoch/test_accuracy"] == [(8, pytest.approx(epoch_two[-1][1]["epoch/test_accuracy"], rel=1e-6))]


def test_the_default_writer_is_scalars_jsonl_in_the_workdir(two_runs):
    workdir, _, calls = two_runs
    lines = (workdir / mw.SCALARS_FILE).read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [3, 4, 4]  # epoch 1 only: epoch 2 had its own writer
