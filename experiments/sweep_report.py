"""Helpers shared by the sweep experiments (``ablation.py``, ``conv.py``): summary caching,
mean +- std formatting, per-epoch curves over seeds, and the timing of a sweep's steps that
projects an experiment's cost, and the commit a result was made from. No flags here;
``python -m experiments.sweep_report`` writes the tree manifest a copy of the tree without git
needs (:func:`write_tree_manifest`)."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import NoReturn

import numpy as np

from naisnet_jax.configs import schema

#: What a stored summary must share with a config to stand for it: the fields that decide results.
FINGERPRINT_KEYS = schema.RESULT_FIELDS


def fingerprint(config) -> dict:
    """What a finished sweep's summary must share with this call to be reused."""
    d = config.to_dict()
    return json.loads(json.dumps({k: d.get(k) for k in FINGERPRINT_KEYS}))


def read_summary(path: str, config) -> dict | None:
    """The row saved at ``path`` if it was made with this config, else None; a file there that
    is no summary (cut short, say) is an error naming it, never written over."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            saved = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a readable summary ({e}); move it away to run that row again.") from None
    if not isinstance(saved, dict) or "row" not in saved:
        raise ValueError(f"{path} holds no summary row; move it away to run that row again.")
    return saved["row"] if same_fingerprint(saved, config) else None


#: 2: a summary's fingerprint holds every field that decides results (:data:`FINGERPRINT_KEYS`);
#: before, a shorter list, which such a summary is still matched on.
FINGERPRINT_VERSION = 2


def same_fingerprint(saved: dict, config) -> bool:
    """Whether a stored summary stands for ``config``. Its fingerprint must agree on every field
    it records; a current summary records them all, and a field added to the declaration after it
    was written must hold its default (the value every run had before the field existed)."""
    stored, ours = saved.get("fingerprint"), fingerprint(config)
    if not stored:
        return False
    if saved.get("fingerprint_version") != FINGERPRINT_VERSION:
        return all(ours.get(k) == v for k, v in stored.items())
    defaults = fingerprint(schema.default_config())
    return all(stored.get(k, defaults[k]) == ours[k] for k in ours)


def write_summary(path: str, config, row: dict) -> None:
    """Store a finished sweep's ``row`` (from the primary process only, of several)."""
    from naisnet_jax import distributed

    if not distributed.is_primary():
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump({"fingerprint": fingerprint(config), "fingerprint_version": FINGERPRINT_VERSION, "row": row}, f)
    os.replace(path + ".tmp", path)


def pm(stat: dict, scale: float = 100.0, digits: int = 2) -> str:
    """``"mean ± std"`` of a ``{"mean", "std", "n"}`` record, scaled (percent by default)."""
    if stat["n"] == 0:
        return "-"
    return f"{scale * stat['mean']:.{digits}f} ± {scale * stat['std']:.{digits}f}"


def stat_row(result, field: str) -> dict:
    mean, std, n = result.stats(field)
    return {"mean": mean, "std": std, "n": n, "per_seed": [getattr(r, field) for r in result.runs]}


def trained_on(rows) -> str:
    """The cards and script versions the summary rows were trained with, each named once."""
    return ", ".join(sorted({f"{r['device']} (script {r.get('script', 'unknown')})" for r in rows}))


def training_seconds(history) -> float:
    """A sweep's training time over all its epochs: each epoch's ``epoch_seconds`` once (the
    records of every seed share it). The history is the run's log, which a resumed sweep keeps
    (rewound to its checkpoint), so the sum spans every call; each call's first epoch includes
    its compilation. Audits and exports are not in it."""
    per_epoch: dict[int, float] = {}
    for r in history:
        per_epoch.setdefault(r["epoch"], r["epoch_seconds"])
    return float(sum(per_epoch.values()))


def sweep_times(result, seconds: float) -> dict:
    """A summary row's timing fields: ``seconds``, this call's wall time; ``training_seconds``, every
    epoch over every call (:func:`training_seconds`); the median epoch's time."""
    history = result.history
    return {
        "seconds": seconds,
        "training_seconds": training_seconds(history),
        "epoch_seconds_median": float(np.median([r["epoch_seconds"] for r in history])) if history else None,
    }


def row_training_seconds(row: dict) -> tuple[float, bool]:
    """``(seconds, summed)``: a row's training time summed over its epochs (``summed`` True), or, for
    a row recorded before that sum was kept, the wall time of the call that finished it."""
    if "training_seconds" in row:
        return row["training_seconds"], True
    return row["seconds"], False


