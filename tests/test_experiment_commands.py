"""The experiments' commands on bad input end as ``naisnet-train`` does: one ``error:`` line on
stderr, exit status 2, no traceback, whatever the mistake (a flag absl refuses, a missing dataset,
a workdir that is a file)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def _run(*args, env=None):
    done = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})},
        timeout=300,
    )
    return done.returncode, done.stdout, done.stderr


def _one_error_line(code, err) -> str:
    assert code == 2 and "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if not line.startswith("WARNING:absl")]
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    return lines[0]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--bogus"], "error: Unknown command line flag 'bogus' (see python -m experiments.conv --help)"),
        (["--seeds=abc"], "error: flag --seeds=abc: invalid literal for int() with base 10: 'abc'"),
    ],
    ids=["unknown-flag", "bad-value"],
)
def test_a_flag_absl_refuses_is_one_line_and_status_2(args, expected):
    line = _one_error_line(*_run("-m", "experiments.conv", *args)[::2])
    assert line.startswith(expected)


def test_a_missing_dataset_is_one_line(tmp_path):
    workdir = tmp_path / "conv"
    code, _, err = _run(
        "-m",
        "experiments.conv",
        "--datasets=fashion_mnist_idx",
        "--variants=resnet",
        f"--workdir={workdir}",
        env={"NAISNET_FASHION_MNIST_DIR": str(tmp_path / "nowhere")},
    )
    line = _one_error_line(code, err)
    assert str(tmp_path / "nowhere") in line


@pytest.mark.parametrize(
    "command", [["experiments.one_d"], ["experiments.signal", "--smoke", "--variants=nais1"], ["experiments.conv"]]
)
def test_a_workdir_that_is_a_file_is_one_line_before_any_work(tmp_path, command):
    """Named as the flag, before anything is trained (signal found it when it wrote its first
    record, after the training; the others said only 'File exists')."""
    afile = tmp_path / "afile"
    afile.write_text("notes\n")
    line = _one_error_line(*_run("-m", *command, f"--workdir={afile}")[::2])
    assert line == f"error: --workdir='{afile}' exists and is not a directory."
    assert afile.read_text() == "notes\n"


def test_a_signal_report_without_records_is_one_line(tmp_path):
    workdir = tmp_path / "signal"
    line = _one_error_line(*_run("-m", "experiments.signal", "--report", f"--workdir={workdir}")[::2])
    assert line == f"error: no variant results in '{workdir}'; run the experiment first."


def test_default_accuracy_refuses_zero_seeds_before_writing(tmp_path):
    out = tmp_path / "acc"
    line = _one_error_line(*_run("-m", "experiments.default_accuracy", "--seeds=0", f"--out={out}")[::2])
    assert line == "error: --seeds=0 must be a positive integer." and not out.exists()


def test_the_manifest_command_takes_no_arguments():
    code, _, err = _run("-m", "experiments.sweep_report", "--bogus")
    assert code == 2 and "unrecognized arguments: --bogus" in err and "Traceback" not in err
    code, out, _ = _run("-m", "experiments.sweep_report", "--help")
    assert code == 0 and "tree_manifest" in out


def test_naisnet_verify_takes_naisnet_trains_spelling_of_the_cache_flag(tmp_path):
    missing = tmp_path / "missing"
    verify = str(pathlib.Path(sys.executable).parent / "naisnet-verify")
    done = subprocess.run(
        [verify, str(missing), "--compilation_cache=none"], capture_output=True, text=True, timeout=300
    )
    line = _one_error_line(done.returncode, done.stderr)
    assert str(missing) in line and "unrecognized" not in line


def test_the_cifar_config_says_what_its_argument_should_be():
    from naisnet_jax.configs import cifar_paper

    with pytest.raises(ValueError, match=r"cifar_paper config argument 'bogus': expected 'DATASET,MODEL'"):
        cifar_paper.get_config("bogus")


@pytest.mark.parametrize(
    "flag, expected",
    [
        ("--hs=2", "error: --hs=2.0 is outside (0, 1]"),
        ("--hs=1,2", "error: --hs=2.0 is outside (0, 1]"),  # before h = 1 trains
        ("--h=2", "error: --h=2.0 is outside (0, 1]"),
        ("--epochs=0", "error: --epochs=0 must be a positive integer."),
        ("--time_steps=-1", "error: --time_steps=-1 must be a positive integer."),
    ],
    ids=["h-above-1", "one-of-two-h-above-1", "h-flag-above-1", "no-epochs", "negative-time-steps"],
)
def test_a_bad_ablation_value_writes_nothing(tmp_path, flag, expected):
    workdir = tmp_path / "ablation"
    line = _one_error_line(*_run("-m", "experiments.ablation", "--smoke", flag, f"--workdir={workdir}")[::2])
    assert line.startswith(expected) and not workdir.exists()


def test_a_compilation_cache_the_user_named_but_cannot_use_is_said_in_one_line(tmp_path, capsys):
    from naisnet_jax import compile_cache

    afile = tmp_path / "afile"
    afile.write_text("notes\n")
    assert compile_cache.enable(str(afile)) is None
    err = capsys.readouterr().err
    assert err == f"warning: the compilation cache {afile} cannot be used (File exists); compiling without it.\n"
    assert compile_cache.enable("none") is None and capsys.readouterr().err == ""


@pytest.mark.parametrize("flag", ["--h=5", "--seeds=0", "--choice_epochs=0", "--epochs=0"])
def test_a_bad_tuned_value_writes_nothing(tmp_path, flag):
    """The error names the flag the user gave (--choice_epochs and --epochs set the same config
    field, each for its own runs)."""
    workdir = tmp_path / "tuned"
    line = _one_error_line(*_run("-m", "experiments.tuned", "--smoke", flag, f"--workdir={workdir}")[::2])
    assert line.startswith(f"error: {flag}"), line
    assert not workdir.exists()


def test_a_literal_table_that_is_not_there_is_refused_before_any_training(tmp_path):
    """A mistyped --literal dropped the table's rate-0.1 column without a word, after the run."""
    from experiments import tuned

    workdir = tmp_path / "tuned"
    with pytest.raises(ValueError, match=r"^--literal='/nowhere/results_h.json' is not a results_h.json of"):
        tuned.run(workdir=str(workdir), keys=["naisnet_mnist"], literal="/nowhere/results_h.json")
    assert not workdir.exists()
    assert "NAIS-Net" in tuned.literal_rows(tuned.LITERAL)  # the stored one is read as before
