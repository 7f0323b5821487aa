"""Metric writers: anything with ``write_scalars(step, scalars)`` (CLU's interface).

:func:`naisnet_jax.train.train_and_evaluate` sends its scalars to one writer:

- every chunk of train steps: ``train/loss``, ``train/accuracy``,
  ``train/learning_rate`` (of the chunk's last step) and ``train/steps_per_second``;
- every epoch: ``epoch/<field>`` for each field of the epoch's record (test loss and
  accuracy, ``rho_max``, depth statistics, ...).

:class:`JsonlWriter` (the default, ``WORKDIR/scalars.jsonl``) appends one JSON line
per call; :class:`TensorBoardWriter` writes TensorBoard event files through
``tensorboardX`` (``pip install 'naisnet-jax[tensorboard]'``, no TensorFlow);
:class:`MultiWriter` sends to several. A CLU ``MetricWriter`` works as is. Writers
open their files on the first write, so a run refused at start writes nothing.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

from naisnet_jax.checks import check_real

SCALARS_FILE = "scalars.jsonl"
TENSORBOARD_DIR = "tensorboard"


class LogWriteError(OSError):
    """A log file that cannot be written (a full disk, say); ``filename`` names it."""


@runtime_checkable
class MetricWriter(Protocol):
    """What :func:`~naisnet_jax.train.train_and_evaluate` needs of a writer."""

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None: ...


def _scalar(name: str, value: Any) -> float | None:
    """``value`` as a JSON-safe float (``None`` for NaN / inf, which JSON cannot hold)."""
    value = check_real(f"scalar {name!r}", value)
    return value if math.isfinite(value) else None


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The records of a JSONL file; a last line cut short by a crash (no newline) is
    ignored, any other unreadable line is an error naming the file and line."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().split("\n")
    records = []
    for number, line in enumerate(lines[:-1], start=1):  # lines[-1]: after the last "\n"
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}, line {number}: not a JSON record ({e}).") from None
    return records


def write_jsonl(path: str | os.PathLike, records) -> None:
    """Replace ``path`` with ``records``, one JSON line each, atomically (a crash leaves
    the old file or the new one, never a mix; a failed write removes its temporary file)."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            for r in records:
                f.write(json.dumps(dict(r), allow_nan=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, say: the old file stays, and no half-written copy beside it
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


class JsonlWriter:
    """Appends ``{"step": step, **scalars}`` as one JSON line per call to ``path``.

    Non-finite values are written as ``null`` (strict JSON). ``fsync=True`` makes
    every line durable before the call returns (the epoch log, whose records a
    resumed run relies on).
    """

    def __init__(self, path: str | os.PathLike, *, fsync: bool = False):
        self.path = os.fspath(path)
        self.fsync = fsync
        self._file = None

    def _open(self):
        if self._file is None:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._file = open(self.path, "a")
        return self._file

    def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        record = {"step": int(step)}
        for name, value in scalars.items():
            record[name] = value if isinstance(value, (int, bool)) or value is None else _scalar(name, value)
        self.write_record(record)

    def write_record(self, record: Mapping[str, Any]) -> None:
        """Append ``record`` as is (it must be strict JSON)."""
        line = json.dumps(dict(record), allow_nan=False) + "\n"
        try:
            f = self._open()
            f.write(line)
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
        except OSError as e:
            # the file is closed at once, its unwritten line dropped: left open, it would fail
            # again when it is collected, printing a traceback after the run's error line
            if self._file is not None:
                with contextlib.suppress(OSError):
                    self._file.close()
                self._file = None
            raise LogWriteError(e.errno, e.strerror, self.path) from None

    def truncate_after(self, step: int, *, key: str = "step") -> None:
        """Drop the records whose ``key`` is after ``step`` (written before a crash that a
        resumed run repeats) and a last line cut short; rewrites the file atomically, and only
        when there is something to drop."""
        self.close()
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            text = f.read()
        records = read_jsonl(self.path)
        keep = [r for r in records if int(r.get(key, 0)) <= step]
        if len(keep) == len(records) and (not text or text.endswith("\n")):
            return
        write_jsonl(self.path, keep)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class TensorBoardWriter:
    """TensorBoard event files in ``logdir`` through ``tensorboardX`` (no TensorFlow).

    Construction only checks that ``tensorboardX`` is installed; the event file is
    created on the first write.
    """

    def __init__(self, logdir: str | os.PathLike):
        try:
            import tensorboardX  # noqa: F401
        except ImportError:
            raise ImportError("TensorBoardWriter needs tensorboardX: pip install 'naisnet-jax[tensorboard]'.") from None
        self.logdir = os.fspath(logdir)
        self._writer = None

    def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        if self._writer is None:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(self.logdir)
        for name, value in scalars.items():
            value = _scalar(name, value)
            if value is not None:
                self._writer.add_scalar(name, value, global_step=int(step))
        self._writer.flush()

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class MultiWriter:
    """Sends every call to each of ``writers``."""

    def __init__(self, writers: Iterable[MetricWriter]):
        self.writers = list(writers)

    def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        for w in self.writers:
            w.write_scalars(step, scalars)

    def truncate_after(self, step: int) -> None:
        for w in self.writers:
            if hasattr(w, "truncate_after"):
                w.truncate_after(step)

    def flush(self) -> None:
        for w in self.writers:
            if hasattr(w, "flush"):
                w.flush()

    def close(self) -> None:
        for w in self.writers:
            if hasattr(w, "close"):
                w.close()


def default_writer(workdir: str | os.PathLike, *, tensorboard: bool = False) -> MetricWriter:
    """``JsonlWriter(workdir/scalars.jsonl)``, plus TensorBoard events in
    ``workdir/tensorboard`` when ``tensorboard``."""
    jsonl = JsonlWriter(os.path.join(workdir, SCALARS_FILE))
    if not tensorboard:
        return jsonl
    return MultiWriter([jsonl, TensorBoardWriter(os.path.join(workdir, TENSORBOARD_DIR))])


def check_writer(writer: Any) -> None:
    """Refuse an object without ``write_scalars(step, scalars)`` up front."""
    if not callable(getattr(writer, "write_scalars", None)):
        raise ValueError(
            f"writer={writer!r} has no write_scalars(step, scalars) method (CLU's MetricWriter interface)."
        )
