"""``naisnet-train --config=FILE_OR_NAME --workdir=DIR [--config.FIELD=VALUE ...]``.

Parses the command line only; the work is :func:`naisnet_jax.train.train_and_evaluate`. The
config file and its ``--config.a.b=v`` overrides go through ``ml_collections.config_flags``
(``DEFINE_config_file``, on a flag set of this call's own); the fields, their types and help come
from the declaration (:mod:`naisnet_jax.configs.schema`). Every bad command line (missing or
broken config file, unknown field, value of the wrong type or out of range, missing dataset, ...)
ends with one line ``error: ...`` on stderr and exit status 2, before anything is written.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import sys
import warnings
from collections.abc import Sequence

EXIT_USAGE = 2  # bad command line, config, data or checkpoint: nothing was written
EXIT_DIVERGED = 1  # training diverged; the last good checkpoint is kept
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT; SIGTERM: 143): the checkpoints are intact, the same command resumes
PACKAGED_CONFIGS = pathlib.Path(__file__).resolve().parent / "configs"
_NOT_CONFIGS = ("schema",)  # modules of the configs folder that are not get_config() files
# What an override of each declared type expects, for the error line.
_EXPECTED = {
    int: "an integer",
    float: "a number",
    bool: "true or false",
    str: "a string",
    tuple: "a list such as [10, 20]",
    dict: "a group of fields",
}


class UsageError(Exception):
    """A bad command line; its message is printed as ``error: <message>``."""


def shipped_configs() -> list[str]:
    """Names of the configs inside the package (``--config=NAME`` loads one)."""
    return sorted(
        p.stem for p in PACKAGED_CONFIGS.glob("*.py") if not p.stem.startswith("_") and p.stem not in _NOT_CONFIGS
    )


def resolve_config_path(spec: str) -> tuple[pathlib.Path, str | None]:
    """``PATH[:ARG]`` or ``NAME[:ARG]`` -> ``(file, ARG)``; a NAME is a shipped config."""
    path, sep, arg = spec.partition(":")
    if not path:
        raise UsageError(f"--config is empty; pass a config file or one of the shipped names {shipped_configs()}.")
    candidate = pathlib.Path(path).expanduser()
    if candidate.is_file():
        return candidate, (arg if sep else None)
    if os.sep not in path and path in shipped_configs():
        return PACKAGED_CONFIGS / f"{path}.py", (arg if sep else None)
    if candidate.is_dir():
        raise UsageError(f"--config={path} is a directory; expected a config file (a .py with get_config()).")
    raise UsageError(
        f"--config={path}: no such config file, and not a shipped config name "
        f"(shipped: {', '.join(shipped_configs())})."
    )


def _flags(argv: Sequence[str]):
    """This call's own absl flag set, with the config file flag reading overrides from ``argv``."""
    from absl import flags
    from ml_collections import config_flags

    fv = flags.FlagValues()
    config = config_flags.DEFINE_config_file(
        "config",
        None,
        "a get_config() file (from any directory), or a shipped config name such as 'default'",
        flag_values=fv,
        lock_config=False,
        accept_new_attributes=True,  # model_kwargs takes any keyword of the model; fields are checked below
        sys_argv=list(argv),
    )
    flags.DEFINE_string(
        "workdir",
        None,
        "checkpoints, metrics.jsonl and scalars.jsonl; resumed if it holds checkpoints (required unless "
        "--print_config)",
        flag_values=fv,
    )
    flags.DEFINE_bool(
        "tensorboard",
        False,
        "also write TensorBoard event files to DIR/tensorboard (needs the [tensorboard] extra)",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "compilation_cache",
        None,
        "JAX's persistent compilation cache: a resumed or repeated run does not compile again "
        "(default: $NAISNET_JAX_CACHE or ~/.cache/naisnet_jax/jax_cache; 'none' turns it off)",
        flag_values=fv,
    )
    flags.DEFINE_bool("print_config", False, "print the final config and exit", flag_values=fv)
    from naisnet_jax import distributed

    distributed.define_flags(fv)
    return fv, config


_FLAG_NAMES = (
    "config",
    "workdir",
    "tensorboard",
    "compilation_cache",
    "print_config",
    "coordinator_address",
    "num_processes",
    "process_id",
)


