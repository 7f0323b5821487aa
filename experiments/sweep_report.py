"""Helpers shared by the sweep experiments (``ablation.py``, ``conv.py``): summary caching,
mean +- std formatting and per-epoch curves over seeds. No flags here."""

from __future__ import annotations

import json
import os

import numpy as np

FINGERPRINT_KEYS = (
    "model",
    "model_kwargs",
    "dataset",
    "limit_train",
    "limit_test",
    "h",
    "eps",
    "eta",
    "learning_rate",
    "momentum",
    "batch_size",
    "num_epochs",
    "seed",
    "num_seeds",
    "weight_decay",
    "lr_boundaries_epochs",
    "augment",
    "augment_flip",
    "standardize",
)


def fingerprint(config) -> dict:
    """What a finished sweep's summary must share with this call to be reused."""
    d = config.to_dict()
    return json.loads(json.dumps({k: d.get(k) for k in FINGERPRINT_KEYS}))


def read_summary(path: str, config) -> dict | None:
    """The row saved at ``path`` if it was made with this config, else None."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        saved = json.load(f)
    return saved["row"] if saved.get("fingerprint") == fingerprint(config) else None


def write_summary(path: str, config, row: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump({"fingerprint": fingerprint(config), "row": row}, f)
    os.replace(path + ".tmp", path)


def pm(stat: dict, scale: float = 100.0, digits: int = 2) -> str:
    """``"mean ± std"`` of a ``{"mean", "std", "n"}`` record, scaled (percent by default)."""
    if stat["n"] == 0:
        return "-"
    return f"{scale * stat['mean']:.{digits}f} ± {scale * stat['std']:.{digits}f}"


def stat_row(result, field: str) -> dict:
    mean, std, n = result.stats(field)
    return {"mean": mean, "std": std, "n": n, "per_seed": [getattr(r, field) for r in result.runs]}


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


def enable_compilation_cache(directory: str | None, workdir: str) -> None:
    """JAX's persistent compilation cache in ``directory`` (default ``<workdir>/jax_cache``;
    ``"none"``: off). Call before anything compiles; programs that compile to the same HLO
    (a rerun, a resumed sweep, two datasets of one shape and scaling) then compile once."""
    import jax

    if directory == "none":
        return
    directory = directory or os.path.join(workdir, "jax_cache")
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", os.path.abspath(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def script_version() -> str:
    """The commit of the tree this script ran from: ``$NAISNET_SCRIPT_VERSION`` where set (a copy
    of the tree without git), else git's (``unknown`` outside a git checkout)."""
    import subprocess

    if os.environ.get("NAISNET_SCRIPT_VERSION"):
        return os.environ["NAISNET_SCRIPT_VERSION"]

    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=os.path.dirname(__file__),
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "src", "experiments"],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(__file__),
        ).stdout
        return head + ("+changes" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