def training_time_text(row: dict) -> str:
    """A row's training time for a report, marked where it is only its last call's."""
    seconds, summed = row_training_seconds(row)
    return f"{seconds:.0f}s" + ("" if summed else " (its last call)")


def curve(history, field: str) -> dict:
    """Per epoch: mean and std of ``field`` over the seeds that had not diverged."""
    epochs = sorted({r["epoch"] for r in history})
    mean, std = [], []
    for e in epochs:
        v = [r[field] for r in history if r["epoch"] == e and r["diverged_epoch"] is None and r[field] is not None]
        mean.append(float(np.mean(v)) if v else None)
        std.append(float(np.std(v)) if v else None)
    return {"epochs": epochs, "mean": mean, "std": std}


def as_array(values) -> np.ndarray:
    return np.asarray([np.nan if v is None else v for v in values], np.float64)


def define_compilation_cache_flag() -> None:
    """``--compilation_cache``, read by :func:`enable_compilation_cache` (absl flags)."""
    from absl import flags

    flags.DEFINE_string(
        "compilation_cache",
        None,
        "JAX's persistent compilation cache (default: <workdir>/jax_cache; "
        "'none' turns it off): a rerun or resume does not compile again.",
    )


def define_cluster_flags() -> None:
    """``--coordinator_address``, ``--num_processes``, ``--process_id``, read by :func:`join_cluster`."""
    from naisnet_jax import distributed

    distributed.define_flags()


def join_cluster(values, workdir: str) -> None:
    """Join a multi-process run (:func:`naisnet_jax.distributed.join`; ``values``: the parsed
    flags of :func:`define_cluster_flags`), this experiment rerun by its own command line
    (``python -m`` or the script's path) where a launch of several processes needs it. Raises
    ``ValueError`` for a partial or bad cluster."""
    from naisnet_jax import distributed

    spec = getattr(sys.modules["__main__"], "__spec__", None)  # the experiment, run as python -m
    command = [sys.executable, "-m", spec.name] if spec is not None else [sys.executable, sys.argv[0]]
    distributed.join(distributed.Cluster.of(values), [*command, *sys.argv[1:]], workdir=workdir)


def enable_compilation_cache(directory: str | None, workdir: str) -> None:
    """JAX's persistent compilation cache in ``directory`` (default ``<workdir>/jax_cache``;
    ``"none"``: off; :func:`naisnet_jax.compile_cache.enable`). Call before anything compiles;
    programs that compile to the same HLO (a rerun, a resumed sweep, two datasets of one shape and
    scaling) then compile once."""
    from naisnet_jax import compile_cache

    compile_cache.enable(directory or _default_cache(workdir))


def _default_cache(workdir: str) -> str:
    """An experiment's compilation cache when ``--compilation_cache`` names none."""
    return os.path.join(workdir, "jax_cache")


def start_experiment(values) -> None:
    """What a sweep experiment's command does first (``values``: its parsed flags, with those of
    :func:`define_cluster_flags` and :func:`define_compilation_cache_flag` and a ``workdir``):
    quiet absl's INFO logs (Orbax logs every save there), join a multi-process run where one is
    launched, and keep compiled programs in the workdir's cache. A partial or bad cluster ends the
    command before anything is written, in one line with exit status 2, as ``naisnet-train``."""
    from absl import logging

    logging.set_verbosity(logging.WARNING)
    check_workdir(values.workdir)
    try:
        join_cluster(values, values.workdir)
    except ValueError as e:
        exit_with_error(e)
    missing = _missing_folders(values.workdir)
    if values.compilation_cache != "none":  # "none": no cache, nothing made
        cache = values.compilation_cache or _default_cache(values.workdir)
        missing += [p for p in _missing_folders(os.path.expanduser(cache)) if p not in missing]
    enable_compilation_cache(values.compilation_cache, values.workdir)
    _MADE_AT_START[:] = [p for p in missing if os.path.isdir(p)]


def check_workdir(path: str) -> None:
    """An experiment's ``--workdir`` is a directory it can write into, or can be created as one:
    checked before any work (a file there was found only when the first record was written, after
    the training), else the command ends in one line naming the flag (:func:`exit_with_error`)."""
    from naisnet_jax.checks import check_output_dir

    try:
        check_output_dir("--workdir", os.path.expanduser(path))
    except ValueError as e:
        exit_with_error(e)


#: The folders :func:`start_experiment` made (the workdir, its compilation cache), deepest first:
#: a command that then refuses its input removes those still empty (it leaves nothing behind).
_MADE_AT_START: list[str] = []


