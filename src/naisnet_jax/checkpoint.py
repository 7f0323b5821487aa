"""Orbax checkpoints with metadata and an integrity digest.

A checkpoint directory is an Orbax ``CheckpointManager`` directory: one
sub-directory per saved step, each with two items:

* ``state``: the array tree (``params``, ``batch_stats``, ``opt_state``, ...),
  written by Orbax's PyTree (tensorstore/OCDBT) handler in the layout of its standard handler,
  with a type-handler registry of this module's own (:func:`type_handler_registry`) — no pickle;
* ``metadata``: JSON saying what the checkpoint holds, written from one
  validated :class:`CheckpointMetadata` (model name and keyword arguments,
  eps / eta / h stored once, dataset and its normalisation, the training
  config, the epoch) plus ``format`` (``"naisnet-jax"``), a SHA-256
  ``digest`` of every array of ``state`` and a ``metadata_digest`` of the metadata itself.

Restoring checks the format and both digests before anything is returned, so a
corrupt or foreign checkpoint is refused as a whole, never half-loaded. Without
a step, restoring takes the newest *intact* step: damaged newer steps are
skipped with a one-line warning each (:class:`DamagedStep` says why), and a
directory with no intact step is refused (:class:`NoIntactCheckpoint`).
Training writes through this module and the verifier reads through it; neither
imports the other.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from typing import Any

import jax
import numpy as np

from naisnet_jax import distributed
from naisnet_jax.checkpoint_metadata import METADATA_VERSION as METADATA_VERSION
from naisnet_jax.checkpoint_metadata import CheckpointError, CheckpointMetadata
from naisnet_jax.checks import check_int

FORMAT = "naisnet-jax"
#: 2: a training run's augmentation keys come from the step (``fold_in(epoch_key, step)``); 1 split
#: them from the key of the step's chunk. The arrays and metadata are alike: both load for
#: evaluation and the verifier, but only a version-2 checkpoint resumes training
#: (:class:`naisnet_jax.engine.RunDirectory`), since version 1 continues another random stream.
FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = (1, 2)
#: Where a training run keeps its checkpoint directory, inside its workdir.
RUN_CHECKPOINT_DIR = "checkpoints"
#: A sweep's checkpoints (:mod:`naisnet_jax.sweep`), beside its per-seed ``seed_<s>/checkpoints``.
SWEEP_CHECKPOINT_DIR = "sweep_checkpoints"


class DamagedStep(CheckpointError):
    """One step of a checkpoint directory that cannot be used: unreadable, truncated, not a
    naisnet-jax checkpoint, or arrays that do not match their digest. ``reason`` is one short
    line."""

    def __init__(self, directory, step: int, reason: str):
        self.directory, self.step, self.reason = str(directory), int(step), reason
        super().__init__(f"{self.directory} (step {self.step}): {reason}")


class NoIntactCheckpoint(CheckpointError):
    """Every step of a checkpoint directory is damaged; ``damaged`` lists them, newest first."""

    def __init__(self, directory, damaged: tuple[DamagedStep, ...]):
        self.directory, self.damaged = str(directory), tuple(damaged)
        steps = "; ".join(f"step {d.step}: {d.reason}" for d in self.damaged)
        super().__init__(
            f"{self.directory} holds no intact checkpoint ({steps}); restore it from a copy, or use another directory."
        )


class CheckpointMismatch(CheckpointError):
    """An intact checkpoint whose arrays do not fit the tree asked for (another model or optimiser)."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint that cannot be written (the directory is a file, read-only, or the disk is
    full); the steps already saved are intact."""


def check_writable(directory: str, what: str = "") -> None:
    """Make sure ``directory`` exists and takes a new entry (a probe directory made and removed),
    before Orbax is asked to write there: its background writers wait minutes on a directory they
    cannot create. Raises :class:`CheckpointWriteError` in one line naming the directory, ``what``
    was to be written and the cause."""
    import tempfile

    where = f"{directory}{what}"
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CheckpointWriteError(f"cannot write checkpoints to {where}: it is a file, not a directory.")
    try:
        os.makedirs(directory, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=".write-probe-", dir=directory))
    except OSError as e:
        raise CheckpointWriteError(f"cannot write checkpoints to {where}: {e.strerror or e}.") from None


def check_step_entries(directory: str) -> None:
    """Refuse a checkpoint directory where a step's name holds something other than a directory
    (a file named ``132``, say): Orbax does not see it as a step and would write that step over it.
    Raises :class:`CheckpointWriteError` in one line naming the entry."""
    if not os.path.isdir(directory):
        return
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name.isdigit() and not os.path.isdir(path):
            raise CheckpointWriteError(
                f"{path} is not a checkpoint directory but sits where step {name}'s checkpoint would be "
                f"written: move it out of {directory} to train there."
            )


REASON_CHARS = 160  # a damaged step's reason is cut to its first line and this many characters


def short_reason(error: BaseException | str) -> str:
    """``error`` in one short line: its type and the first line of its message, without the
    TensorStore spec some errors append, at most :data:`REASON_CHARS` characters."""
    text = str(error).strip()
    text = text.split(" See full TensorStore details", 1)[0]
    text = text.splitlines()[0].strip() if text else ""
    if isinstance(error, BaseException):
        text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 3].rstrip() + "..."


class _OrbaxRecords(logging.Filter):
    """Drops the log records that Orbax's own code emits (found on the calling stack)."""

    def filter(self, record: logging.LogRecord) -> bool:
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_globals.get("__name__", "").startswith("orbax."):
                return False
            frame = frame.f_back
        return True


