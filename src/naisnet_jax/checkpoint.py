"""Orbax checkpoints with metadata and an integrity digest.

A checkpoint directory is an Orbax ``CheckpointManager`` directory: one
sub-directory per saved step, each with two items:

* ``state``: the array tree (``params``, ``batch_stats``, ``opt_state``, ...),
  written by Orbax's standard (tensorstore/OCDBT) handler — no pickle;
* ``metadata``: JSON saying what the checkpoint holds: ``format``
  (``"naisnet-jax"``), the model name and keyword arguments, the training
  config, the epoch, and a SHA-256 ``digest`` of every array of ``state``.

Restoring checks the format and the digest before anything is returned, so a
corrupt or foreign checkpoint is refused as a whole, never half-loaded.
Training writes through this module and the verifier reads through it; neither
imports the other.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import jax
import numpy as np

FORMAT = "naisnet-jax"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, or not a naisnet-jax checkpoint."""


def _ocp():
    import orbax.checkpoint as ocp  # heavy import, only where checkpoints are used

    return ocp


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


def manager(directory: str, *, max_to_keep: int = 3, create: bool = True):
    """An Orbax ``CheckpointManager`` over ``directory`` with our two items."""
    ocp = _ocp()
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=create)
    return ocp.CheckpointManager(
        os.path.abspath(directory), options=options, item_names=("state", "metadata")
    )


def save(mngr, step: int, state: Any, metadata: dict) -> None:
    """Save ``state`` (array tree) and ``metadata`` (JSON-able dict) at ``step``.

    Blocks until the write is committed, so a crash after ``save`` returns
    never loses this checkpoint.
    """
    ocp = _ocp()
    state = jax.device_get(state)
    meta = dict(metadata)
    meta.update(format=FORMAT, format_version=FORMAT_VERSION, step=int(step), digest=tree_digest(state))
    json.dumps(meta)  # fail here, before writing, if metadata is not JSON
    mngr.save(
        int(step),
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), metadata=ocp.args.JsonSave(meta)
        ),
        force=True,
    )
    mngr.wait_until_finished()


def _read_metadata(mngr, step: int, where: str) -> dict:
    ocp = _ocp()
    try:
        meta = mngr.restore(step, args=ocp.args.Composite(metadata=ocp.args.JsonRestore()))["metadata"]
    except Exception as e:  # noqa: BLE001 - any failure means unusable
        raise CheckpointError(f"{where}: cannot read the checkpoint metadata ({type(e).__name__}: {e}).") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{where} is not a {FORMAT} checkpoint (metadata format={meta.get('format') if isinstance(meta, dict) else meta!r}).")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{where}: checkpoint format_version={meta.get('format_version')!r}, this code reads {FORMAT_VERSION}."
        )
    return meta


def read_metadata(mngr, step: int | None = None) -> dict:
    """The metadata of ``step`` (default: the latest); raises :class:`CheckpointError`."""
    if step is None:
        step = mngr.latest_step()
        if step is None:
            raise CheckpointError(f"{mngr.directory}: no checkpoint found.")
    return _read_metadata(mngr, step, f"{mngr.directory} (step {step})")


def restore(mngr, step: int | None = None, *, target: Any = None) -> tuple[Any, dict]:
    """Restore ``(state, metadata)`` at ``step`` (default: the latest).

    ``target`` is a tree of arrays (or ``jax.ShapeDtypeStruct``) with the
    expected structure; without it the stored structure is returned with
    numpy-convertible arrays. Raises :class:`CheckpointError` when there is no
    checkpoint, when it cannot be read, or when its digest does not match.
    """
    ocp = _ocp()
    where = str(mngr.directory)
    if step is None:
        step = mngr.latest_step()
        if step is None:
            raise CheckpointError(f"{where}: no checkpoint found.")
    meta = _read_metadata(mngr, step, f"{where} (step {step})")
    if target is not None:
        target = jax.tree.map(lambda x: ocp.utils.to_shape_dtype_struct(jax.numpy.asarray(x)), target)
    try:
        state = mngr.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))
        )["state"]
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(
            f"{where} (step {step}): the checkpoint's arrays cannot be read "
            f"({type(e).__name__}: {e}); it is corrupt or incomplete."
        ) from e
    digest = tree_digest(state)
    if digest != meta.get("digest"):
        raise CheckpointError(
            f"{where} (step {step}): the arrays do not match the digest recorded when the "
            f"checkpoint was written; it is corrupt."
        )
    return state, meta


def latest_step(directory: str) -> int | None:
    """Latest saved step in ``directory`` (None if none)."""
    if not os.path.isdir(directory):
        return None
    return manager(directory, create=False).latest_step()


def load(path: str, step: int | None = None) -> tuple[dict, dict]:
    """Read a checkpoint for inspection: ``(state, metadata)`` with numpy arrays.

    ``path`` is a checkpoint directory written by training (the latest step is
    read) or one of its step sub-directories. Raises :class:`CheckpointError`
    for anything that is not a complete naisnet-jax checkpoint.
    """
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory.")
    base = os.path.basename(path.rstrip("/"))
    if step is None and base.isdigit() and os.path.isdir(os.path.join(path, "state")):
        path, step = os.path.dirname(path), int(base)
    try:
        mngr = manager(path, create=False)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{path}: not a checkpoint directory ({type(e).__name__}: {e}).") from e
    try:
        if not mngr.all_steps():
            raise CheckpointError(f"{path}: no checkpoint steps found (not a {FORMAT} checkpoint directory).")
        state, meta = restore(mngr, step)
    finally:
        mngr.close()
    return jax.tree.map(np.asarray, state), meta
