"""``naisnet-train --config=FILE_OR_NAME --workdir=DIR [--config.FIELD=VALUE ...]``.

Parses the command line only; the work is :func:`naisnet_jax.train.train_and_evaluate`.
Every bad command line (missing or broken config file, unknown field, value of the
wrong type or out of range, missing dataset, ...) ends with one line
``error: ...`` on stderr and exit status 2, before anything is written.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib.machinery
import importlib.util
import inspect
import os
import pathlib
import signal
import sys
from collections.abc import Sequence
from typing import Any

EXIT_USAGE = 2  # bad command line, config, data or checkpoint: nothing was written
EXIT_DIVERGED = 1  # training diverged; the last good checkpoint is kept
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT): the checkpoints are intact, the same command resumes
PACKAGED_CONFIGS = pathlib.Path(__file__).resolve().parent / "configs"
_TRUE, _FALSE = ("true", "t", "yes", "y", "1"), ("false", "f", "no", "n", "0")


class UsageError(Exception):
    """A bad command line; its message is printed as ``error: <message>``."""


def shipped_configs() -> list[str]:
    """Names of the configs inside the package (``--config=NAME`` loads one)."""
    return sorted(p.stem for p in PACKAGED_CONFIGS.glob("*.py") if not p.stem.startswith("_") and p.stem != "schema")


def resolve_config_path(spec: str) -> tuple[pathlib.Path, str | None]:
    """``PATH[:ARG]`` or ``NAME[:ARG]`` -> ``(file, ARG)``; a NAME is a shipped config."""
    path, sep, arg = spec.partition(":")
    if not path:
        raise UsageError(f"--config is empty; pass a config file or one of the shipped names {shipped_configs()}.")
    candidate = pathlib.Path(path).expanduser()
    if candidate.is_file():
        return candidate, (arg if sep else None)
    if os.sep not in path and not path.endswith(".py") and (PACKAGED_CONFIGS / f"{path}.py").is_file():
        return PACKAGED_CONFIGS / f"{path}.py", (arg if sep else None)
    if candidate.is_dir():
        raise UsageError(f"--config={path} is a directory; expected a config file (a .py with get_config()).")
    raise UsageError(
        f"--config={path}: no such config file, and not a shipped config name "
        f"(shipped: {', '.join(shipped_configs())})."
    )


def load_config(spec: str):
    """Import a ``get_config()`` file from any directory and call it (with ``ARG`` if given)."""
    import ml_collections

    path, arg = resolve_config_path(spec)
    module_name = f"naisnet_config_{abs(hash(str(path.resolve())))}"
    try:
        loader = importlib.machinery.SourceFileLoader(module_name, str(path))  # any file name
        module = importlib.util.module_from_spec(importlib.util.spec_from_loader(module_name, loader))
        loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - whatever the file does wrong, say so in one line
        raise UsageError(f"--config={path}: the file cannot be loaded ({type(e).__name__}: {e}).") from e
    get_config = getattr(module, "get_config", None)
    if not callable(get_config):
        raise UsageError(f"--config={path} defines no get_config() function.")
    try:
        takes_arg = bool(inspect.signature(get_config).parameters)
        if arg is not None and not takes_arg:
            raise UsageError(f"--config={path}:{arg}: this config's get_config() takes no argument.")
        config = get_config(arg) if takes_arg and arg is not None else get_config()
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001
        raise UsageError(f"--config={path}: get_config() failed ({type(e).__name__}: {e}).") from e
    if not isinstance(config, ml_collections.ConfigDict):
        raise UsageError(f"--config={path}: get_config() returned {type(config).__name__}, not a ConfigDict.")
    return config


def _parse_value(field: str, raw: str, expected: type | None) -> Any:
    """The override string ``raw`` as a value of the ``expected`` type (any literal if None)."""
    if raw.lower() == "none":
        return None
    if expected is bool:
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise UsageError(f"--config.{field}={raw}: expected true or false.")
    if expected is str:
        return raw
    if expected is int:
        try:
            return int(raw)
        except ValueError:
            raise UsageError(f"--config.{field}={raw}: expected an integer.") from None
    if expected is float:
        try:
            return float(raw)
        except ValueError:
            raise UsageError(f"--config.{field}={raw}: expected a number.") from None
    if expected is None and raw.lower() in ("true", "false"):  # an untyped field: as booleans are
        return raw.lower() == "true"
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        if expected in (list, tuple):
            raise UsageError(f"--config.{field}={raw}: expected a list such as [10, 20].") from None
        return raw  # a bare word: a string (e.g. --config.model_kwargs.activation=relu)
    if expected in (list, tuple):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise UsageError(f"--config.{field}={raw}: expected a list such as [10, 20].")
        return expected(value)
    return value


def apply_override(config, dotted: str, raw: str) -> None:
    """``config.<dotted> = raw`` parsed to the field's type. Fields must exist, except
    inside ``model_kwargs`` (the model's keyword arguments, checked by the trainer)."""
    import ml_collections

    *parents, leaf = dotted.split(".")
    node, walked = config, []
    for name in parents:
        walked.append(name)
        if name not in node or not isinstance(node[name], ml_collections.ConfigDict):
            raise UsageError(_unknown(".".join(walked), node, name))
        node = node[name]
    open_group = walked == ["model_kwargs"]
    if leaf not in node:
        if not open_group:
            raise UsageError(_unknown(dotted, node, leaf))
        expected = None
    else:
        expected = node.get_type(leaf)
        if expected is ml_collections.ConfigDict or isinstance(node[leaf], ml_collections.ConfigDict):
            raise UsageError(
                f"--config.{dotted} is a group of fields; set them one by one (--config.{dotted}.NAME=VALUE)."
            )
        if open_group and node[leaf] is not None:
            expected = type(node[leaf])
    value = _parse_value(dotted, raw, expected)
    try:
        if open_group and leaf not in node:
            node[leaf] = value
        elif value is None and node[leaf] is not None and expected is not None:
            raise TypeError(f"field {dotted} cannot be None")
        else:
            node[leaf] = value
    except (TypeError, ValueError, AttributeError) as e:
        raise UsageError(f"--config.{dotted}={raw}: {e}.") from None


def _unknown(dotted: str, node, name: str) -> str:
    close = difflib.get_close_matches(name, list(node.keys()), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; fields here: {', '.join(sorted(node.keys()))}."
    return f"--config.{dotted}: no such config field{hint}"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage + two lines)
        raise UsageError(f"{message} (see naisnet-train --help)")


def _parser() -> argparse.ArgumentParser:
    epilog = (
        "Override any config field with --config.FIELD=VALUE (nested: --config.model_kwargs.features=64; "
        "model_kwargs accepts any keyword argument of the model). Values are parsed to the field's type: "
        "numbers, true/false, None, lists such as [30, 60]. "
        f"Shipped configs (--config=NAME): {', '.join(shipped_configs())}. "
        "Exit status: 0 trained, 1 training diverged (the last good checkpoint is kept), "
        "2 bad command line, config, data or checkpoint, or a workdir in use (nothing written), "
        "130 interrupted (Ctrl-C; the same command resumes)."
    )
    p = _Parser(
        prog="naisnet-train",
        description="Train a NAIS-Net (or a ResNet baseline) from a config; resumes from the workdir's "
        "latest checkpoint.",
        epilog=epilog,
        allow_abbrev=False,
    )
    p.add_argument(
        "--config",
        required=True,
        metavar="FILE_OR_NAME[:ARG]",
        help="a get_config() file (from any directory), or a shipped config name such as 'default'",
    )
    p.add_argument(
        "--workdir",
        metavar="DIR",
        help="checkpoints, metrics.jsonl and scalars.jsonl; resumed if it holds checkpoints "
        "(required unless --print_config)",
    )
    p.add_argument(
        "--tensorboard",
        action="store_true",
        help="also write TensorBoard event files to DIR/tensorboard (needs the [tensorboard] extra)",
    )
    p.add_argument(
        "--compilation_cache",
        metavar="DIR",
        default=None,
        help="JAX's persistent compilation cache: a resumed or repeated run does not compile again "
        "(default: $NAISNET_JAX_CACHE or ~/.cache/naisnet_jax/jax_cache; 'none' turns it off)",
    )
    p.add_argument("--print_config", action="store_true", help="print the final config and exit")
    return p


def _split_overrides(argv: Sequence[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """Separate ``--config.a.b=v`` / ``--config.a.b v`` from the other arguments."""
    rest, overrides, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--config."):
            key, sep, raw = arg[len("--config.") :].partition("=")
            if not sep:
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                    raise UsageError(f"--config.{key} needs a value (--config.{key}=VALUE).")
                raw, i = argv[i + 1], i + 1
            if not key or any(not part for part in key.split(".")):
                raise UsageError(f"{arg}: malformed field name.")
            overrides.append((key, raw))
        else:
            rest.append(arg)
        i += 1
    return rest, overrides


def parse(argv: Sequence[str]):
    """Command line -> ``(args, config)``; raises :class:`UsageError` for anything wrong."""
    rest, overrides = _split_overrides(list(argv))
    args = _parser().parse_args(rest)
    if args.workdir is None and not args.print_config:
        raise UsageError("the following arguments are required: --workdir (see naisnet-train --help)")
    config = load_config(args.config)
    for dotted, raw in overrides:
        apply_override(config, dotted, raw)
    if args.workdir is None:
        return args, config
    if not args.workdir.strip():
        raise UsageError("--workdir is empty; pass the directory for the checkpoints and metrics.")
    args.workdir = os.path.expanduser(args.workdir)  # the one reading of the path: checked, locked, trained in
    from naisnet_jax.checks import check_output_dir

    try:  # before any data is read or a step compiled: the run must be able to write there
        check_output_dir("--workdir", args.workdir)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return args, config


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _leave_on_ctrl_c(workdir: str):
    """Ctrl-C ends the run as a kill would, with one line and exit status 130: a checkpoint write
    in flight is abandoned whole (resuming skips it, as after SIGKILL), the workdir's lock goes
    with the process, and no Python exception runs through Orbax's threads to print their
    tracebacks. Returns the handler it replaced (``None`` outside the main thread)."""

    def leave(signum, frame):
        print(
            f"error: interrupted; the checkpoints in {workdir} are intact, and the same command resumes "
            "from the last one.",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(EXIT_INTERRUPTED)

    try:
        return signal.signal(signal.SIGINT, leave)
    except ValueError:  # not the main thread: leave Ctrl-C as it is
        return None


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args, config = parse(argv)
    except UsageError as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    if args.print_config:
        print(config)
        return

    from absl import logging

    logging.set_verbosity(logging.WARNING)  # absl logs from INFO by default
    from naisnet_jax import compile_cache, train
    from naisnet_jax.checkpoint import quiet_orbax_logging
    from naisnet_jax.metric_writers import default_writer

    quiet_orbax_logging()  # Orbax's log lines (every save, its own bookkeeping files) are not the user's
    compile_cache.enable(args.compilation_cache)
    previous = _leave_on_ctrl_c(args.workdir)
    try:
        writer = default_writer(args.workdir, tensorboard=args.tensorboard)
        result = train.train_and_evaluate(config, args.workdir, writer=writer)
    except train.TrainingDiverged as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        sys.exit(EXIT_DIVERGED)
    except (ValueError, FileNotFoundError, NotADirectoryError, ImportError, train.WorkdirInUse) as e:
        # ValueError: config values, data files, checkpoints (CheckpointError);
        # FileNotFoundError: a missing dataset; ImportError: a missing optional extra;
        # WorkdirInUse: another trainer holds the workdir.
        print(f"error: {_one_line(e)}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    print(f"test accuracy {result['test_accuracy']:.4f} after epoch {result['epoch']}")


if __name__ == "__main__":
    main()
