"""The run protocol at its edges: what a workdir may hold when a run starts or resumes, and what a
resume may change. Each case either continues the run exactly or stops in one line that names what
is wrong, and nothing already written is lost."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from naisnet_jax import checkpoint as ckpt
from naisnet_jax import engine, train
from naisnet_jax import metric_writers as mw
from tests.test_train import get_config


def _train(workdir, **overrides):
    return train.train_and_evaluate(get_config(**overrides), str(workdir))


def _steps(workdir) -> list[int]:
    return sorted(int(n) for n in os.listdir(workdir / train.CHECKPOINT_DIR) if n.isdigit())


def _epochs(workdir) -> list[int]:
    return [r["epoch"] for r in engine.read_metrics(workdir / train.METRICS_FILE)]


@pytest.fixture(scope="module")
def two_epochs(tmp_path_factory):
    """A finished run of 2 epochs at batch 64 (4 steps an epoch: checkpoints 4 and 8)."""
    workdir = tmp_path_factory.mktemp("edges") / "run"
    _train(workdir)
    assert _steps(workdir) == [4, 8]
    return workdir


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns(engine.LOCK_FILE))
    return dst


def test_a_resume_with_a_larger_batch_keeps_the_checkpoint_keys_growing(two_epochs, tmp_path, capsys):
    """Batch 64 -> 128 halves the steps of an epoch; epoch 3's checkpoint is step 8 + 2 = 10, not
    3 x 2 = 6, so the next resume starts from epoch 3, not from epoch 2's step 8 again."""
    workdir = _copy(two_epochs, tmp_path / "run")
    _train(workdir, num_epochs=3, batch_size=128)
    assert "notice: resuming" in capsys.readouterr().err
    assert _steps(workdir) == [4, 8, 10]
    result = _train(workdir, num_epochs=4, batch_size=128)
    assert "at epoch 4 (step 10)" in capsys.readouterr().out
    assert _steps(workdir) == [8, 10, 12]  # keep_checkpoints=3
    assert _epochs(workdir) == [1, 2, 3, 4] and result["epoch"] == 4
    _, meta = ckpt.load(str(workdir / train.CHECKPOINT_DIR))
    assert (meta["step"], meta["epoch"]) == (12, 4)


def test_keys_stay_epoch_times_steps_while_the_batch_stays(two_epochs, tmp_path):
    workdir = _copy(two_epochs, tmp_path / "run")
    _train(workdir, num_epochs=3)
    assert _steps(workdir) == [4, 8, 12]


def test_a_resume_that_changes_the_projection_bound_is_refused(two_epochs, tmp_path):
    workdir = _copy(two_epochs, tmp_path / "run")
    with pytest.raises(ValueError, match=r"differs from this one \(relaxed: checkpoint False, now True\)"):
        _train(workdir, num_epochs=3, relaxed=True)
    assert _steps(workdir) == [4, 8] and _epochs(workdir) == [1, 2]


def test_a_resume_that_changes_the_flip_is_said(two_epochs, tmp_path, capsys):
    workdir = _copy(two_epochs, tmp_path / "run")
    _train(workdir, num_epochs=3, augment=True, augment_flip=False)
    err = capsys.readouterr().err
    assert "notice: resuming" in err and "augment_flip False (the checkpoint's: True)" in err


@pytest.mark.parametrize(
    "line, what",
    [
        ('{"foo": 1}', '{"foo": 1}'),
        ("[1, 2]", "[1, 2]"),
        ('{"epoch": "x"}', '{"epoch": "x"}'),
        ('{"epoch": 0}', '{"epoch": 0}'),
    ],
    ids=["no-epoch", "a-list", "a-string-epoch", "epoch-0"],
)
def test_a_log_line_that_is_json_but_no_epoch_record_is_refused_by_file_and_record(two_epochs, tmp_path, line, what):
    workdir = _copy(two_epochs, tmp_path / "run")
    log = workdir / train.METRICS_FILE
    before = log.read_text() + line + "\n"
    log.write_text(before)
    with pytest.raises(ValueError) as info:
        _train(workdir, num_epochs=3)
    message = str(info.value)
    assert message.startswith(f"{log}, record 3: {what} is not an epoch record") and "\n" not in message
    assert log.read_text() == before and _steps(workdir) == [4, 8]