def quiet_orbax_logging() -> None:
    """Keep Orbax's log lines off stderr: for the commands, which say themselves what a user
    must know (a damaged step in one warning line, an unusable checkpoint in one error line).

    Orbax logs through absl: every save at INFO, and at WARNING or ERROR a step's bookkeeping
    file (``_CHECKPOINT_METADATA``, timestamps) that is missing or unreadable, although the step
    restores whole. Other absl records pass as before, and every failure still raises."""
    absl_logger = logging.getLogger("absl")
    if not any(isinstance(f, _OrbaxRecords) for f in absl_logger.filters):
        absl_logger.addFilter(_OrbaxRecords())


def _ocp():
    import orbax.checkpoint as ocp  # heavy import, only where checkpoints are used

    return ocp


def type_handler_registry():
    """A new Orbax ``TypeHandlerRegistry`` of our own, for the arrays of :func:`save`: numpy arrays
    and scalars written by Orbax's ``NumpyHandler`` and ``ScalarHandler`` made to settle their
    failed writes (:class:`_SettledWrites`), and every other type Orbax supports by the handler
    Orbax's own registry holds for it (read, never changed). The handlers' ``typestr`` are Orbax's
    (``np.ndarray``, ``scalar``), so what is written, and how it is read, is Orbax's format.

    The settling overrides Orbax's private ``NumpyHandler._background_serialize`` (Orbax has no
    public hook into how a handler awaits its writes); an Orbax without that method gets plain
    ``NumpyHandler`` / ``ScalarHandler`` here, and a full disk may then print Orbax's tracebacks
    after the error line."""
    handlers = _ocp().type_handlers
    numpy_cls, scalar_cls = handlers.NumpyHandler, handlers.ScalarHandler
    if hasattr(numpy_cls, "_background_serialize"):
        numpy_cls, scalar_cls = (
            type(f"Settled{cls.__name__}", (_SettledWrites, cls), {"__module__": __name__})
            for cls in (numpy_cls, scalar_cls)
        )
    ours = {np.ndarray: numpy_cls(), **dict.fromkeys((int, float, bytes, np.number), scalar_cls())}
    return handlers.create_type_handler_registry(
        *((ty, ours[ty] if ty in ours else handlers.get_type_handler(ty)) for ty in handlers.supported_types())
    )


