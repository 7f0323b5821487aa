"""``naisnet-train``: configs from any directory and by name, ``--help``, typed overrides
(``model_kwargs`` included), one-line errors with exit status 2 and nothing written, and the
progress bar only on a terminal.

Most cases call ``train_cli.main`` in-process (cheap); two runs go through the installed
command from a temporary working directory, once redirected and once on a pseudo-terminal.
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import pty
import struct
import subprocess
import sys
import termios

import pytest

from naisnet_jax import train_cli

REPO = pathlib.Path(__file__).resolve().parents[1]
COMMAND = pathlib.Path(sys.executable).parent / "naisnet-train"  # the installed entry point
SHIPPED_CONFIGS = sorted(train_cli.PACKAGED_CONFIGS.glob("[!_]*.py"))
DIGITS_TINY = str(train_cli.PACKAGED_CONFIGS / "digits_tiny.py")
TINY = [
    "--config.model_kwargs.features=8",
    "--config.model_kwargs.steps=3",
    "--config.limit_train=256",
    "--config.limit_test=100",
    "--config.batch_size=64",
    "--config.steps_per_chunk=2",
]


def _env():
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH="")


@pytest.fixture
def outside_the_repo(tmp_path, monkeypatch):
    """cwd is a temporary directory and the repository is not on sys.path: only what the
    installed package provides can be imported."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(REPO))])
    for name in [m for m in sys.modules if m == "experiments" or m.startswith("experiments.")]:
        monkeypatch.delitem(sys.modules, name)
    return tmp_path


# ----------------------------------------------------------------- configs


@pytest.mark.parametrize(
    "path", [p for p in SHIPPED_CONFIGS if p.stem in train_cli.shipped_configs()], ids=lambda p: p.stem
)
def test_every_shipped_config_loads_from_any_directory(outside_the_repo, path):
    config = train_cli.load_config(str(path))
    assert config.model and config.dataset
    assert "experiments" not in sys.modules


@pytest.mark.parametrize("name", train_cli.shipped_configs())
def test_packaged_configs_load_by_name(outside_the_repo, name):
    by_name = train_cli.load_config(name)
    by_path = train_cli.load_config(str(train_cli.PACKAGED_CONFIGS / f"{name}.py"))
    assert by_name.to_dict() == by_path.to_dict()


def test_default_is_shipped_and_a_local_file_wins_over_a_name(outside_the_repo):
    assert "default" in train_cli.shipped_configs()
    (outside_the_repo / "default").write_text(
        "import ml_collections\ndef get_config():\n    return ml_collections.ConfigDict({'model': 'local'})\n"
    )
    assert train_cli.load_config("default").model == "local"


def test_a_config_argument_is_passed_to_get_config(outside_the_repo):
    path = outside_the_repo / "withargs.py"
    path.write_text(
        "from naisnet_jax.configs import default\n"
        "def get_config(arg):\n    c = default.get_config()\n    c.dataset = arg\n    return c\n"
    )
    assert train_cli.load_config(f"{path}:digits").dataset == "digits"


def test_overrides_are_parsed_to_the_field_types():
    _, config = train_cli.parse(
        [
            "--config=default",
            "--workdir=unused",
            "--config.learning_rate=1e-2",
            "--config.num_epochs",
            "7",
            "--config.augment=true",
            "--config.lr_boundaries_epochs=[3, 5]",
            "--config.limit_train=500",
            "--config.data_dir=/x",
            "--config.model_kwargs.features=16",
            "--config.model_kwargs.activation=relu",
            "--config.model_kwargs.untied=True",
            "--config.h=1",
        ]
    )
    assert config.learning_rate == 0.01 and config.num_epochs == 7 and config.augment is True
    assert list(config.lr_boundaries_epochs) == [3, 5] and config.limit_train == 500
    assert config.data_dir == "/x" and isinstance(config.h, float) and config.h == 1.0
    assert dict(config.model_kwargs) == {"features": 16, "activation": "relu", "untied": True}
    _, config = train_cli.parse(["--config=default", "--workdir=w", "--config.limit_train=None"])
    assert config.limit_train is None


def test_a_model_keyword_the_file_sets_can_be_set_to_none():
    """``None`` goes to the model as given (the model's own check decides whether it takes it), in
    any case, and a typed keyword's bad value is named with the type and the file's value."""
    _, config = train_cli.parse(["--config=digits_tiny", "--workdir=w", "--config.model_kwargs.rank=None"])
    assert config.model_kwargs.rank is None and config.model_kwargs.steps == 5
    _, config = train_cli.parse(["--config=digits_tiny", "--workdir=w", "--config.model_kwargs.features=none"])
    assert config.model_kwargs.features is None
    with pytest.raises(train_cli.UsageError, match=r"features=2\.5: expected an integer \(the config sets 16\)\.$"):
        train_cli.parse(["--config=digits_tiny", "--workdir=w", "--config.model_kwargs.features=2.5"])


# ----------------------------------------------------------------- --help