def _help() -> str:
    from naisnet_jax.configs import schema

    fv, _ = _flags(["naisnet-train"])
    flag_lines = "\n".join(f"  --{fv[name].name}  {fv[name].help}" for name in _FLAG_NAMES)
    fields = "\n".join(
        f"  --config.{f.name}{'.NAME=VALUE' if f.type is dict else '=' + f.type.__name__.upper()}  {f.help} "
        f"(default {f.default!r})"
        for f in schema.FIELDS
    )
    return (
        "usage: naisnet-train --config=FILE_OR_NAME[:ARG] --workdir=DIR [--config.FIELD=VALUE ...]\n\n"
        "Train a NAIS-Net (or a ResNet baseline) from a config; resumes from the workdir's latest checkpoint.\n\n"
        f"{flag_lines}\n\n"
        "Override any config field with --config.FIELD=VALUE (nested: --config.model_kwargs.features=64; "
        "model_kwargs accepts any keyword argument of the model). Values are parsed to the field's type: "
        "numbers, true/false, None (where a field may be unset), lists such as [30, 60]. Fields:\n"
        f"{fields}\n\n"
        f"Shipped configs (--config=NAME): {', '.join(shipped_configs())}.\n"
        "Exit status: 0 trained, 1 training diverged (the last good checkpoint is kept), "
        "2 bad command line, config, data or checkpoint, or a workdir in use (nothing written), "
        "130 / 143 interrupted by Ctrl-C / SIGTERM (the same command resumes).\n\n"
        "Several processes (one per host or per accelerator): run the same command in each, with "
        "--coordinator_address, --num_processes and --process_id, or under srun / mpirun / a TPU pod without "
        "them. Process 0 prints, writes the metrics and holds the workdir; every process saves the checkpoints. "
        "A lost process ends the others within about 20 s (exit 1); the same command resumes."
    )


def _check_override_names(argv: Sequence[str]) -> list[tuple[str, str]]:
    """Refuse overrides of undeclared fields, of a field below a plain value, and of a whole group;
    returns the ``--config.FIELD=None`` and ``--config.GROUP.NAME=None`` overrides (``(dotted, raw)``),
    which the flag parsers of typed fields cannot read and which are applied after the file is loaded."""
    from naisnet_jax.configs import schema

    nones = []
    for i, arg in enumerate(argv):
        match = re.match(r"^--?config\.([^=]*)(=(.*))?$", arg)
        if not match:
            continue
        dotted, raw = match.group(1), match.group(3)
        parts = dotted.split(".")
        if not all(parts):
            raise UsageError(f"{arg}: malformed field name.")
        top = schema.BY_NAME.get(parts[0])
        if top is None:
            raise UsageError(
                "--" + schema.unknown_field_message(dotted if len(parts) == 1 else parts[0], schema.BY_NAME)
            )
        if top.type is dict and len(parts) == 1:
            raise UsageError(
                f"--config.{dotted} is a group of fields; set them one by one (--config.{dotted}.NAME=VALUE)."
            )
        if top.type is not dict and len(parts) > 1:
            raise UsageError(f"--config.{dotted}: config.{parts[0]} is a {top.type.__name__}, not a group of fields.")
        if raw is None and (i + 1 >= len(argv) or argv[i + 1].startswith("-")):
            raise UsageError(f"--config.{dotted} needs a value (--config.{dotted}=VALUE).")
        if raw is not None and raw.lower() == "none":
            nones.append((dotted, raw))
    return nones


def _flag_error(e: Exception, config_spec: str) -> UsageError:
    """One line for what absl or the config file raised while parsing."""
    from absl import flags

    from naisnet_jax.configs import schema

    if isinstance(e, flags.UnrecognizedFlagError):
        return UsageError(f"unknown flag --{e.flagname} (see naisnet-train --help)")
    text = str(e)
    match = re.match(r"^flag --config\.([\w.]+)=(.*?): ", text)
    if isinstance(e, flags.IllegalFlagValueError) and match:
        dotted, raw = match.groups()
        top = schema.BY_NAME.get(dotted.split(".")[0])
        if top is not None and "." not in dotted:
            kind = tuple if top.type in (list, tuple) else top.type
            return UsageError(f"--config.{dotted}={raw}: expected {_EXPECTED.get(kind, kind.__name__)}.")
        if top is not None and dotted.count(".") == 1:  # a model keyword the file sets: typed by its value
            value = _file_value(config_spec, dotted)
            if value is not None:
                kind = tuple if isinstance(value, (list, tuple)) else type(value)
                return UsageError(
                    f"--config.{dotted}={raw}: expected {_EXPECTED.get(kind, kind.__name__)} "
                    f"(the config sets {value!r})."
                )
    if isinstance(e, flags.Error):
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if "Error whilst parsing config file" in text and lines:  # get_config() raised; its last line
            return UsageError(f"--config={config_spec}: get_config() failed ({lines[-1]}).")
        return UsageError(f"{' '.join(lines)} (see naisnet-train --help)")
    if isinstance(e, AttributeError) and "get_config" in text:
        return UsageError(f"--config={config_spec} defines no get_config() function.")
    return UsageError(f"--config={config_spec}: the file cannot be loaded ({type(e).__name__}: {text}).")