class _SettledWrites:
    """Mixin for Orbax's ``NumpyHandler`` and ``ScalarHandler``: every array of a step is written
    as before, through Orbax's own code, but a failed write's error is raised only once all of
    them have finished.

    Orbax writes a step's arrays at once (``asyncio.gather``) in an event loop of its own, and
    closes that loop as soon as one write fails (a full disk): the writes still in flight in
    TensorStore then finish into the closed loop, and each prints a ``RuntimeError: Event loop is
    closed`` traceback (with ``Future exception was never retrieved`` for the failures nobody
    awaited), after the run's one error line. Waiting for all of them, the loop closes with nothing
    in flight, and the first error is raised as Orbax raised it. Used only in the registry of
    :func:`type_handler_registry`, never in Orbax's global one."""

    async def _background_serialize(self, values, infos, args=None):
        import asyncio

        write_one = super()._background_serialize
        args = args if args is not None else [None] * len(values)
        results = await asyncio.gather(
            *(write_one([v], [i], [a]) for v, i, a in zip(values, infos, args)), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result


def _path_name(path) -> str:
    """A path string that ignores container types (dict key, attribute, index
    all print the same), so a tree restored as plain dicts and lists digests
    like the NamedTuples it was saved from."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def tree_digest(tree: Any) -> str:
    """SHA-256 over every array leaf: its path, dtype, shape and bytes."""
    h = hashlib.sha256()
    leaves = [(_path_name(p), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]
    for name, leaf in sorted(leaves, key=lambda kv: kv[0]):
        arr = np.ascontiguousarray(np.asarray(leaf))
        h.update(name.encode())
        h.update(str(arr.dtype).encode())
        h.update(str(arr.shape).encode())
        h.update(arr.tobytes())
    return h.hexdigest()


#: The metadata's own digest, stored beside it (checkpoints written before it existed have none
#: and are read as before: their arrays' digest is still checked).
METADATA_DIGEST = "metadata_digest"


def metadata_digest(meta: dict) -> str:
    """SHA-256 of ``meta``'s JSON (keys sorted, :data:`METADATA_DIGEST` left out): the digest of
    what was written equals that of what is read back."""
    body = {k: v for k, v in meta.items() if k != METADATA_DIGEST}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def manager(directory: str, *, max_to_keep: int = 3, create: bool = True):
    """An Orbax ``CheckpointManager`` over ``directory`` with our two items: ``state`` by Orbax's
    ``PyTreeCheckpointHandler`` over this manager's own :func:`type_handler_registry` registry (save and
    restore it with ``PyTreeSave`` / ``PyTreeRestore``), ``metadata`` by Orbax's
    ``JsonCheckpointHandler``. Orbax's global registries are not changed. A step's Orbax bookkeeping
    (``_CHECKPOINT_METADATA``) names the PyTree handler for ``state`` where checkpoints written
    with Orbax's standard handler name that one; the arrays and their metadata are alike, and
    each reads the other's."""
    ocp = _ocp()
    items = ocp.handlers.DefaultCheckpointHandlerRegistry()
    state = ocp.PyTreeCheckpointHandler(type_handler_registry=type_handler_registry())
    items.add("state", ocp.args.PyTreeSave, state)
    items.add("state", ocp.args.PyTreeRestore, state)
    metadata = ocp.JsonCheckpointHandler()
    items.add("metadata", ocp.args.JsonSave, metadata)
    items.add("metadata", ocp.args.JsonRestore, metadata)
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=create)
    return ocp.CheckpointManager(os.path.abspath(directory), options=options, handler_registry=items)


