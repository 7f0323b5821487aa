"""Several processes, one run: joining JAX's multi-controller runtime, and who does what in it.

Every process of a run executes the same program over the devices of all of them (JAX's
multi-controller model, as Flax's examples and Orbax use it). Each process puts its copy of
the (small) dataset on its own devices, and each device gathers its own rows of every batch,
so no host ever holds or sends a global batch. Parameters are replicated; a sweep's seeds are
split over every process's devices. What touches the workdir is split by role:

- the **primary** process (``jax.process_index() == 0``) holds the workdir's lock, writes
  ``metrics.jsonl``, the scalars and the figures, and prints the progress and the epoch lines;
- **every** process takes part in each checkpoint save and restore (Orbax's multi-host protocol:
  the primary writes the shared files, all meet at its barriers).

Joining: :func:`initialize` takes the cluster from explicit values (the commands'
``--coordinator_address``, ``--num_processes``, ``--process_id``) or, without them, from JAX's
own detection of a SLURM job, an Open MPI launch or a TPU pod slice (:func:`detected`). A
process that dies ends the others: JAX's coordination service stops each survivor within
``heartbeat_timeout`` seconds, and :func:`supervise` (which the commands run each process under)
turns the runtime's report into one line naming the lost process.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from naisnet_jax.checks import check_int

#: Seconds without a heartbeat after which JAX's coordination service declares a process lost
#: (JAX's default is 100 s; here a lost process is said within a minute).
HEARTBEAT_TIMEOUT = 20

#: Exit status of a process that stops because another one was lost.
EXIT_PEER_LOST = 1
#: Exit status of a process that could not join the run (no coordinator answered in time).
EXIT_NOT_JOINED = 2
#: Seconds a process waits for the others to join (JAX's ``initialization_timeout``); the
#: environment variable of this name sets another (a large job's tasks may start minutes apart).
JOIN_TIMEOUT_ENV = "NAISNET_JAX_JOIN_TIMEOUT"
JOIN_TIMEOUT = 300


#: The commands' flags for an explicit cluster: name -> (type, help); :func:`define_flags`.
CLUSTER_FLAGS = {
    "coordinator_address": (
        str,
        "several processes: host:port of process 0 (with --num_processes and --process_id; without them "
        "JAX detects a SLURM, Open MPI or TPU pod launch)",
    ),
    "num_processes": (int, "several processes: how many take part"),
    "process_id": (int, "several processes: this one's index, 0 .. num_processes - 1"),
}


def define_flags(flag_values=None) -> None:
    """:data:`CLUSTER_FLAGS` as absl flags (in ``flag_values``, default absl's global set)."""
    from absl import flags

    for name, (kind, help_text) in CLUSTER_FLAGS.items():
        define = flags.DEFINE_string if kind is str else flags.DEFINE_integer
        define(name, None, help_text, flag_values=flags.FLAGS if flag_values is None else flag_values)


class PeerFailed(RuntimeError):
    """Another process (the primary) failed a step every process needed; it said why."""

    def __init__(self, status: int):
        super().__init__(f"the primary process stopped (exit status {status}); its output says why.")
        self.status = status


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Where this process sits: ``coordinator_address`` ("host:port" of process 0), the number of
    processes and this one's id. ``None`` fields are left to JAX's detection."""

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None

    @classmethod
    def of(cls, values) -> Cluster:
        """The cluster of parsed flags (absl's or argparse's) named as :data:`CLUSTER_FLAGS`."""
        return cls(*(getattr(values, f.name) for f in dataclasses.fields(cls)))

    def explicit(self) -> bool:
        return any(v is not None for v in dataclasses.astuple(self))

    def check(self) -> Cluster:
        """Raise ``ValueError`` naming the flag where the three are not all given or are out of range."""
        if not self.explicit():
            return self
        missing = [f"--{f.name}" for f in dataclasses.fields(self) if getattr(self, f.name) is None]
        if missing:
            raise ValueError(
                f"{', '.join(missing)} missing: an explicit cluster needs --coordinator_address, "
                "--num_processes and --process_id together (or none, for JAX's detection)."
            )
        check_int("--num_processes", self.num_processes)
        check_int("--process_id", self.process_id, 0, self.num_processes - 1)
        if not re.fullmatch(r"\[?[\w.:-]+\]?:\d{1,5}", self.coordinator_address):
            raise ValueError(f"--coordinator_address={self.coordinator_address!r} must be host:port.")
        return self


def detected() -> str | None:
    """The launcher this process runs under with more than one task (``"slurm"``, ``"mpi"``,
    ``"tpu"``), by the variables each sets; ``None`` for a single process."""
    env = os.environ
    if int(env.get("SLURM_NTASKS", env.get("SLURM_NPROCS", "1")) or 1) > 1 and "SLURM_PROCID" in env:
        return "slurm"
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return "mpi"
    if "," in env.get("TPU_WORKER_HOSTNAMES", "") or "MEGASCALE_COORDINATOR_ADDRESS" in env:
        return "tpu"
    return None


def initialize(cluster: Cluster = Cluster(), *, heartbeat_timeout: int = HEARTBEAT_TIMEOUT) -> bool:
    """Join the run's processes: with ``cluster``'s explicit values, or by JAX's detection where
    :func:`detected` names a launcher. Returns whether this is a multi-process run. Call before
    anything else touches JAX's devices."""
    import jax

    cluster.check()
    timeouts = dict(heartbeat_timeout_seconds=heartbeat_timeout, initialization_timeout=join_timeout())
    if cluster.explicit():
        jax.distributed.initialize(cluster.coordinator_address, cluster.num_processes, cluster.process_id, **timeouts)
    elif detected() is not None:
        jax.distributed.initialize(**timeouts)
    else:
        return False
    return jax.process_count() > 1


def join(cluster: Cluster, command: Sequence[str], *, workdir: str) -> bool:
    """Join this command's run if it has several processes, as every command does: a launch of
    several runs ``command`` (this command again) under :func:`supervise` and exits with its
    status; the process that joins (:func:`initialize`) prints only if it is the primary one.
    Returns whether this is a multi-process run; raises ``ValueError`` for a bad cluster or
    ``$NAISNET_JAX_JOIN_TIMEOUT``."""
    cluster.check()
    if needs_supervisor(cluster):
        sys.exit(supervise(command, cluster, workdir=workdir))
    several = initialize(cluster)
    if several and not is_primary():
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the primary process prints the run
    return several


def join_timeout() -> int:
    """:data:`JOIN_TIMEOUT`, or the whole number of seconds in ``$NAISNET_JAX_JOIN_TIMEOUT``."""
    raw = os.environ.get(JOIN_TIMEOUT_ENV)
    if raw is None:
        return JOIN_TIMEOUT
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"${JOIN_TIMEOUT_ENV}={raw!r} must be a whole number of seconds, at least 1.")
    return int(raw)