def _file_value(config_spec: str, dotted: str):
    """The value a config file gives ``GROUP.NAME`` (None where it cannot be read)."""
    try:
        group, name = dotted.split(".")
        return load_config(config_spec)[group].get(name)
    except Exception:  # noqa: BLE001 - only the wording of an error depends on it
        return None


def parse_config(argv: Sequence[str], *, validate: bool = True):
    """``(flags, config)`` of a command line (``argv`` without the program name): the config file
    loaded by ``ml_collections.config_flags``, its overrides applied and (``validate``) the config
    checked and completed against the declaration; raises :class:`UsageError` for anything wrong."""
    import ml_collections

    from naisnet_jax.configs import schema

    argv = list(argv)
    spec = None
    for i, arg in enumerate(argv):  # a shipped name becomes its file (config_flags reads paths)
        if arg == "--config" and i + 1 < len(argv):
            spec, at = argv[i + 1], i + 1
        elif arg.startswith("--config="):
            spec, at = arg[len("--config=") :], i
        else:
            continue
        path, arg_ = resolve_config_path(spec)
        resolved = str(path) + ("" if arg_ is None else f":{arg_}")
        argv[at] = resolved if at == i + 1 else f"--config={resolved}"
    nones = _check_override_names(argv)
    argv = [a for a in argv if not any(a == f"--config.{d}={raw}" for d, raw in nones)]
    fv, holder = _flags(["naisnet-train", *argv])
    module = "config_config"  # config_flags's module name for the file: a fresh one per load
    sys.modules.pop(module, None)
    try:
        with warnings.catch_warnings():  # config_flags loads the file with load_module()
            warnings.simplefilter("ignore", DeprecationWarning)
            rest = fv(["naisnet-train", *argv])
            config = holder.value
    except Exception as e:  # noqa: BLE001 - whatever the file or a value does wrong, in one line
        raise _flag_error(e, spec) from None
    finally:
        sys.modules.pop(module, None)
    if rest[1:]:
        raise UsageError(f"unexpected arguments {rest[1:]} (see naisnet-train --help)")
    if spec is None:
        raise UsageError("the following arguments are required: --config (see naisnet-train --help)")
    if not isinstance(config, ml_collections.ConfigDict):
        raise UsageError(f"--config={spec}: get_config() returned {type(config).__name__}, not a ConfigDict.")
    for dotted, value in fv["config"].override_values.items():  # model keywords: TRUE as typed fields read it
        if isinstance(value, str) and value.lower() in ("true", "false") and dotted.count(".") == 1:
            group, name = dotted.split(".")
            with config[group].ignore_type():
                config[group][name] = value.lower() == "true"
    for dotted, raw in nones:
        if "." in dotted:  # a model keyword: None goes to the model, which says whether it takes it
            group, name = dotted.split(".")
            with config[group].ignore_type():
                config[group][name] = None
            continue
        if not schema.BY_NAME[dotted].optional:
            raise UsageError(
                f"--config.{dotted}={raw}: config.{dotted} cannot be None ({schema.BY_NAME[dotted].help})."
            )
        with config.unlocked():
            config[dotted] = None
    if validate:
        try:
            schema.validate(config)
        except ValueError as e:
            raise UsageError(str(e)) from None
    return fv, config


def load_config(spec: str):
    """The config of ``--config=spec`` (a file from any directory or a shipped name, ``:ARG``
    passed to its ``get_config``), as the file makes it (the trainer validates it)."""
    return parse_config([f"--config={spec}"], validate=False)[1]


def parse(argv: Sequence[str]):
    """Command line -> ``(args, config)``; raises :class:`UsageError` for anything wrong."""
    args, config = parse_config(argv)
    if args.workdir is None and not args.print_config:
        raise UsageError("the following arguments are required: --workdir (see naisnet-train --help)")
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