def test_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit) as info:
        train_cli.main(["--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for flag in (
        "--config",
        "--workdir",
        "--tensorboard",
        "--print_config",
        "--config.FIELD=VALUE",
        "--config.model_kwargs.features",
        "default",
    ):
        assert flag in out, flag


# ----------------------------------------------------------------- bad command lines


def _bad_config_files(tmp_path):
    (tmp_path / "no_get_config.py").write_text("x = 1\n")
    (tmp_path / "syntax.py").write_text("def get_config(:\n")
    (tmp_path / "raises.py").write_text("def get_config():\n    raise RuntimeError('boom')\n")
    (tmp_path / "not_a_configdict.py").write_text("def get_config():\n    return {'model': 1}\n")
    (tmp_path / "a_file").write_text("")


BAD_LINES = {
    # name: (arguments after --workdir, words the message must contain)
    "missing config file": (["--config=/nonexistent/cfg.py"], ["/nonexistent/cfg.py", "no such config"]),
    "config is a directory": (["--config={tmp}"], ["directory"]),
    "config without get_config": (["--config={tmp}/no_get_config.py"], ["get_config"]),
    "config with a syntax error": (["--config={tmp}/syntax.py"], ["SyntaxError"]),
    "get_config raises": (["--config={tmp}/raises.py"], ["boom"]),
    "get_config returns a dict": (["--config={tmp}/not_a_configdict.py"], ["ConfigDict"]),
    "unknown field": (["--config={cfg}", "--config.learning_rat=0.1"], ["learning_rat", "learning_rate"]),
    "unknown group": (["--config={cfg}", "--config.modell_kwargs.x=1"], ["modell_kwargs", "model_kwargs"]),
    "field of a leaf": (["--config={cfg}", "--config.eps.x=1"], ["eps"]),
    "not an integer": (["--config={cfg}", "--config.num_epochs=abc"], ["num_epochs", "integer"]),
    "not a number": (["--config={cfg}", "--config.eps=small"], ["eps", "number"]),
    "not a boolean": (["--config={cfg}", "--config.augment=maybe"], ["augment", "true or false"]),
    "not a list": (["--config={cfg}", "--config.lr_boundaries_epochs=abc"], ["lr_boundaries_epochs", "list"]),
    "None for a required field": (["--config={cfg}", "--config.eps=None"], ["eps", "None"]),
    "override without a value": (["--config={cfg}", "--config.eps"], ["config.eps", "value"]),
    "a group set to a value": (["--config={cfg}", "--config.model_kwargs=3"], ["model_kwargs", "group"]),
    "out of range": (["--config={cfg}", "--config.eps=0.7"], ["config.eps=0.7", "(0, 0.5)"]),
    "unknown model": (["--config={cfg}", "--config.model=nope"], ["config.model", "nope"]),
    "unknown dataset": (["--config={cfg}", "--config.dataset=nope"], ["config.dataset", "nope"]),
    "missing dataset files": (
        ["--config={cfg}", "--config.dataset=fashion_mnist_idx", "--config.data_dir={tmp}/none"],
        ["not found", "none"],
    ),
    "unknown model keyword": (["--config={cfg}", "--config.model_kwargs.widht=8"], ["widht", "features"]),
    "bad model keyword value": (["--config={cfg}", "--config.model_kwargs.features=0"], ["features=0"]),
    "unknown flag": (["--config={cfg}", "--bogus=1"], ["--bogus"]),
    "stray argument": (["--config={cfg}", "extra"], ["extra"]),
    "missing --config": ([], ["--config"]),
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_a_bad_command_line_is_one_error_line_exit_2_and_writes_nothing(tmp_path, capsys, case):
    _bad_config_files(tmp_path)
    args, words = BAD_LINES[case]
    workdir = tmp_path / "work"
    argv = [f"--workdir={workdir}"] + [a.format(tmp=tmp_path, cfg=DIGITS_TINY) for a in args]
    with pytest.raises(SystemExit) as info:
        train_cli.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for word in words:
        assert word.format(tmp=tmp_path) in err, (word, err)
    assert not workdir.exists()


def test_missing_workdir_and_a_workdir_that_is_a_file(tmp_path, capsys):
    for argv, word in (
        ([f"--config={DIGITS_TINY}"], "--workdir"),
        ([f"--config={DIGITS_TINY}", f"--workdir={tmp_path / 'f'}"], "not a directory"),
    ):
        (tmp_path / "f").write_text("keep me")
        with pytest.raises(SystemExit) as info:
            train_cli.main(argv)
        err = capsys.readouterr().err
        assert info.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1 and word in err
        assert (tmp_path / "f").read_text() == "keep me"


def test_the_installed_command_reports_a_typo_in_one_line(tmp_path):
    out = subprocess.run(
        [str(COMMAND), "--config=default", f"--workdir={tmp_path / 'w'}", "--config.learning_rat=0.1"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("error: ") and out.stderr.count("\n") == 1 and "learning_rate" in out.stderr
    assert not (tmp_path / "w").exists()


# ----------------------------------------------------------------- runs


def test_installed_command_trains_from_any_directory_one_line_per_epoch_when_redirected(tmp_path):
    assert COMMAND.exists(), f"{COMMAND} missing: install the package (pip install -e .)"
    workdir = tmp_path / "run"
    out = subprocess.run(
        [
            str(COMMAND),
            f"--config={DIGITS_TINY}",
            f"--workdir={workdir}",
            "--config.num_epochs=2",
            "--config.progress=true",
            *TINY,
        ],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == ["epoch 1", "epoch 2"]
    assert lines[2].startswith("test accuracy") and len(lines) == 3
    assert "\r" not in out.stdout + out.stderr and "step/s" not in out.stderr  # no bar when redirected
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2]
    assert f"test accuracy {records[-1]['test_accuracy']:.4f} after epoch 2" in out.stdout


def test_the_progress_bar_draws_on_a_terminal(tmp_path):
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 100-column terminal
    try:
        proc = subprocess.Popen(
            [
                str(COMMAND),
                f"--config={DIGITS_TINY}",
                f"--workdir={tmp_path / 'run'}",
                "--config.num_epochs=1",
                "--config.progress=true",
                *TINY,
            ],
            cwd=tmp_path,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=secondary,
            text=True,
        )
        os.close(secondary)
        drawn = b""
        while True:
            try:
                chunk = os.read(primary, 4096)
            except OSError:  # the terminal closes when the process ends
                break
            if not chunk:
                break
            drawn += chunk
        stdout, _ = proc.communicate(timeout=600)
    finally:
        os.close(primary)
    assert proc.returncode == 0, drawn[-2000:]
    assert b"\r" in drawn and (b"step/s" in drawn or b"s/step" in drawn), drawn[-2000:]
    assert stdout.startswith("epoch 1:")


def test_print_config_shows_the_overridden_config_and_needs_no_workdir(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    train_cli.main(["--config=default", "--print_config", "--config.model_kwargs.features=4", "--config.h=0.5"])
    out = capsys.readouterr().out
    assert "features: 4" in out and "h: 0.5" in out
    assert list(tmp_path.iterdir()) == []


def test_print_config_into_a_reader_that_stops_early_is_no_error(tmp_path):
    """``naisnet-train --print_config | head -3``: the reader closes the pipe; that is not a
    traceback (Python's BrokenPipeError at the write, then again at exit's flush)."""
    proc = subprocess.Popen(
        [str(COMMAND), "--config=default", "--print_config"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    proc.stdout.close()  # before the command has imported anything: its first write meets a closed pipe
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and err == b"", err.decode()[-2000:]


# ----------------------------------------------------------------- through a process, from the declaration

SUBPROCESS_BAD = {
    # name: (arguments, words the one error line must hold)
    "bad file": (["--config={tmp}/missing.py"], ["missing.py", "no such config"]),
    "unknown field": (["--config=digits_tiny", "--config.weight_decy=0.1"], ["weight_decy", "weight_decay"]),
    "bad type": (["--config=digits_tiny", "--config.batch_size=big"], ["config.batch_size=big", "an integer"]),
    "bad value": (["--config=digits_tiny", "--config.momentum=1.5"], ["config.momentum=1.5", "[0, 1)"]),
    "None where a value is needed": (["--config=digits_tiny", "--config.h=None"], ["config.h", "None"]),
    "bad type of a model keyword": (
        ["--config=digits_tiny", "--config.model_kwargs.steps=abc"],
        ["config.model_kwargs.steps=abc", "an integer", "the config sets 5"],
    ),
    "None where the model needs a value": (
        ["--config=digits_tiny", "--config.model_kwargs.steps=None"],
        ["steps=None", "positive integer"],
    ),
}


@pytest.mark.parametrize("case", list(SUBPROCESS_BAD))
def test_the_command_refuses_a_bad_override_in_one_line_with_exit_2(tmp_path, case):
    """``python -m naisnet_jax.train_cli`` of this tree (the installed command may be another
    checkout's): exit status 2, one ``error:`` line naming the field, nothing written."""
    args, words = SUBPROCESS_BAD[case]
    out = subprocess.run(
        [sys.executable, "-m", "naisnet_jax.train_cli", f"--workdir={tmp_path / 'w'}"]
        + [a.format(tmp=tmp_path) for a in args],
        cwd=tmp_path,
        env=dict(_env(), PYTHONPATH=str(REPO / "src")),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and out.stdout == "", out.stderr
    assert out.stderr.startswith("error: ") and out.stderr.count("\n") == 1, out.stderr
    for word in words:
        assert word in out.stderr, (word, out.stderr)
    assert not (tmp_path / "w").exists()


def test_an_optional_field_takes_none_and_the_config_is_completed(tmp_path):
    partial = tmp_path / "partial.py"
    partial.write_text(
        "import ml_collections\n"
        "def get_config():\n    return ml_collections.ConfigDict({'model': 'naisnet_fc_tiny', 'dataset': 'digits'})\n"
    )
    _, config = train_cli.parse([f"--config={partial}", "--print_config", "--config.limit_train=None"])
    assert config.limit_train is None and config.batch_size == 128 and config.h == 0.1  # declared defaults