def is_primary() -> bool:
    """Whether this process writes the run's files and prints (process 0, or the only one)."""
    import jax

    return jax.process_index() == 0


def agree(status: int) -> int:
    """The primary's ``status`` (0: it may go on) on every process; a single process's own."""
    import jax

    if jax.process_count() == 1:
        return status
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int32(status)))


def meet(name: str) -> None:
    """Every process waits here until all of them have arrived (one process: returns at once).
    Only for a point that every process reaches, such as a stop they all decided on together."""
    import jax

    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def gather(tree):
    """Every array of ``tree`` whole, as numpy, on every process (a sweep's seeds are split over
    the processes' devices; a replicated array is read from this process's own copy)."""
    import jax

    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    def whole(a):
        if not isinstance(a, jax.Array) or a.is_fully_addressable or a.is_fully_replicated:
            return jax.device_get(a)
        return np.asarray(multihost_utils.process_allgather(a, tiled=True))

    return jax.tree.map(whole, tree)


# ----------------------------------------------------------------------- a lost process, said once

#: JAX's coordination service, on a survivor: the processes that stopped sending heartbeats
_UNHEALTHY = re.compile(r"tasks are unhealthy \(stopped sending heartbeats\):\s*([\d,\s]+)")
#: ... and a barrier's error naming the one that missed it ("Task 1 heartbeat timeout")
_TASK_TIMED_OUT = re.compile(r"\bTask (\d+) heartbeat timeout")
#: ... and when the coordinator itself (process 0) is gone
_COORDINATOR_GONE = re.compile(r"coordination_service.*(Socket closed|Connection reset|failed to connect)", re.I | re.S)
#: the first line of the runtime's report: a warning, error or fatal log line of its
#: coordination or preemption code
_RUNTIME_ERROR = re.compile(r"[WEF]\d{4} .*(coordination|preemption)", re.I)
_FATAL = "Terminating process because the JAX distributed service detected fatal errors"
#: Gloo (the CPU collectives) when the other end of a collective went away before the runtime
#: missed its heartbeats: the connection reset or closed under a collective (an error the child
#: reports), or Gloo ending the process itself (seen after a SIGKILL of the other process: "Received
#: data size doesn't match expected size", a message read for a collective it was not sent for)
_BROKEN_COLLECTIVE = re.compile(
    r"Gloo \w+ failed: .*(Connection reset by peer|Connection closed by peer|Socket closed)"
    r"|terminate called after throwing an instance of 'gloo::",
)
#: a line of the child's own that a lost process caused (a checkpoint save's barrier that failed on
#: the lost process's heartbeat, a broken collective): held with the runtime's report, said as the
#: lost process
_LOST_PEER_SYMPTOM = re.compile(
    rf"heartbeat timeout|stopped sending heartbeats|Barrier failed|{_BROKEN_COLLECTIVE.pattern}", re.I
)


