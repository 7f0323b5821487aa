"""What one run (:func:`naisnet_jax.train.train_and_evaluate`) and a sweep of seeds
(:func:`naisnet_jax.sweep.train_sweep`) share: the checked training data, the checkpoint's tree,
resuming from the latest checkpoint, the metrics log, stopping on divergence and the progress bar.

Both trainers follow one protocol. Nothing is written before the config, the data and the model
are known to be good. Each epoch's record is written before its checkpoint, so a crash between
the two leaves a record that resuming drops, never a checkpoint whose epoch has no record. A
diverged run stops without saving and keeps its last good checkpoint.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from naisnet_jax import checkpoint as ckpt
from naisnet_jax import data as data_lib
from naisnet_jax import metric_writers

METRICS_FILE = "metrics.jsonl"
CHECKPOINT_DIR = ckpt.RUN_CHECKPOINT_DIR
LOCK_FILE = ".trainer.lock"


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""


class WorkdirInUse(RuntimeError):
    """Another trainer holds the workdir's lock."""


@contextlib.contextmanager
def workdir_lock(workdir: str) -> Iterator[None]:
    """Hold ``workdir``'s lock while the block runs: one trainer per workdir, so two never append
    to one metrics log or save into one checkpoint directory. The lock is the operating system's
    (``filelock``: ``flock`` on POSIX), so a killed trainer's lock goes with its process and the
    next run takes it. A held lock raises :class:`WorkdirInUse` at once, before anything is read
    or written."""
    import filelock

    path = os.path.join(workdir, LOCK_FILE)
    lock = filelock.FileLock(path)
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        raise WorkdirInUse(
            f"{workdir} is in use by another trainer (it holds {path}); wait for it to end or use another workdir."
        ) from None
    try:
        yield
    finally:
        lock.release()


def load_training_data(config) -> tuple[data_lib.Dataset, int]:
    """``config``'s dataset (``data_dir``, ``validation``, ``limit_train``, ``limit_test``) and the
    steps of an epoch; refuses an empty split or a batch larger than the training set, naming the
    value. With ``config.validation`` set, the evaluation split (``test`` in the metrics) is the
    held-out end of the training set and the test set is never loaded into the run."""
    ds = data_lib.load_dataset(
        config.dataset,
        data_dir=config.data_dir,
        limit_train=config.limit_train,
        limit_test=config.limit_test,
        validation=config.validation,
    )
    n_train = ds.train_images.shape[0]
    for split, n in (("training", n_train), ("test", ds.test_images.shape[0])):
        if n == 0:
            raise ValueError(
                f"config.dataset={config.dataset!r} has no {split} examples (data_dir="
                f"{config.data_dir!r}); check the data files."
            )
    if config.batch_size > n_train:
        raise ValueError(f"config.batch_size={config.batch_size} exceeds the {n_train} training examples.")
    return ds, n_train // config.batch_size


def checkpoint_tree(state) -> dict:
    """What a checkpoint holds of a ``TrainState``: step, parameters, BatchNorm statistics, optimiser."""
    return {
        "step": jnp.asarray(state.step, jnp.int32),
        "params": state.params,
        "batch_stats": state.batch_stats if state.batch_stats is not None else {},
        "opt_state": state.opt_state,
    }


def restore_into(state, tree: dict):
    """``state`` with the arrays of a :func:`checkpoint_tree`."""
    return state.replace(
        step=tree["step"],
        params=tree["params"],
        batch_stats=tree["batch_stats"] if state.batch_stats is not None else None,
        opt_state=tree["opt_state"],
    )


def restore_latest(mngr, target: dict, *, check=None, incompatible: str = "") -> tuple[dict, int]:
    """The newest intact checkpoint of ``mngr`` as ``target``'s structure, and the epoch it ends.

    ``check(metadata)`` runs on each step's stored metadata before its arrays are read (raising
    for another run's checkpoint). Newer damaged steps are skipped, each with one warning line on
    stderr, and set aside as ``<step>.damaged`` (:func:`naisnet_jax.checkpoint.set_aside`) so the
    resumed run can save those steps again. The arrays come back as fresh arrays of ``target``'s
    dtypes (the step counter is saved as int32 but counts in int64 under x64), so a program
    compiled for the fresh state runs on them. Intact arrays that do not fit ``target`` (another
    optimiser, say) raise ``ValueError`` ending with ``incompatible``; a directory without an
    intact step raises :class:`naisnet_jax.checkpoint.NoIntactCheckpoint`."""
    try:
        tree, meta, damaged = ckpt.restore_newest(mngr, target=target, check=check)
    except ckpt.CheckpointMismatch as e:
        raise ValueError(f"{e}{incompatible}") from None
    kept = ckpt.set_aside(mngr, [d.step for d in damaged])
    for d, path in zip(damaged, kept):
        print(f"{ckpt.damaged_warning(d, int(meta['step']))} (set aside as {path})", file=sys.stderr, flush=True)
    tree = jax.tree.map(lambda x, like: jnp.asarray(np.asarray(x), like.dtype), tree, target)
    return tree, int(meta["epoch"])


def read_metrics(path) -> list[dict]:
    """The epoch records of a metrics log (``[]`` where there is none)."""
    return metric_writers.read_jsonl(path)


def finite_or_none(value: float):
    """JSON has no NaN: a figure that does not exist (no NAIS block) is logged as null."""
    return value if math.isfinite(value) else None


def rewind(writer, step: int) -> None:
    """Drop what a writer holds after ``step`` (steps a resumed run repeats), if it can."""
    if callable(getattr(writer, "truncate_after", None)):
        writer.truncate_after(step)


def stop_diverged(mngr, what: str):
    """Stop without saving: close the manager, keep the last good checkpoint, raise
    :class:`TrainingDiverged` saying ``what`` happened and where that checkpoint is."""
    good = mngr.latest_step()
    mngr.close()
    raise TrainingDiverged(
        f"{what}; stopped before saving. The last good checkpoint "
        + (f"(step {good}) is kept in {mngr.directory}." if good is not None else "does not exist yet.")
        + " Lower config.learning_rate or check the data."
    )


class LossGrowth:
    """Says once when the training loss passes ``factor`` times ``reference``, the loss of a uniform
    guess (``ln`` of the number of classes): a learning rate far too large can drive the loss to
    1e32 while it stays finite, and nothing else would say so."""

    def __init__(self, reference: float, factor: float = 1e3):
        self.reference, self.factor, self.warned = reference, factor, False

    def watch(self, loss: float) -> str | None:
        """The warning, the first time ``loss`` is over the bound; else ``None``."""
        if self.warned or not math.isfinite(loss) or loss <= self.factor * self.reference:
            return None
        self.warned = True
        return (
            f"warning: the training loss reached {loss:.3g}, more than {self.factor:g} times that of a uniform "
            f"guess ({self.reference:.3g}); config.learning_rate may be too large."
        )


class _NoProgress:
    """The progress bar's interface without a bar: one printed line per ``write``."""

    def update(self, n):
        pass

    def set_postfix(self, **kw):
        pass

    def write(self, s):
        print(s, flush=True)

    def close(self):
        pass


def progress(total: int, enabled: bool, *, unit: str = "step") -> Any:
    """A tqdm bar over ``total`` units on a terminal; redirected (or ``enabled=False``), a line a
    ``write`` and nothing else."""
    if not (enabled and sys.stderr.isatty()):
        return _NoProgress()
    from tqdm.auto import tqdm

    return tqdm(total=total, unit=unit, dynamic_ncols=True, leave=False)