def _missing_folders(path: str) -> list[str]:
    """``path`` and those of its parents that do not exist yet, deepest first."""
    out, path = [], os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        out.append(path)
        path = os.path.dirname(path)
    return out


def parse_flags(argv):
    """absl's flag parsing for an experiment's ``app.run(main, flags_parser=parse_flags)``: a bad
    flag ends as bad input does (:func:`exit_with_error`: one ``error:`` line, exit status 2)
    instead of absl's two lines and exit status 1, the status of a failed run."""
    from absl import flags

    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        exit_with_error(f"{e} (see python -m experiments.{os.path.splitext(os.path.basename(argv[0]))[0]} --help)")


#: What an experiment's command ends in one line on (:func:`exit_with_error`): bad values, a
#: missing dataset, a workdir that is a file.
USER_ERRORS = (ValueError, OSError)


def exit_with_error(e: BaseException) -> NoReturn:
    """Ends an experiment's command as ``naisnet-train`` ends on bad input: ``error: <e>`` as one
    line on stderr (its whitespace collapsed), exit status 2. The folders the command made when it
    started are removed if nothing was written into them."""
    print("error: " + " ".join(str(e).split()), file=sys.stderr)
    for path in sorted(_MADE_AT_START, key=len, reverse=True):
        try:
            os.rmdir(path)  # only an empty folder
        except OSError:
            pass
    raise SystemExit(2) from None


#: The folders whose files decide what an experiment computes: a change in any of them is a
#: changed tree.
TREE_FOLDERS = ("src", "experiments", "verify")

#: Where a copy of the tree without git finds the commit it was made from
#: (:func:`write_tree_manifest`); git ignores it.
TREE_MANIFEST = ".tree_manifest.json"

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tree_files(root: str) -> dict[str, str]:
    """Every regular file under :data:`TREE_FOLDERS`, by path relative to ``root``, with git's blob
    hash of its bytes. Links, byte code and packaging metadata are not part of the tree."""
    import hashlib

    files = {}
    for folder in TREE_FOLDERS:
        for here, dirs, names in os.walk(os.path.join(root, folder)):
            dirs[:] = [
                d for d in dirs if d not in ("__pycache__", ".ipynb_checkpoints") and not d.endswith(".egg-info")
            ]
            for name in names:
                path = os.path.join(here, name)
                if os.path.islink(path) or name.endswith(".pyc"):
                    continue
                with open(path, "rb") as f:
                    data = f.read()
                blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
                files[os.path.relpath(path, root).replace(os.sep, "/")] = blob
    return files


def _git_version(root: str) -> str | None:
    """git's short HEAD, with ``+changes`` when :data:`TREE_FOLDERS` hold uncommitted changes or
    untracked files; None outside a git checkout."""
    import subprocess

    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True, cwd=root
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", *TREE_FOLDERS], capture_output=True, text=True, check=True, cwd=root
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+changes" if dirty.strip() else "")


def write_tree_manifest(root: str = _ROOT, path: str | None = None) -> str:
    """Writes ``root/.tree_manifest.json`` (or ``path``): the commit (as :func:`script_version` names
    it here) and the hash of every file of the tree, so that a copy of the tree made for a machine
    without git (a lent GPU box) can name its commit, and say whether it has changed since. Returns
    its path."""
    version = _git_version(root)
    if version is None:
        raise ValueError(f"{root!r} is not a git checkout: a tree manifest names a commit, so it is written from one")
    path = os.path.join(root, TREE_MANIFEST) if path is None else path
    with open(path, "w") as f:
        json.dump({"version": version, "files": _tree_files(root)}, f, indent=0, sort_keys=True)
    return path


def script_version(root: str = _ROOT) -> str:
    """The commit of the tree this script ran from, followed by ``+changes`` where the tree differs
    from it. In a clean git checkout, git says. Otherwise the tree manifest the copy carries
    (:func:`write_tree_manifest`), checked file by file, names the commit whose files the tree holds
    exactly: a copy without git, or a copy laid over an older checkout's ``.git`` (whose HEAD sees
    the newer files as changes). Where the manifest does not match, git's answer stands, or the
    manifest's commit with ``+changes``; ``unknown`` where neither is there."""
    version = _git_version(root)
    if version is not None and not version.endswith("+changes"):
        return version
    try:
        with open(os.path.join(root, TREE_MANIFEST)) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return version or "unknown"
    if _tree_files(root) == manifest["files"]:
        return manifest["version"]
    if version is not None:
        return version
    return manifest["version"] if manifest["version"].endswith("+changes") else manifest["version"] + "+changes"