def lost_processes(text: str) -> list[int] | None:
    """From a process's stderr: the processes JAX's runtime declared lost (``[]`` when it ended
    this process without saying which), or ``None`` when it declared none and ended nothing (or
    this process never joined: :func:`never_joined`). The runtime's verdict counts also when the
    process ended on its own error first (a checkpoint save's barrier that the lost one missed)."""
    if never_joined(text):
        return None
    found = _UNHEALTHY.search(text)
    if found:
        return sorted({int(t) for t in re.findall(r"\d+", found.group(1))})
    timed_out = _TASK_TIMED_OUT.findall(text)
    if timed_out:
        return sorted({int(t) for t in timed_out})
    if _FATAL not in text:
        return None
    if _COORDINATOR_GONE.search(text):
        return [0]
    return []


def broken_collective(text: str, me: str, count: str) -> list[int] | None:
    """From a process's stderr: the process lost when a collective broke off under Gloo before the
    runtime said which (:data:`_BROKEN_COLLECTIVE`): of two processes the other one, of more ``[]``
    (Gloo names an address, not a process); ``None`` when no collective broke off."""
    if not _BROKEN_COLLECTIVE.search(text):
        return None
    return [1 - int(me)] if count == "2" and me in ("0", "1") else []


def never_joined(text: str) -> bool:
    """Whether JAX's runtime ended this process because no coordinator took its registration
    in time (process 0 not running, or not reachable at the address)."""
    return _FATAL in text and "RegisterTask" in text


#: Set in the child :func:`supervise` starts: that process joins the run itself.
WORKER_ENV = "NAISNET_JAX_DISTRIBUTED_WORKER"


def needs_supervisor(cluster: Cluster) -> bool:
    """Whether this process should :func:`supervise` a child that joins the run: a multi-process
    launch (explicit or detected), and not already that child."""
    return not os.environ.get(WORKER_ENV) and (cluster.explicit() or detected() is not None)