def test_a_sweep_log_record_needs_its_seed(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"epoch": 1, "seed": 0}\n{"epoch": 1}\n')
    assert engine.read_metrics(log) == [{"epoch": 1, "seed": 0}, {"epoch": 1}]
    with pytest.raises(ValueError, match=r"record 2: \{\"epoch\": 1\} is not an epoch record .*a whole 'seed' >= 0"):
        engine.read_metrics(log, ("epoch", "seed"))


def test_a_single_run_refuses_a_sweeps_workdir_and_a_sweep_a_single_runs(two_epochs, tmp_path):
    sweep_dir = tmp_path / "sweep"
    (sweep_dir / engine.SWEEP_CHECKPOINT_DIR / "10").mkdir(parents=True)
    (sweep_dir / train.METRICS_FILE).write_text('{"epoch": 1, "seed": 0}\n')
    with pytest.raises(ValueError, match=r"holds a sweep of seeds \(.*sweep_checkpoints\).*use another workdir"):
        _train(sweep_dir)
    assert (sweep_dir / train.METRICS_FILE).read_text() == '{"epoch": 1, "seed": 0}\n'
    assert not (sweep_dir / train.CHECKPOINT_DIR).exists()

    view = engine.resume_view(get_config(), {}, [0, 1])
    with pytest.raises(ValueError, match=r"holds a single run \(.*checkpoints\)"):
        with engine.RunDirectory(str(two_epochs), view, checkpoints=engine.SWEEP_CHECKPOINT_DIR):
            pass
    assert not (two_epochs / engine.SWEEP_CHECKPOINT_DIR).exists()


def test_a_file_where_a_step_would_be_saved_is_refused_not_written_over(two_epochs, tmp_path):
    workdir = _copy(two_epochs, tmp_path / "run")
    step = workdir / train.CHECKPOINT_DIR / "12"
    step.write_text("notes\n")
    with pytest.raises(ckpt.CheckpointWriteError, match=r"12 is not a checkpoint directory but sits where step 12"):
        _train(workdir, num_epochs=3)
    assert step.read_text() == "notes\n" and _epochs(workdir) == [1, 2]


def test_a_failed_log_rewrite_leaves_the_log_and_no_temporary_file(two_epochs, tmp_path, monkeypatch):
    """A full disk while the resume rewinds the log (a crash left epoch 3's record after the
    checkpoint of epoch 2): one line, the log as it was, no ``metrics.jsonl.tmp``."""
    workdir = _copy(two_epochs, tmp_path / "run")
    log = workdir / train.METRICS_FILE
    records = engine.read_metrics(log)
    before = log.read_text() + json.dumps(dict(records[-1], epoch=3)) + "\n"
    log.write_text(before)

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(mw.os, "fsync", full)
    with pytest.raises(engine.RunWriteError) as info:
        _train(workdir, num_epochs=3)
    assert str(info.value).startswith(f"cannot write the metrics log {log} (epoch 2): No space left on device;")
    assert log.read_text() == before and not os.path.exists(f"{log}.tmp")
    monkeypatch.undo()
    _train(workdir, num_epochs=3)  # the same command, once the disk has room
    assert _epochs(workdir) == [1, 2, 3]