# --------------------------------------------------------------------------- timing

_KERNEL_OPS = re.compile(r"=\s*\S+\s+(fusion|custom-call|dot|convolution|sort|scatter|gather|copy|while)\(")


def count_kernels(hlo_text: str) -> dict[str, int]:
    """Launch-level instructions of an optimised HLO module, by opcode, outside fused
    computations (on a GPU each fusion or custom call is roughly one kernel)."""
    counts: dict[str, int] = {}
    fused = False
    for line in hlo_text.splitlines():
        if line and not line.startswith(" "):
            fused = "fused" in line.split("(")[0] or line.startswith("%fused")
            continue
        m = _KERNEL_OPS.search(line)
        if m and not fused:
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


def time_steps(config, *, seeds: Sequence[int] | None = None, steps: int = 100, repeats: int = 3) -> dict:
    """Measure a sweep's training steps per second on this device (the experiments' ``--time_steps``).

    Compiles the epoch program cut to ``steps`` steps (no evaluation), runs it once to warm
    up, then times ``repeats`` calls; also times one test evaluation. ``projected_seconds`` is
    the training of ``config.num_epochs`` epochs at that rate plus one evaluation per epoch.
    """
    import jax
    import jax.numpy as jnp

    from naisnet_jax import seeds as sweep_seeds
    from naisnet_jax import train
    from naisnet_jax.checks import check_int

    check_int("--time_steps", steps)

    seeds = sweep_seeds.check_seeds(sweep_seeds.default_seeds(config) if seeds is None else seeds)
    s = sweep_seeds.prepare(config, seeds)
    steps = min(steps, s.steps_per_epoch)
    common = dict(
        augment=train.augmentation(config),
        batch_size=config.batch_size,
        eval_batch_size=config.eval_batch_size,
    )
    fn = sweep_seeds.make_sweep_epoch(
        s.mean, s.std, num_steps=steps, evaluate=False, mesh=s.mesh, seeds_at_once=config.seeds_at_once, **common
    )
    state, div = s.state, sweep_seeds.shard_seeds(jnp.zeros((len(seeds),), jnp.int32), s.mesh)
    args = (s.base_keys, s.train_data, s.test_data)
    t0 = time.time()
    compiled = fn.lower(state, div, *args, jnp.asarray(1, jnp.int32)).compile()
    compile_seconds = time.time() - t0
    kernels = count_kernels(compiled.as_text())
    state, div, m, _ = compiled(state, div, *args, jnp.asarray(1, jnp.int32))
    jax.block_until_ready(m)
    times = []
    for r in range(repeats):
        t0 = time.time()
        state, div, m, _ = compiled(state, div, *args, jnp.asarray(2 + r, jnp.int32))
        jax.block_until_ready(m)
        times.append(time.time() - t0)
    evaluate = jax.jit(jax.vmap(train.make_evaluate(s.mean, s.std, config.eval_batch_size), in_axes=(0, None)))
    jax.block_until_ready(evaluate(state, s.test_data))
    t0 = time.time()
    jax.block_until_ready(evaluate(state, s.test_data))
    eval_seconds = time.time() - t0
    best = min(times)
    sps = steps / best
    return {
        "model": config.model,
        "seeds": len(seeds),
        "seeds_at_once": config.seeds_at_once,
        "batch_size": config.batch_size,
        "steps_timed": steps,
        "repeats": repeats,
        "steps_per_second": sps,
        "step_ms": 1e3 * best / steps,
        "seed_steps_per_second": sps * len(seeds),
        "images_per_second": sps * len(seeds) * config.batch_size,
        "eval_seconds": eval_seconds,
        "compile_seconds": compile_seconds,
        "steps_per_epoch": s.steps_per_epoch,
        "epochs": config.num_epochs,
        "projected_seconds": config.num_epochs * (s.steps_per_epoch / sps + eval_seconds),
        "kernels": kernels,
        "device": str(jax.devices()[0]),
    }


def main(argv=None) -> None:
    """``python -m experiments.sweep_report``: write the checkout's tree manifest (a device launch
    carries it, so that the records made there name their commit)."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m experiments.sweep_report",
        description="Write the checkout's .tree_manifest.json: its commit and the hash of every file of the "
        "tree, which a copy made for a machine without git carries so that its records name their commit.",
    )
    parser.parse_args(argv)
    try:
        print(f"wrote {write_tree_manifest()}: {script_version()}")
    except USER_ERRORS as e:  # not a git checkout
        exit_with_error(e)


if __name__ == "__main__":
    main()