def _place(cluster: Cluster) -> tuple[str, str]:
    """This process's id and the number of processes, as the launch gives them (for messages)."""
    env = os.environ
    pid = cluster.process_id
    if pid is None:
        pid = env.get("SLURM_PROCID", env.get("OMPI_COMM_WORLD_RANK", env.get("TPU_WORKER_ID", "?")))
    count = cluster.num_processes
    if count is None:
        count = env.get("SLURM_NTASKS", env.get("OMPI_COMM_WORLD_SIZE", "?"))
    return str(pid), str(count)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child, between fork and exec
    """Linux: the child gets SIGKILL when its supervisor dies (a lost process loses both)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


#: Gloo (the CPU collectives) prints "[Gloo] Rank r is connected to n peer ranks. Expected number
#: of connected peer ranks is : n" as each process joins, from several threads at once and in
#: pieces, so a line may hold pieces of two messages and a number or a line end may land alone.
_GLOO = re.compile(r"\[Gloo\]|is connected to|peer ranks")
_GLOO_LEFTOVER = re.compile(r"\s*\d*\s*")


def _without_gloo(lines: Iterable[str]) -> Iterator[str]:
    """``lines`` less Gloo's connection messages: each line holding a piece of one, and the blank or
    bare-number lines right after such a line (what is left of the pieces)."""
    in_gloo = False
    for line in lines:
        if _GLOO.search(line) or (in_gloo and _GLOO_LEFTOVER.fullmatch(line)):
            in_gloo = True
            continue
        in_gloo = False
        yield line


def _pass_through(source, sink) -> None:
    """Copy ``source``'s lines to ``sink`` as they come, less Gloo's connection messages."""
    for line in _without_gloo(source):
        sink.write(line)
        sink.flush()


def supervise(command: Sequence[str], cluster: Cluster, *, workdir: str) -> int:
    """Run ``command`` (this command again, as the process that joins the run) in a child and
    pass its output through; when JAX's runtime ends the child because another process was lost
    (or a collective broke off under it first: :func:`broken_collective`), print one line naming
    that process instead of the runtime's report and return :data:`EXIT_PEER_LOST`. SIGINT and
    SIGTERM go on to the child; the child dies with this process. Otherwise returns the child's
    exit status (128 + N for a signal N)."""
    child = subprocess.Popen(
        list(command),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        env={**os.environ, WORKER_ENV: "1"},
        preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
    )
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda s, f: child.send_signal(s))
    out = threading.Thread(target=_pass_through, args=(child.stdout, sys.stdout), daemon=True)
    out.start()
    held: list[str] = []  # the runtime's report (or a line a lost process caused), from its first line on
    for line in child.stderr:
        if held or _FATAL in line or _RUNTIME_ERROR.match(line) or _LOST_PEER_SYMPTOM.search(line):
            held.append(line)
        else:
            sys.stderr.write(line)
            sys.stderr.flush()
    status = child.wait()
    out.join()
    status = status if status >= 0 else 128 - status
    report = "".join(held)
    me, count = _place(cluster)
    if never_joined(report):
        where = cluster.coordinator_address or "the address the launcher gives"
        print(
            f"error: process {me} of {count} could not join the run: no coordinator (process 0) answered at "
            f"{where} within {join_timeout()} s; start every process, and check the address and port.",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_NOT_JOINED
    lost, stopped = lost_processes(report), "JAX's runtime stopped"
    if lost is None:
        lost, stopped = broken_collective(report, me, count), "the collectives broke off under"
    if lost is None:
        sys.stderr.write(report)
        return status
    who = f"process {', '.join(str(p) for p in lost)}" if lost else "a process"
    print(
        f"error: {who} of {count} was lost, and {stopped} process {me}; the checkpoints "
        f"in {workdir} are intact, and the same command on every process resumes from the last one.",
        file=sys.stderr,
        flush=True,
    )
    return EXIT_PEER_LOST
