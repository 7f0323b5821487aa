"""The run protocol: what one run (:func:`naisnet_jax.train.train_and_evaluate`) and a sweep of
seeds (:func:`naisnet_jax.sweep.train_sweep`) share, in one place.

:class:`RunDirectory` owns a run's directory: its lock, its checkpoint manager, the resume check
(one list of fields, :data:`RESUME_FIELDS`, and the stream version), the metrics log and its
rewind, and "the record, then the checkpoint". Both trainers follow it:

- nothing is written before the config, the data and the model are known to be good;
- a resume restores the newest intact checkpoint of the same run (same model up to speed
  options, same data, same seeds) and drops the metrics records of the epochs after it;
- each epoch's records are written (and synced) before its checkpoint, so a crash between the
  two leaves records that resuming drops, never a checkpoint whose epoch has no record;
- checkpoints are keyed by the training step reached in both (``epoch x steps_per_epoch``, counted on
  from the restored checkpoint's step, so the keys grow with the epochs when a resume changes the batch);
- a diverged run stops without saving and keeps its last good checkpoint.

Also here: the checked training data, the checkpoint's tree, the loss watch and the progress bar.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from naisnet_jax import checkpoint as ckpt
from naisnet_jax import data as data_lib
from naisnet_jax import distributed, metric_writers, models
from naisnet_jax.configs import schema

METRICS_FILE = "metrics.jsonl"
CHECKPOINT_DIR = ckpt.RUN_CHECKPOINT_DIR
SWEEP_CHECKPOINT_DIR = ckpt.SWEEP_CHECKPOINT_DIR
LOCK_FILE = ".trainer.lock"
#: What a resumed run may change, and is told in one line that it did (the declaration's ``notice`` fields).
NOTICE_FIELDS = schema.NOTICE_FIELDS
#: What a resumed run must share with the checkpoint it resumes (``model_kwargs`` up to the
#: speed options, :data:`naisnet_jax.models.SPEED_OPTIONS`: same parameters, same maths), and
#: ``seeds``, the run's seeds (``[config.seed]`` for one run).
RESUME_FIELDS = (*schema.RESUME_FIELDS, "seeds")


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""


class RunWriteError(ValueError):
    """A run's metrics log or scalars log that cannot be written (a full disk, say); what was saved before
    is intact."""


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


def resume_view(config, model_kwargs: dict, seeds) -> dict:
    """The values of :data:`RESUME_FIELDS` for ``config`` (``model_kwargs``: the model's
    keyword arguments as built; ``seeds``: the run's seeds), as JSON would read them back."""
    view = {k: config[k] for k in schema.RESUME_FIELDS}
    view.update(model_kwargs=model_kwargs, seeds=[int(s) for s in seeds])
    return json.loads(json.dumps(view))


def _settings(model, kwargs) -> dict:
    """What a resumed run's model must match: :func:`naisnet_jax.models.model_settings` for a
    model of this version, the keyword arguments less the speed options for one it does not know."""
    if model in models.MODELS and isinstance(kwargs, dict):
        return models.model_settings(model, kwargs)
    return models.without_speed_options(kwargs)


def checkpoint_view(meta: dict) -> dict:
    """:func:`resume_view` of the run that wrote a checkpoint, from its stored metadata: the model
    as the metadata rebuilds it, the dataset, the other resume fields of its stored config (a
    field an older version did not store at its declared default), and its seeds
    (``extra["seeds"]``; ``[seed]`` where a checkpoint does not list them)."""
    try:
        model, kwargs = ckpt.CheckpointMetadata.from_json(meta).model_spec()
    except ckpt.CheckpointError:
        model, kwargs = meta.get("model"), meta.get("model_kwargs")
    stored = schema.complete(meta.get("config") or {})
    view = {k: stored[k] for k in schema.RESUME_FIELDS}
    extra = meta.get("extra") or {}
    view.update(
        model=model, model_kwargs=kwargs, dataset=meta.get("dataset"), seeds=extra.get("seeds", [stored["seed"]])
    )
    return json.loads(json.dumps(view))


class RunDirectory:
    """A run's directory, held for the run: ``with RunDirectory(...) as run:``.

    Entering takes the workdir's lock (:func:`workdir_lock`) and opens the checkpoint manager over
    ``<workdir>/<checkpoints>``; leaving closes both. ``view`` (:func:`resume_view`) is what the
    run is; a resume checks it against the checkpoint's (:func:`checkpoint_view`, with the run's
    seeds stored as ``metadata.extra["seeds"]``): :meth:`refuse_another_run` before any data is
    loaded, :meth:`resume` for the step it restores. The metrics log ``<workdir>/metrics.jsonl``
    holds one record per epoch (and seed); :meth:`commit` appends an epoch's records, synced, then
    saves the checkpoint. ``labels`` names a config field as the user set it
    (``{"num_epochs": "--epochs"}``), as :func:`naisnet_jax.configs.schema.validate` does.
    """

    def __init__(
        self,
        workdir: str,
        view: dict,
        *,
        checkpoints: str = CHECKPOINT_DIR,
        keep: int = 3,
        config=None,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        self.workdir, self.view, self.keep = workdir, view, keep
        self.config = config  # its NOTICE_FIELDS are compared with the checkpoint's on resume
        self.labels = dict(labels or {})
        self._checked: dict = {}  # the metadata last checked: the restored step's, after resume
        self.checkpoint_dir = os.path.join(workdir, checkpoints)
        self.metrics_path = os.path.join(workdir, METRICS_FILE)
        self.records: list[dict] = []  # the log's records, as this run holds them
        self.record_keys = ("epoch", "seed") if checkpoints == SWEEP_CHECKPOINT_DIR else ("epoch",)
        self.other_kind = CHECKPOINT_DIR if checkpoints == SWEEP_CHECKPOINT_DIR else SWEEP_CHECKPOINT_DIR
        self._base = (0, 0)  # (epoch, step) of the restored checkpoint: where the keys count on from
        self.mngr = None
        self._lock = None
        self.primary = distributed.is_primary()  # writes the log and prints; every process saves

    def __enter__(self) -> RunDirectory:
        # the primary process holds the lock and checks the directory; every process learns
        # whether it could, and every process opens the manager (Orbax saves from all of them)
        error = None
        if self.primary:
            try:
                self._lock = workdir_lock(self.workdir)
                self._lock.__enter__()
                self.refuse_other_kind()
                read_metrics(self.metrics_path, self.record_keys)  # a log that is not ours: refused, nothing made
                ckpt.check_writable(self.checkpoint_dir)  # before any training: Orbax would hang on it
                ckpt.check_step_entries(self.checkpoint_dir)
            except BaseException as e:  # noqa: BLE001 - re-raised below, after the others know
                self._release()
                error = e
        status = distributed.agree(0 if error is None else 2)
        if error is not None:
            raise error
        if status:
            raise distributed.PeerFailed(status)
        try:
            self.mngr = ckpt.manager(self.checkpoint_dir, max_to_keep=self.keep)
        except BaseException:
            self._release()
            raise
        return self

    def _release(self, *exc) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.__exit__(*(exc or (None, None, None)))

    def __exit__(self, *exc) -> None:
        try:
            self.mngr.close()
        except Exception:  # noqa: BLE001 - a failed save re-raised by Orbax: the error already said it
            if exc[0] is None:
                raise
        finally:
            self._release(*exc)

    def say(self, line: str, *, error: bool = False) -> None:
        """Print ``line`` (to stderr with ``error``) from the primary process only."""
        if self.primary:
            print(line, file=sys.stderr if error else sys.stdout, flush=True)

    def refuse_other_kind(self) -> None:
        """Refuse a workdir that holds the other kind of run (a sweep's ``sweep_checkpoints`` for a
        single run, a single run's ``checkpoints`` for a sweep): both keep their log in
        ``metrics.jsonl``, so the one would take the other's records as its own."""
        path = os.path.join(self.workdir, self.other_kind)
        if os.path.isdir(path) and os.listdir(path):
            kind = "a sweep of seeds" if self.other_kind == SWEEP_CHECKPOINT_DIR else "a single run"
            raise ValueError(
                f"{self.workdir} holds {kind} ({path}), which shares the metrics log {self.metrics_path} "
                f"with this run: use another workdir."
            )

    def refuse(self, meta: dict) -> None:
        """Refuse ``meta``'s checkpoint as a start for this run, in one line that says why."""
        self._checked = meta
        if meta.get("format_version") != ckpt.FORMAT_VERSION:
            raise ValueError(
                f"{self.checkpoint_dir} holds checkpoints of format_version {meta.get('format_version')!r}, "
                f"written before augmentation keys came from the step: resuming would not continue that run "
                f"exactly. Train into another workdir (the checkpoints still load for evaluation and naisnet-verify)."
            )
        theirs = checkpoint_view(meta)

        def same(k):
            if k == "model_kwargs":
                return _settings(theirs.get("model"), theirs.get(k)) == _settings(self.view.get("model"), self.view[k])
            return theirs.get(k) == self.view[k]

        differ = [f"{k}: checkpoint {theirs.get(k)!r}, now {self.view[k]!r}" for k in RESUME_FIELDS if not same(k)]
        if differ:
            raise ValueError(
                f"{self.workdir} holds a run that differs from this one ({'; '.join(differ)}): "
                f"use another workdir, or the checkpoint's settings, to resume."
            )

    def refuse_another_run(self) -> None:
        """Refuse at once, before data is loaded or programs compiled, when the newest
        checkpoint is another run's (a damaged newest step is left to :meth:`resume`)."""
        if self.mngr.latest_step() is None:
            return
        try:
            meta = ckpt.read_metadata(self.mngr)
        except ckpt.CheckpointError:
            return
        self.refuse(meta)

    def resume(self, target: dict) -> tuple[dict, int] | None:
        """The newest intact checkpoint of this run as ``target``'s tree and the epoch it ends
        (``None`` on a fresh start); the metrics log keeps the records of those epochs only."""
        if not self.mngr.all_steps():
            self._rewind(0)
            return None
        tree, epoch = restore_latest(
            self.mngr,
            target,
            check=self.refuse,
            incompatible=": use another workdir, or the checkpoint's config, to resume.",
        )
        self._base = (epoch, int(self._checked["step"]))
        self._rewind(epoch)
        self._notice_changes()
        return tree, epoch

    def _notice_changes(self) -> None:
        """Say in one line which of :data:`NOTICE_FIELDS` the resumed run changes."""
        if self.config is None:
            return
        theirs = self._checked.get("config") or {}
        ours = json.loads(json.dumps({k: self.config[k] for k in NOTICE_FIELDS}))
        changed = [
            f"{k} {ours[k]!r} (the checkpoint's: {theirs[k]!r})"
            for k in NOTICE_FIELDS
            if k in theirs and theirs[k] != ours[k]
        ]
        if changed:
            self.say(f"notice: resuming {self.workdir} with {', '.join(changed)}.", error=True)

    def complete(self, start_epoch: int, num_epochs: int) -> bool:
        """Whether the run has nothing left to train, said in one line when so."""
        if start_epoch <= num_epochs:
            return False
        label = self.labels.get("num_epochs", "config.num_epochs")
        self.say(
            f"{self.workdir} holds a complete run of {start_epoch - 1} epochs ({label}={num_epochs}): "
            f"nothing left to train; raise {label} to train on."
        )
        return True

    def step_reached(self, epoch: int, steps_per_epoch: int) -> int:
        """The key of epoch ``epoch``'s checkpoint: the training steps taken by its end, counted on
        from the restored checkpoint's (``epoch x steps_per_epoch`` while the batch stays the same)."""
        base_epoch, base_step = self._base
        return base_step + (epoch - base_epoch) * steps_per_epoch

    def _rewind(self, epoch: int) -> None:
        """Keep the log's records of epochs ``<= epoch`` (drop those a crash left after the
        checkpoint, and a last line cut short); on a fresh start (``epoch == 0``) an old log is
        kept beside the new one, renamed, and said in one line. The primary process writes the
        log; the others read its records once it has."""
        if not self.primary:
            distributed.agree(0)
            self.records = read_metrics(self.metrics_path, self.record_keys)  # as the primary left it
            return
        try:
            self._rewind_log(epoch)
        except OSError as e:  # a full disk, say: nothing is trained yet, the checkpoints are intact
            raise self.write_failed(f"the metrics log {self.metrics_path}", epoch, e) from None
        distributed.agree(0)

    def _rewind_log(self, epoch: int) -> None:
        records = read_metrics(self.metrics_path, self.record_keys)
        if epoch == 0:
            if records:
                _keep_beside(self.metrics_path, f"holds {len(records)} records of a run without a checkpoint")
            elif os.path.exists(self.metrics_path):
                os.remove(self.metrics_path)  # empty, or one line cut short
            self.records = []
            return
        self.records = [r for r in records if int(r["epoch"]) <= epoch]
        metric_writers.JsonlWriter(self.metrics_path).truncate_after(epoch, key="epoch")

    def commit(self, epoch: int, step: int, records: list[dict], tree: dict | None, metadata) -> None:
        """Append ``records`` (epoch ``epoch``'s) to the log, synced, then, with a ``tree``, save
        it as the checkpoint of ``step``. A log deleted during the run is written anew from the
        records the run holds, with a notice. Every process saves; the primary alone writes the log."""
        if self.primary:
            self._append(epoch, records)
        else:
            self.records.extend(records)
        if tree is not None:
            meta = metadata.replace(epoch=epoch, extra={**dict(metadata.extra), "seeds": self.view["seeds"]})
            ckpt.save(self.mngr, step, tree, meta)

    def _append(self, epoch: int, records: list[dict]) -> None:
        if self.records and not os.path.exists(self.metrics_path):
            print(
                f"notice: {self.metrics_path} was deleted during the run; written anew from the "
                f"{len(self.records)} records this run holds.",
                file=sys.stderr,
                flush=True,
            )
            metric_writers.write_jsonl(self.metrics_path, self.records)
        log = metric_writers.JsonlWriter(self.metrics_path, fsync=True)
        try:
            for record in records:
                log.write_record(record)
            log.close()
        except OSError as e:  # a full disk, say: the checkpoints saved before are intact
            with contextlib.suppress(OSError):
                log.close()
            raise self.write_failed(f"the metrics log {self.metrics_path}", epoch, e) from None
        self.records.extend(records)

    def write_failed(self, what: str, epoch: int, error: OSError) -> RunWriteError:
        """The one-line error of a log ``what`` that could not be written at ``epoch``."""
        return RunWriteError(
            f"cannot write {what} (epoch {epoch}): {error.strerror or error}; the checkpoints in "
            f"{self.checkpoint_dir} are intact, and the same command resumes from the last one."
        )

    def stop_diverged(self, what: str):
        """:func:`stop_diverged` on this run's checkpoints."""
        stop_diverged(self.mngr, what)


class EpochProgram(Protocol):
    """One kind of run's epoch, driven by :func:`run_epochs`: a data-parallel single seed
    (:class:`naisnet_jax.train.DataParallelEpochs`) or seeds side by side
    (:class:`naisnet_jax.sweep.SeedEpochs`)."""

    steps_per_epoch: int
    unit: str  # what the progress bar counts: "step" or "epoch"

    def progress_units(self, epochs: int) -> int:
        """The progress bar's units in ``epochs`` epochs."""

    def train_epoch(self, state, epoch: int, progress) -> tuple[Any, list[dict]]:
        """Train ``epoch``; the new state and the epoch's records (:func:`epoch_record`, one per
        run). A single run that diverges stops here (:meth:`RunDirectory.stop_diverged`)."""

    def saved_tree(self, state) -> dict:
        """What the checkpoint of ``state`` holds."""

    def summary(self, epoch: int, records: list[dict]) -> str:
        """The epoch's line."""


def last_epoch(config, start_epoch: int, stop_after_epochs: int | None) -> int:
    """The last epoch this call trains: ``config.num_epochs``, or fewer with ``stop_after_epochs``
    (which ends a call early, as an interruption would)."""
    if stop_after_epochs is None:
        return config.num_epochs
    return min(config.num_epochs, start_epoch + stop_after_epochs - 1)


def run_epochs(
    run: RunDirectory, program: EpochProgram, state, *, start_epoch: int, end_epoch: int, config, metadata, progress
):
    """The loop of every run: epochs ``start_epoch .. end_epoch`` of ``program``; after each, its
    records and (every ``config.checkpoint_every_epochs`` epochs, and at the last of
    ``config.num_epochs``) its checkpoint, keyed by the step reached (:meth:`RunDirectory.step_reached`), go to ``run``
    (:meth:`RunDirectory.commit`). Returns the final state."""
    for epoch in range(start_epoch, end_epoch + 1):
        try:
            state, records = program.train_epoch(state, epoch, progress)
        except metric_writers.LogWriteError as e:  # the scalars log, on a full disk say
            raise run.write_failed(e.filename, epoch, e) from None
        due = epoch % config.checkpoint_every_epochs == 0 or epoch == config.num_epochs
        tree = program.saved_tree(state) if due else None
        run.commit(epoch, run.step_reached(epoch, program.steps_per_epoch), records, tree, metadata)
        progress.write(program.summary(epoch, records))
    progress.close()
    return state


def epoch_record(
    *, epoch: int, step: int, learning_rate: float, train: dict | None, test: dict, rho_max: float, seconds: float
) -> dict:
    """One run's record of one epoch, the same for a single run and each seed of a sweep:
    ``train`` its mean training ``loss`` and ``accuracy`` over the epoch (``None`` for a seed
    that diverged), ``test`` the evaluation (``loss``, ``accuracy`` and, for a model that stops
    early per pattern, ``depth_mean``/``depth_min``/``depth_max``), ``rho_max`` the largest bound
    on a NAIS block's spectral radius (NaN without one: logged as null)."""
    record = {
        "epoch": int(epoch),
        "step": int(step),
        "learning_rate": float(learning_rate),
        "train_loss": None if train is None else float(train["loss"]),
        "train_accuracy": None if train is None else float(train["accuracy"]),
        "test_loss": finite_or_none(float(test["loss"])),
        "test_accuracy": float(test["accuracy"]),
        "rho_max": finite_or_none(float(rho_max)),
        "epoch_seconds": float(seconds),
    }
    record["generalisation_gap"] = None if train is None else record["train_accuracy"] - record["test_accuracy"]
    for k in ("depth_mean", "depth_min", "depth_max"):
        if k in test:
            record[k] = float(test[k])
    return record


def _keep_beside(path: str, why: str) -> None:
    """Rename the log ``path`` to a free ``<stem>.<n>.jsonl`` beside it, said in one line with ``why``
    it is not this run's: a new run starts a new log and loses none."""
    kept = _free_name(path)
    os.replace(path, kept)
    print(f"notice: {path} {why}; kept as {kept}, and this run starts a new log.", file=sys.stderr, flush=True)


def _free_name(path: str) -> str:
    """``<stem>.<n>.jsonl`` beside ``path``, the first ``n`` not taken."""
    stem, ext = os.path.splitext(path)
    n = 1
    while os.path.exists(f"{stem}.{n}{ext}"):
        n += 1
    return f"{stem}.{n}{ext}"


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
    intact step raises :class:`naisnet_jax.checkpoint.NoIntactCheckpoint`. Of several processes
    (every one restores), the primary one sets the damaged steps aside and says so."""
    try:
        tree, meta, damaged = ckpt.restore_newest(mngr, target=target, check=check)
    except ckpt.CheckpointMismatch as e:
        raise ValueError(f"{e}{incompatible}") from None
    if damaged:
        primary = distributed.is_primary()
        distributed.agree(0)  # every process has read the steps before the primary renames them
        kept = ckpt.set_aside(mngr, [d.step for d in damaged]) if primary else []
        for d, path in zip(damaged, kept):
            print(f"{ckpt.damaged_warning(d, int(meta['step']))} (set aside as {path})", file=sys.stderr, flush=True)
        distributed.agree(0)
        if not primary:
            mngr.reload()
    tree = jax.tree.map(lambda x, like: jnp.asarray(np.asarray(x), like.dtype), tree, target)
    return tree, int(meta["epoch"])


#: The smallest value of each whole-number key of an epoch record (``seed``: a sweep's records).
RECORD_MINIMUM = {"epoch": 1, "seed": 0}


def read_metrics(path, keys: tuple[str, ...] = ("epoch",)) -> list[dict]:
    """The epoch records of a metrics log (``[]`` where there is none); a record that is JSON but
    not an epoch record (an object whose ``keys`` hold whole numbers of at least
    :data:`RECORD_MINIMUM`) is an error naming the file and record."""
    records = metric_writers.read_jsonl(path)
    for number, r in enumerate(records, start=1):
        values = [r.get(k) if isinstance(r, dict) else None for k in keys]
        if not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= RECORD_MINIMUM[k] for k, v in zip(keys, values)
        ):
            wanted = " and ".join(f"a whole {k!r} >= {RECORD_MINIMUM[k]}" for k in keys)
            raise ValueError(
                f"{path}, record {number}: {json.dumps(r)[:80]} is not an epoch record (a JSON object with "
                f"{wanted}); move the file away to resume with a new log."
            )
    return records


def finite_or_none(value: float):
    """JSON has no NaN: a figure that does not exist (no NAIS block) is logged as null."""
    return value if math.isfinite(value) else None


def rewind(writer, step: int) -> None:
    """Drop what a writer holds after ``step`` (steps a resumed run repeats), if it can. On a fresh
    start (``step < 0``) a JSON-lines log that already holds something (a run without a checkpoint,
    or a file of the user's) is kept beside the new one, renamed, and said in one line, as the
    metrics log is: nothing a run did not write is emptied."""
    if step < 0:
        for w in getattr(writer, "writers", [writer]):
            if isinstance(w, metric_writers.JsonlWriter) and os.path.isfile(w.path) and os.path.getsize(w.path):
                w.close()
                _keep_beside(w.path, "was there before this run, which has no checkpoint")
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


class LineProgress:
    """The progress bar's interface off a terminal (a log file, a batch job): a line on stderr
    whenever ``interval`` seconds have passed since the last one (``done/total units (pct%)``
    and the last ``set_postfix`` values), and each ``write`` on stdout; with ``quiet``, nothing."""

    def __init__(self, total: int = 0, unit: str = "step", *, interval: float = 30.0, quiet: bool = False):
        self.total, self.unit, self.interval, self.quiet = total, unit, interval, quiet
        self.done, self.postfix, self.last = 0, {}, time.monotonic()

    def update(self, n):
        self.done += n
        now = time.monotonic()
        if self.quiet or now - self.last < self.interval:
            return
        self.last = now
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        extra = "".join(f", {k} {v}" for k, v in self.postfix.items())
        print(f"{self.done}/{self.total} {self.unit}s{share}{extra}", file=sys.stderr, flush=True)

    def set_postfix(self, **kw):
        self.postfix = kw

    def write(self, s):
        if not self.quiet:
            print(s, flush=True)

    def close(self):
        pass


def progress(total: int, enabled: bool, *, unit: str = "step", quiet: bool = False) -> Any:
    """With ``enabled``, a tqdm bar over ``total`` units on a terminal and, redirected, a
    :class:`LineProgress` (a line every 30 s); without, only each ``write``; ``quiet``, nothing."""
    if quiet or not enabled:
        return LineProgress(total, unit, interval=math.inf, quiet=quiet)
    if not sys.stderr.isatty():
        return LineProgress(total, unit)
    from tqdm.auto import tqdm

    return tqdm(total=total, unit=unit, dynamic_ncols=True, leave=False)