def save(mngr, step: int, state: Any, metadata: CheckpointMetadata) -> None:
    """Save ``state`` (array tree) and its :class:`CheckpointMetadata` at ``step``.

    The stored metadata gets ``step`` and the ``digest`` of ``state``. Blocks
    until the write is committed, so a crash after ``save`` returns never
    loses this checkpoint.
    """
    ocp = _ocp()
    if not isinstance(metadata, CheckpointMetadata):
        raise TypeError(
            f"metadata must be a CheckpointMetadata (e.g. CheckpointMetadata.from_config(config, dataset, mean, "
            f"std)); got {type(metadata).__name__}"
        )
    state = distributed.gather(state)  # whole on every process; Orbax writes it from the primary
    # ... as numpy arrays (a numpy scalar as a 0-d array): the value types Orbax's standard handler
    # stored, so its checkpoints and ours are alike (tests/test_checkpoint.py compares them)
    meta = metadata.replace(step=int(step), digest=tree_digest(state)).to_json()
    meta.update(format=FORMAT, format_version=FORMAT_VERSION)
    meta[METADATA_DIGEST] = metadata_digest(meta)  # JSON writes a tuple as the list read back
    check_writable(str(mngr.directory), f" (step {int(step)})")
    try:
        mngr.save(
            int(step),
            args=ocp.args.Composite(state=ocp.args.PyTreeSave(state), metadata=ocp.args.JsonSave(meta)),
            force=True,
        )
        mngr.wait_until_finished()
    except Exception as e:  # noqa: BLE001 - a full disk, say (an OSError, or TensorStore's ValueError)
        reason = e.strerror if isinstance(e, OSError) and e.strerror else short_reason(e)
        raise CheckpointWriteError(
            f"cannot write checkpoints to {mngr.directory} (step {int(step)}): {reason}; the steps saved before "
            f"are intact."
        ) from None


def _read_metadata(mngr, step: int) -> dict:
    """The metadata of ``step``, format checked; raises :class:`DamagedStep`."""
    ocp = _ocp()
    try:
        meta = mngr.restore(step, args=ocp.args.Composite(metadata=ocp.args.JsonRestore()))["metadata"]
    except Exception as e:  # noqa: BLE001 - any failure means unusable
        raise DamagedStep(mngr.directory, step, f"cannot read the checkpoint metadata ({short_reason(e)})") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else meta
        raise DamagedStep(mngr.directory, step, f"not a {FORMAT} checkpoint (metadata format={found!r})")
    if meta.get("format_version") not in READABLE_FORMAT_VERSIONS:
        raise DamagedStep(
            mngr.directory,
            step,
            f"checkpoint format_version={meta.get('format_version')!r}, this code reads "
            f"{' and '.join(map(str, READABLE_FORMAT_VERSIONS))}",
        )
    if METADATA_DIGEST in meta and meta[METADATA_DIGEST] != metadata_digest(meta):
        raise DamagedStep(
            mngr.directory,
            step,
            "the metadata does not match the digest recorded when the checkpoint was written; it is corrupt",
        )
    return meta


def _check_array_store(state_dir: str) -> None:
    """Read every array of a step's OCDBT store, one after the other, and wait for each read.

    Orbax reads all arrays at once; when one read fails it returns at once and closes its event
    loop, and the reads still in flight then print ``RuntimeError: Event loop is closed``
    tracebacks as they finish. Reading first, one array at a time, a damaged store fails here
    with nothing left in flight, and Orbax only ever reads a store that reads whole. Raises
    TensorStore's error. A store whose Orbax metadata cannot be read, or that is not OCDBT, is
    left to Orbax (which refuses the former before it reads any array).
    """
    try:
        with open(os.path.join(state_dir, "_METADATA")) as f:
            layout = json.load(f)
    except (OSError, ValueError):
        return
    if not isinstance(layout, dict) or not layout.get("use_ocdbt", False):
        return
    import tensorstore as ts  # Orbax's storage layer

    base = {"driver": "ocdbt", "base": "file://" + os.path.abspath(state_dir) + "/"}
    store = ts.KvStore.open(base).result()
    suffix, driver = (b"/zarr.json", "zarr3") if layout.get("use_zarr3") else (b"/.zarray", "zarr")
    names = sorted(key[: -len(suffix)].decode() for key in store.list().result() if key.endswith(suffix))
    if not names:
        raise ValueError("the array store lists no arrays")
    for name in names:
        ts.open({"driver": driver, "kvstore": {**base, "path": name + "/"}}, open=True).result().read().result()