def test_write_jsonl_removes_its_temporary_file_when_the_write_fails(tmp_path, monkeypatch):
    path = tmp_path / "log.jsonl"
    mw.write_jsonl(path, [{"a": 1}])

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(mw.os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        mw.write_jsonl(path, [{"a": 2}])
    assert mw.read_jsonl(path) == [{"a": 1}] and sorted(os.listdir(tmp_path)) == ["log.jsonl"]


def _cli(workdir, *flags):
    command = [sys.executable, "-m", "naisnet_jax.train_cli", "--config=digits_tiny", f"--workdir={workdir}"]
    flags = [
        "--config.limit_train=256",
        "--config.limit_test=100",
        "--config.batch_size=64",
        "--config.eval_batch_size=64",
        "--config.model_kwargs.features=8",
        "--config.model_kwargs.steps=3",
        "--config.progress=false",
        *flags,
    ]
    return subprocess.run([*command, *flags], capture_output=True, text=True, timeout=300)


def test_the_command_on_a_complete_run_without_its_log_and_on_a_log_that_is_a_directory(two_epochs, tmp_path):
    gone = _copy(two_epochs, tmp_path / "gone")
    (gone / train.METRICS_FILE).unlink()
    done = _cli(gone, "--config.num_epochs=2")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "nothing left to train" in done.stdout and "holds no epoch record" in done.stdout
    assert "Traceback" not in done.stderr and _steps(gone) == [4, 8]

    odd = _copy(two_epochs, tmp_path / "odd")
    (odd / train.METRICS_FILE).unlink()
    (odd / train.METRICS_FILE).mkdir()
    done = _cli(odd, "--config.num_epochs=3")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: ") and "Is a directory" in line and str(odd / train.METRICS_FILE) in line
    assert _steps(odd) == [4, 8]
    np.testing.assert_equal(sorted(os.listdir(odd / train.METRICS_FILE)), [])


@pytest.mark.parametrize("text, match", [('{"row": {"a"', "is not a readable summary"), ("[]", "holds no summary row")])
def test_a_summary_that_is_no_summary_is_an_error_naming_it(tmp_path, text, match):
    from experiments import sweep_report

    path = tmp_path / "summary.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as info:
        sweep_report.read_summary(str(path), get_config())
    assert str(info.value).startswith(str(path)) and path.read_text() == text


def _metadata_file(workdir, step):
    return workdir / train.CHECKPOINT_DIR / str(step) / "metadata" / "metadata"


def test_a_changed_byte_in_the_metadata_makes_the_step_damaged(two_epochs, tmp_path, capsys):
    """Epoch 2 -> 3 in step 8's metadata: without the metadata's digest the run would resume at
    epoch 4 and skip one; with it, step 8 is set aside and the run resumes from step 4."""
    workdir = _copy(two_epochs, tmp_path / "run")
    path = _metadata_file(workdir, 8)
    meta = json.loads(path.read_text())
    assert meta[ckpt.METADATA_DIGEST] == ckpt.metadata_digest(meta) and meta["epoch"] == 2
    path.write_text(path.read_text().replace('"epoch": 2', '"epoch": 3'))
    _train(workdir, num_epochs=3)
    err = capsys.readouterr().err
    assert "step 8" in err and "the metadata does not match the digest recorded" in err and "using step 4" in err
    assert _epochs(workdir) == [1, 2, 3] and _steps(workdir) == [4, 8, 12]
    assert (workdir / train.CHECKPOINT_DIR / "8.damaged").is_dir()


def test_a_checkpoint_written_before_the_metadata_digest_still_loads(two_epochs, tmp_path):
    workdir = _copy(two_epochs, tmp_path / "run")
    path = _metadata_file(workdir, 8)
    meta = json.loads(path.read_text())
    del meta[ckpt.METADATA_DIGEST]
    path.write_text(json.dumps(meta))
    _, loaded = ckpt.load(str(workdir / train.CHECKPOINT_DIR))
    assert loaded["step"] == 8 and ckpt.METADATA_DIGEST not in loaded
    _train(workdir, num_epochs=3)
    assert _epochs(workdir) == [1, 2, 3] and _steps(workdir) == [4, 8, 12]


def test_naisnet_train_says_it_trains_one_seed_of_a_sweeps_config(tmp_path):
    done = _cli(tmp_path / "run", "--config.num_epochs=1", "--config.num_seeds=3", "--config.seed=2")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.splitlines() == [
        "note: config.num_seeds=3 is read by sweeps (naisnet_jax.sweep.train_sweep, the experiments); "
        "naisnet-train trains one seed, config.seed=2."
    ]
    assert _epochs(tmp_path / "run") == [1]