def _leave_on_ctrl_c(workdir: str) -> dict:
    """Ctrl-C (SIGINT) and SIGTERM (a batch system's stop, ``kill``) end the run as a kill would,
    with one line and exit status 128 + the signal's number (130, 143): a checkpoint write in
    flight is abandoned whole (resuming skips it, as after SIGKILL), the workdir's lock goes with
    the process, and no Python exception runs through Orbax's threads to print their tracebacks.
    Returns the handlers it replaced (none outside the main thread)."""

    def leave(signum, frame):
        name = signal.Signals(signum).name
        print(
            f"error: interrupted ({name}); the checkpoints in {workdir} are intact, and the same command "
            "resumes from the last one.",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(128 + signum)

    previous = {}
    try:
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, leave)
    except ValueError:  # not the main thread: leave the signals as they are
        pass
    return previous


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help", "--helpfull") for a in argv):
        print(_help())
        sys.exit(0)
    from naisnet_jax import distributed

    try:
        args, config = parse(argv)
        cluster = distributed.Cluster.of(args).check()
    except (UsageError, ValueError) as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    if args.print_config:
        try:
            print(config, flush=True)
        except BrokenPipeError:  # `| head`: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit's flush
        return

    from absl import logging

    logging.set_verbosity(logging.WARNING)  # absl logs from INFO by default
    from naisnet_jax import compile_cache
    from naisnet_jax.checkpoint import quiet_orbax_logging

    quiet_orbax_logging()  # Orbax's log lines (every save, its own bookkeeping files) are not the user's
    try:  # several processes: this one watches a child that joins the run, or is that child
        several = distributed.join(
            cluster, [sys.executable, "-m", "naisnet_jax.train_cli", *argv], workdir=args.workdir
        )
    except ValueError as e:  # $NAISNET_JAX_JOIN_TIMEOUT
        print(f"error: {_one_line(e)}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    compile_cache.enable(args.compilation_cache)
    if config.num_seeds > 1 and distributed.is_primary():  # a sweep's setting (cifar_paper, conv_paper ...)
        print(
            f"note: config.num_seeds={config.num_seeds} is read by sweeps (naisnet_jax.sweep.train_sweep, the "
            f"experiments); naisnet-train trains one seed, config.seed={config.seed}.",
            file=sys.stderr,
            flush=True,
        )
    status, line, result, together = _train(config, args)
    if status:
        _leave(status, line, several, together=together)
    if "test_accuracy" in result:
        print(f"test accuracy {result['test_accuracy']:.4f} after epoch {result['epoch']}")
    else:  # a complete run whose metrics log is gone: its checkpoint stays what it was
        print(
            f"{args.workdir}'s metrics log holds no epoch record; its checkpoints are intact "
            "(naisnet-verify reads them)."
        )


def _train(config, args) -> tuple[int, str | None, dict | None, bool]:
    """Train; ``(exit status, error line, result, together)``: ``together`` when every process
    stops at this same point (a divergence, decided on replicated results)."""
    from naisnet_jax import distributed, train
    from naisnet_jax.metric_writers import default_writer

    previous = _leave_on_ctrl_c(args.workdir)
    try:
        writer = default_writer(args.workdir, tensorboard=args.tensorboard) if distributed.is_primary() else None
        return 0, None, train.train_and_evaluate(config, args.workdir, writer=writer), False
    except train.TrainingDiverged as e:
        return EXIT_DIVERGED, f"error: {_one_line(e)}", None, True
    except (ValueError, OSError, ImportError, train.WorkdirInUse) as e:
        # ValueError: config values, data files, checkpoints (CheckpointError), the run's logs;
        # OSError: a missing dataset, a workdir entry of the wrong kind (a directory where its log
        # goes, say); ImportError: a missing optional extra; WorkdirInUse: another trainer holds it.
        return EXIT_USAGE, f"error: {_one_line(e)}", None, False
    except distributed.PeerFailed as e:  # the primary process said why
        return e.status, None, None, False
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _leave(status: int, line: str | None, several: bool, *, together: bool = False) -> None:
    """Exit with ``status`` after ``line``; of several processes, a process other than the
    primary names itself, and every process leaves at once (JAX's orderly shutdown would wait
    for the others, which may be waiting for this one). A stop that every process reaches
    (``together``) meets after its line first: process 0 hosts the run's coordinator, and were it
    to leave while another process is still on its way there, JAX's runtime would end that one
    as if process 0 had been lost, before it says why it stops."""
    import jax

    from naisnet_jax import distributed

    if line is not None:
        if several and not distributed.is_primary():
            line = f"error: process {jax.process_index()} of {jax.process_count()}: {line.removeprefix('error: ')}"
        print(line, file=sys.stderr, flush=True)
    if several:
        if together:
            distributed.meet("leave")
        sys.stdout.flush()
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    main()