def _few(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _fit(tree: Any, target: Any, where: str) -> Any:
    """``tree``'s arrays in ``target``'s structure and dtypes, matched by path (container types
    ignored, as in :func:`tree_digest`); :class:`CheckpointMismatch` names the first array that
    is missing, unexpected or of another shape."""
    stored = {_path_name(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
    wanted, treedef = jax.tree_util.tree_flatten_with_path(target)
    names = [_path_name(p) for p, _ in wanted]
    missing = [name for name in names if name not in stored]
    extra = sorted(set(stored) - set(names))
    if missing or extra:
        parts = ([f"it lacks {_few(missing)}"] if missing else []) + ([f"it also holds {_few(extra)}"] if extra else [])
        raise CheckpointMismatch(f"{where}: the checkpoint's arrays are not the ones expected ({'; '.join(parts)})")
    leaves = []
    for name, (_, like) in zip(names, wanted):
        value, shape = np.asarray(stored[name]), tuple(np.shape(like))
        if value.shape != shape:
            raise CheckpointMismatch(
                f"{where}: the checkpoint's {name} has shape {value.shape}, where {shape} is expected"
            )
        dtype = like.dtype if hasattr(like, "dtype") else np.asarray(like).dtype
        leaves.append(value.astype(dtype, copy=False))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _restore_step(mngr, step: int, *, target: Any = None, check=None) -> tuple[Any, dict]:
    """``(state, metadata)`` of one step: metadata read and format checked, ``check(metadata)``
    called, every array read and the digest compared; then, with ``target``, fitted to it.
    Raises :class:`DamagedStep` for a step that cannot be used whole."""
    ocp = _ocp()
    meta = _read_metadata(mngr, step)
    if check is not None:
        check(meta)
    try:
        _check_array_store(os.path.join(str(mngr.directory), str(step), "state"))
        state = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore()))["state"]
    except Exception as e:  # noqa: BLE001
        raise DamagedStep(
            mngr.directory,
            step,
            f"the checkpoint's arrays cannot be read ({short_reason(e)}); it is corrupt or incomplete",
        ) from e
    if tree_digest(state) != meta.get("digest"):
        raise DamagedStep(
            mngr.directory,
            step,
            "the arrays do not match the digest recorded when the checkpoint was written; it is corrupt",
        )
    if target is not None:
        state = _fit(state, target, f"{mngr.directory} (step {step})")
    return state, meta


def _steps_newest_first(mngr) -> list[int]:
    steps = sorted(mngr.all_steps(), reverse=True)
    if not steps:
        raise CheckpointError(f"{mngr.directory}: no checkpoint found.")
    return steps


def read_metadata(mngr, step: int | None = None) -> dict:
    """The metadata of ``step`` (default: the newest step whose metadata reads); raises
    :class:`CheckpointError` (:class:`NoIntactCheckpoint` when no step's metadata reads)."""
    if step is not None:
        return _read_metadata(mngr, step)
    damaged = []
    for s in _steps_newest_first(mngr):
        try:
            return _read_metadata(mngr, s)
        except DamagedStep as e:
            damaged.append(e)
    raise NoIntactCheckpoint(mngr.directory, damaged)


def restore_newest(mngr, *, target: Any = None, check=None) -> tuple[Any, dict, tuple[DamagedStep, ...]]:
    """The newest intact step of ``mngr``: ``(state, metadata, damaged)``, where ``damaged`` are
    the newer steps skipped (:class:`DamagedStep`, newest first; a trainer resuming here should
    :func:`set_aside` them before it saves those steps again).

    ``check(metadata)`` runs on each step's metadata before its arrays are read: what it raises
    (another run's checkpoint) ends the search. ``target`` as for :func:`restore`. Raises
    :class:`NoIntactCheckpoint` when every step is damaged, :class:`CheckpointError` when there
    is none, :class:`CheckpointMismatch` when the arrays do not fit ``target``.
    """
    damaged = []
    for step in _steps_newest_first(mngr):
        try:
            state, meta = _restore_step(mngr, step, target=target, check=check)
        except DamagedStep as e:
            damaged.append(e)
            continue
        return state, meta, tuple(damaged)
    raise NoIntactCheckpoint(mngr.directory, damaged)


def damaged_warning(damaged: DamagedStep, used: int) -> str:
    """The one line that says a damaged step was skipped for step ``used``."""
    return (
        f"warning: checkpoint step {damaged.step} in {damaged.directory} is damaged ({damaged.reason}); "
        f"using step {used}"
    )


def restore(mngr, step: int | None = None, *, target: Any = None) -> tuple[Any, dict]:
    """Restore ``(state, metadata)`` at ``step`` (default: the newest intact step, with one
    warning line on stderr per damaged newer step; see :func:`restore_newest`).

    ``target`` is a tree of arrays (or ``jax.ShapeDtypeStruct``) with the
    expected structure; the arrays come back in its structure and dtypes. Without it the
    stored structure is returned with numpy arrays. Raises :class:`CheckpointError` when there
    is no checkpoint, when it cannot be read, when its digest does not match
    (:class:`DamagedStep`; :class:`NoIntactCheckpoint` without ``step``), or when the arrays do
    not fit ``target`` (:class:`CheckpointMismatch`).
    """
    if step is not None:
        return _restore_step(mngr, step, target=target)
    state, meta, damaged = restore_newest(mngr, target=target)
    for d in damaged:
        print(damaged_warning(d, int(meta["step"])), file=sys.stderr, flush=True)
    return state, meta


DAMAGED_SUFFIX = ".damaged"


def set_aside(mngr, steps) -> list[str]:
    """Rename the directories of ``steps`` to ``<step>.damaged`` (``.damaged-2``, ... when taken),
    where Orbax no longer sees them, and return the new paths: a trainer that resumes from an
    older step saves these step numbers again, and keeps what was there for inspection."""
    moved = []
    for step in steps:
        source = os.path.join(str(mngr.directory), str(step))
        target, n = source + DAMAGED_SUFFIX, 1
        while os.path.exists(target):
            n += 1
            target = f"{source}{DAMAGED_SUFFIX}-{n}"
        os.rename(source, target)
        moved.append(target)
    if moved:
        mngr.reload()
    return moved


def latest_step(directory: str) -> int | None:
    """Latest saved step in ``directory`` (None if none)."""
    if not os.path.isdir(directory):
        return None
    mngr = manager(directory, create=False)
    try:
        return mngr.latest_step()
    finally:
        mngr.close()


def run_checkpoint_dir(path: str) -> str | None:
    """``path/checkpoints`` when ``path`` is a training run's workdir (it holds that directory
    and no checkpoint step of its own), else ``None``."""
    inner = os.path.join(path, RUN_CHECKPOINT_DIR)
    if not os.path.isdir(inner):
        return None
    try:
        if any(name.isdigit() for name in os.listdir(path)):
            return None  # a checkpoint directory whose steps sit beside a folder named checkpoints
    except OSError:
        return None
    return inner


def load(path: str, step: int | None = None) -> tuple[dict, dict]:
    """Read a checkpoint for inspection: ``(state, metadata)`` with numpy arrays.

    ``path`` is a checkpoint directory written by training (its newest intact step is read,
    with a warning line per damaged newer step) or one of its step sub-directories. Raises
    :class:`CheckpointError` for anything that is not a complete naisnet-jax checkpoint.
    """
    path = os.path.abspath(path)
    if os.path.isfile(path):
        raise CheckpointError(
            f"{path} is a file; expected a checkpoint directory (a workdir's checkpoints/ or one step's directory)."
        )
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory.")
    base = os.path.basename(path.rstrip("/"))
    if step is None and base.isdigit() and os.path.isdir(os.path.join(path, "state")):
        path, step = os.path.dirname(path), int(base)
    try:
        mngr = manager(path, create=False)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{path}: not a checkpoint directory ({short_reason(e)}).") from e
    try:
        steps = sorted(mngr.all_steps())
        if not steps:
            raise CheckpointError(f"{path}: no checkpoint steps found (not a {FORMAT} checkpoint directory).")
        if step is not None and step not in steps:
            check_int("step", step, minimum=0)
            raise CheckpointError(f"{path} has no step {step}; its steps: {steps}.")
        state, meta = restore(mngr, step)
    finally:
        mngr.close()
    return jax.tree.map(np.asarray, state), meta
