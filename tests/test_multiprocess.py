"""Several processes, one run (JAX's multi-controller runtime on CPU collectives): two processes of
two host devices each train, sweep, lose a process and resume exactly as one process of four
devices does. Each process runs ``naisnet-train`` (or a two-seed sweep) as a separate OS process,
joined through ``--coordinator_address``; a hang fails the test (every wait has a deadline)."""

from __future__ import annotations

import json
import os
import pathlib
import random
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from naisnet_jax import checkpoint as ckpt
from naisnet_jax import distributed

REPO = pathlib.Path(__file__).resolve().parents[1]
COMMAND = pathlib.Path(sys.executable).parent / "naisnet-train"
DEADLINE = 240  # seconds a launch may take on a CI machine of 2 cores before it counts as a hang
COMPARED = ("step", "learning_rate", "train_loss", "train_accuracy", "test_loss", "test_accuracy", "rho_max")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int, cache) -> dict:
    return dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        PYTHONUNBUFFERED="1",
        JAX_COMPILATION_CACHE_DIR=str(cache),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )


def _train_args(workdir, epochs: int) -> list[str]:
    return [
        f"--config={REPO / 'src/naisnet_jax/configs/digits_tiny.py'}",
        f"--workdir={workdir}",
        "--config.model_kwargs.features=8",
        "--config.model_kwargs.steps=3",
        "--config.limit_train=512",
        "--config.limit_test=200",
        "--config.batch_size=32",
        "--config.eval_batch_size=100",
        "--config.steps_per_chunk=5",
        f"--config.num_epochs={epochs}",
    ]


def _cluster(port: int, n: int, i: int) -> list[str]:
    return [f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={n}", f"--process_id={i}"]


def _launch(argv_of, n: int, devices: int, cache, cwd) -> list[subprocess.Popen]:
    """``n`` processes, ``argv_of(port, i)`` each, ``devices`` host devices each."""
    port = _free_port()
    return [
        subprocess.Popen(
            argv_of(port, i),
            env=_env(devices, cache),
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(n)
    ]


def _finish(procs, deadline: float = DEADLINE) -> list[tuple[int, str, str]]:
    """Each process's ``(status, stdout, stderr)``; a process still running at the deadline is a hang."""
    end, results = time.monotonic() + deadline, []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(end - time.monotonic(), 1))
            results.append((p.returncode, out, err))
    except subprocess.TimeoutExpired:
        pytest.fail(f"a process of the run hung for more than {deadline} s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return results


def _train(workdir, epochs: int, *, processes: int, cache, cwd) -> list[tuple[int, str, str]]:
    args = _train_args(workdir, epochs)
    if processes == 1:
        return _finish(_launch(lambda port, i: [str(COMMAND), *args], 1, 4, cache, cwd))
    return _finish(_launch(lambda port, i: [str(COMMAND), *args, *_cluster(port, 2, i)], 2, 2, cache, cwd))


def _records(workdir) -> list[dict]:
    with open(pathlib.Path(workdir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def _assert_same_metrics(ours: list[dict], reference: list[dict]) -> None:
    assert [r["epoch"] for r in ours] == [r["epoch"] for r in reference]
    for a, b in zip(ours, reference):
        for k in COMPARED:
            assert a[k] == pytest.approx(b[k], rel=2e-5, abs=2e-6), (a["epoch"], k)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process of four devices (4 epochs) and two processes of two devices (12 epochs)."""
    root = tmp_path_factory.mktemp("multiprocess")
    cache = root / "cache"
    one = _train(root / "one", 4, processes=1, cache=cache, cwd=root)
    two = _train(root / "two", 12, processes=2, cache=cache, cwd=root)
    return root, one, two


def test_two_processes_train_as_one_process_of_four_devices(runs):
    """The same metrics to float tolerance over the first epochs (the sums of the gradients are
    taken in another order; at learning rate 0.1 such rounding grows about threefold an epoch)."""
    root, one, two = runs
    assert [s for s, _, _ in one] == [0] and [s for s, _, _ in two] == [0, 0], (one, two)
    _assert_same_metrics(_records(root / "two")[:4], _records(root / "one"))
    # one process prints the run and writes the log; the other is silent
    (_, out0, err0), (_, out1, err1) = two
    assert out0.count("epoch 12:") == 1 and "test accuracy" in out0
    assert out1 == "" and "Traceback" not in err0 + err1
    assert [r["epoch"] for r in _records(root / "two")] == list(range(1, 13))
    # every process took part in the saves: the newest checkpoint loads, whole
    tree, meta = ckpt.load(str(root / "two" / "checkpoints"))
    assert meta["epoch"] == 12 and meta["extra"]["seeds"] == [0] and int(tree["step"]) == 12 * 16


def test_a_lost_process_ends_the_other_in_one_line_and_the_rerun_resumes_exactly(runs):
    root, _, _ = runs
    workdir, cache = root / "killed", root / "cache"
    args = _train_args(workdir, 12)
    procs = _launch(lambda port, i: [str(COMMAND), *args, *_cluster(port, 2, i)], 2, 2, cache, root)
    checkpoints, start = workdir / "checkpoints", time.monotonic()
    while not (checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir())):
        assert time.monotonic() - start < DEADLINE, "no checkpoint appeared"
        assert procs[1].poll() is None, procs[1].communicate()
        time.sleep(0.02)
    procs[1].send_signal(signal.SIGKILL)  # the whole process (its worker dies with it)
    killed_at = time.monotonic()
    (status0, out0, err0), (status1, _, _) = _finish(procs)
    assert time.monotonic() - killed_at < 60
    assert status1 == -signal.SIGKILL
    assert status0 == distributed.EXIT_PEER_LOST, err0
    lines = [line for line in err0.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: process 1 of 2 was lost"), err0
    assert "epoch 12:" not in out0  # it ended mid-run
    # the same command on every process resumes and ends as the uninterrupted run did
    resumed = _finish(_launch(lambda port, i: [str(COMMAND), *args, *_cluster(port, 2, i)], 2, 2, cache, root))
    assert [s for s, _, _ in resumed] == [0, 0], resumed
    assert "Resuming from" in resumed[0][1]
    ours, reference = _records(workdir), _records(root / "two")
    assert [r["epoch"] for r in ours] == list(range(1, 13))
    for a, b in zip(ours, reference):
        for k in COMPARED:
            assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-7), (a["epoch"], k)


def test_a_diverging_run_stops_every_process_at_the_same_step(tmp_path):
    """The divergence check reads replicated results: every process stops at the same step, in
    one line each (the primary's plain, the other's naming itself), exit 1, nothing saved."""
    args = [*_train_args(tmp_path / "w", 3), "--config.learning_rate=1e38"]
    done = _finish(
        _launch(lambda port, i: [str(COMMAND), *args, *_cluster(port, 2, i)], 2, 2, tmp_path / "c", tmp_path)
    )
    assert [s for s, _, _ in done] == [1, 1], done
    (_, _, err0), (_, _, err1) = done
    stopped = re.compile(r"training loss became nan at epoch 1 \(step (\d+)\); stopped before saving")
    assert err0.startswith("error: training loss became nan") and err1.startswith("error: process 1 of 2: training")
    assert stopped.search(err0).group(1) == stopped.search(err1).group(1), (err0, err1)
    assert len(err0.splitlines()) == len(err1.splitlines()) == 1
    assert not any(p.name.isdigit() for p in (tmp_path / "w" / "checkpoints").iterdir())


SWEEP = """
import sys
from naisnet_jax import distributed
n, i, port, workdir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
if n > 1:
    distributed.initialize(distributed.Cluster(f"127.0.0.1:{port}", n, i))
from naisnet_jax import sweep
from naisnet_jax.configs import digits_tiny
config = digits_tiny.get_config()
config.num_epochs, config.num_seeds, config.limit_train, config.limit_test = 3, 2, 512, 200
config.model_kwargs.features, config.model_kwargs.steps, config.batch_size = 8, 3, 32
result = sweep.train_sweep(config, workdir, audit=False, verbose=False)
print("seeds", [r.seed for r in result.runs], "accuracy", [r.test_accuracy for r in result.runs])
"""


def test_a_process_whose_coordinator_never_answers_says_so_in_one_line(tmp_path):
    env = dict(_env(1, tmp_path / "cache"), **{distributed.JOIN_TIMEOUT_ENV: "2"})
    argv = [str(COMMAND), *_train_args(tmp_path / "w", 1), *_cluster(_free_port(), 2, 1)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == distributed.EXIT_NOT_JOINED, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines == [
        f"error: process 1 of 2 could not join the run: no coordinator (process 0) answered at "
        f"{argv[-3].split('=', 1)[1]} within 2 s; start every process, and check the address and port."
    ], done.stderr
    assert not (tmp_path / "w").exists()
    bad = subprocess.run(argv, env=dict(env, **{distributed.JOIN_TIMEOUT_ENV: "soon"}), capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().endswith("must be a whole number of seconds, at least 1."), bad


def test_a_two_seed_sweep_over_two_processes_is_the_sweep_of_one(tmp_path):
    cache = tmp_path / "cache"

    def sweep(n, devices, workdir):
        argv = lambda port, i: [sys.executable, "-c", SWEEP, str(n), str(i), str(port), str(workdir)]  # noqa: E731
        return _finish(_launch(argv, n, devices, cache, tmp_path))

    one, two = sweep(1, 4, tmp_path / "one"), sweep(2, 2, tmp_path / "two")
    assert [s for s, _, _ in one + two] == [0, 0, 0], (one, two)
    results = [[line for line in out.splitlines() if line.startswith("seeds")] for _, out, _ in one + two]
    assert results[1] == results[2] == results[0] and len(results[0]) == 1  # every process holds every seed's
    ours, reference = _records(tmp_path / "two"), _records(tmp_path / "one")
    assert [(r["epoch"], r["seed"]) for r in ours] == [(r["epoch"], r["seed"]) for r in reference]
    _assert_same_metrics(ours, reference)
    for seed in (0, 1):  # each seed exported as a single run, saved by both processes together
        _, meta = ckpt.load(str(tmp_path / "two" / f"seed_{seed}" / "checkpoints"))
        assert meta["extra"]["seeds"] == [seed] and meta["epoch"] == 3


def _gloo_pieces(rank: int, peers: int) -> list[str]:
    """Gloo's connection message as its stream operators write it, piece by piece."""
    return [
        "[Gloo] Rank ", str(rank), " is connected to ", str(peers), " peer ranks. ",
        "Expected number of connected peer ranks is : ", str(peers), "\n",
    ]  # fmt: skip


def test_gloo_messages_are_left_out_however_their_pieces_interleave():
    """Several threads print the message at once (seen: a line holding only
    "1 peer ranks. Expected number of connected peer ranks is : 1"); in whatever order their pieces
    land (200 random orders of 1 to 4 threads), nothing of Gloo's comes through and our own lines do."""
    ours = ["Training on 2 devices over 2 processes.\n", "\n", "epoch 1: train loss 2.3\n", "1\n"]
    for seed in range(200):
        rng = random.Random(seed)
        threads = [_gloo_pieces(rng.randrange(4), rng.randrange(1, 4)) for _ in range(rng.randrange(1, 5))]
        burst = []
        while any(threads):
            burst.append(rng.choice([t for t in threads if t]).pop(0))
        text = ours[0] + "".join(burst) + "".join(ours[1:]) if seed % 2 else "".join(burst) + "".join(ours)
        kept = list(distributed._without_gloo(text.splitlines(keepends=True)))
        assert not any("Gloo" in line or "peer ranks" in line for line in kept), (seed, text, kept)
        # our lines come through, less a blank or bare-number line right after a message
        assert [line for line in kept if line.strip() and not line.strip().isdigit()] == [
            line for line in ours if line.strip() and not line.strip().isdigit()
        ], (seed, text, kept)
        assert "1\n" in kept, (seed, kept)  # a number on its own line after our own output is ours


#: JAX's coordination service naming process 1 as lost
VERDICT = (
    "E1129 coordination_service.cc:1549] Use error polling to propagate the following error to all tasks: "
    "UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):\n1\nThe tasks have crashed.\n"
)


@pytest.mark.parametrize(
    ("report", "lost"),
    [
        (
            VERDICT
            + "F1129 client.h:80] Terminating process because the JAX distributed service detected fatal errors.",
            [1],
        ),
        (
            "F1129 client.h:80] Terminating process because the JAX distributed service detected fatal errors.\n"
            "Additional GRPC error information from remote target coordination_service while calling "
            "/xla.coordination.CoordinationService/PollForError:\n:UNKNOWN:Error received from peer "
            '{grpc_status:14, grpc_message:"Socket closed"}',
            [0],
        ),
        ("F1129 client.h:80] Terminating process because the JAX distributed service detected fatal errors.", []),
        ("E1129 some other error", None),
        (  # the verdict, then the process's own error ended it before the runtime did
            VERDICT
            + "error: cannot write checkpoints to W (step 16): JaxRuntimeError: INTERNAL: Barrier failed because: task "
            "is set to ERROR: UNAVAILABLE: Task 1 heartbeat timeout. This indicates ...",
            [1],
        ),
        (  # the barrier's error alone
            "error: cannot write checkpoints to W (step 16): JaxRuntimeError: INTERNAL: Barrier failed because: task "
            "is set to ERROR: UNAVAILABLE: Task 3 heartbeat timeout.",
            [3],
        ),
        (
            "F1129 client.h:80] Terminating process because the JAX distributed service detected fatal errors. "
            "absl::Status: DEADLINE_EXCEEDED: Deadline Exceeded\n\n"
            "RPC: /xla.coordination.CoordinationService/RegisterTask",
            None,  # never joined: no process was lost
        ),
    ],
)
def test_the_lost_process_is_read_from_the_runtime_report(report, lost):
    assert distributed.lost_processes(report) == lost


FATAL_REPORT = VERDICT + (
    "F1129 client.h:80] Terminating process because the JAX distributed service detected fatal errors.\n"
)


@pytest.mark.parametrize(
    ("child_err", "lines"),
    [
        (  # the lost process died during a checkpoint save: the save's barrier fails first
            "error: cannot write checkpoints to W/checkpoints (step 16): JaxRuntimeError: INTERNAL: Barrier failed "
            "because: task is set to ERROR: UNAVAILABLE: Task 1 heartbeat timeout.; the steps saved before are "
            "intact." + FATAL_REPORT,
            ["error: process 1 of 2 was lost, and JAX's runtime stopped process 0; the checkpoints in W are intact"],
        ),
        (  # the lost process took a collective's connection down before the runtime missed it
            "error: cannot write checkpoints to W/checkpoints (step 16): JaxRuntimeError: UNKNOWN: Gloo AllGather "
            "failed: [external/gloo/gloo/transport/tcp/pair.cc:538] Read error [127.0.0.1]:18866: Connection reset "
            "by peer; the steps saved before are intact.\n",
            ["error: process 1 of 2 was lost, and the collectives broke off under process 0; the checkpoints in W"],
        ),
        (  # ... or Gloo ended this process itself (its exit status 134, from SIGABRT)
            "terminate called after throwing an instance of 'gloo::EnforceNotMet'\n  what():  [enforce fail at "
            "external/gloo/gloo/transport/tcp/pair.cc:459] op.preamble.length <= op.nbytes. 8 vs 4. Received data "
            "size doesn't match expected size. Is there a distributed collective mismatch in your code?\n",
            ["error: process 1 of 2 was lost, and the collectives broke off under process 0; the checkpoints in W"],
        ),
        (  # ... the runtime's verdict, then the save's error ends the process first (exit 2, no fatal line)
            VERDICT
            + "error: cannot write checkpoints to W/checkpoints (step 16): JaxRuntimeError: INTERNAL: Barrier failed "
            "because: task is set to ERROR: UNAVAILABLE: Task 1 heartbeat timeout.; the steps saved before are "
            "intact.\n",
            ["error: process 1 of 2 was lost, and JAX's runtime stopped process 0; the checkpoints in W are intact"],
        ),
        (  # a full disk is the child's own error, said as it is
            "error: cannot write checkpoints to W/checkpoints (step 16): No space left on device; the steps saved "
            "before are intact.\n",
            ["error: cannot write checkpoints to W/checkpoints (step 16): No space left on device"],
        ),
    ],
)
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # about this test process, which has JAX loaded
def test_a_lost_process_during_a_save_is_said_once(child_err, lines, capsys, monkeypatch):
    """Killed while the others wait at a checkpoint save's barrier, a process shows first as the
    save's failure, then in the runtime's report: one line names it, not the save's error too.
    Killed during a collective, it can end the other before the runtime misses it: a connection
    reset under Gloo, or Gloo's own end of the process; of two processes, the other is named."""
    import signal

    monkeypatch.setattr(signal, "signal", lambda *args: None)  # pytest keeps its own Ctrl-C
    child = [sys.executable, "-c", f"import sys; sys.stderr.write({child_err!r}); sys.exit(1)"]
    status = distributed.supervise(child, distributed.Cluster("host:1", 2, 0), workdir="W")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == len(lines) and all(e.startswith(w) for e, w in zip(err, lines)), err
    assert status == (distributed.EXIT_PEER_LOST if "lost" in lines[0] else 1)


@pytest.mark.parametrize(("me", "count", "lost"), [("0", "2", [1]), ("1", "2", [0]), ("2", "4", []), ("?", "?", [])])
def test_a_broken_collective_names_the_other_process_only_of_two(me, count, lost):
    """Gloo names the address whose connection broke, not a process: of more than two processes
    (or an unknown count) the line says 'a process'; without a broken collective, nothing."""
    text = "JaxRuntimeError: UNKNOWN: Gloo AllReduce failed: [pair.cc:547] Connection closed by peer [::1]:2475"
    assert distributed.broken_collective(text, me, count) == lost
    assert distributed.broken_collective("error: No space left on device", me, count) is None


@pytest.mark.parametrize(
    ("cluster", "message"),
    [
        (distributed.Cluster("host:1234", 2, None), "--process_id missing"),
        (distributed.Cluster(None, 2, 0), "--coordinator_address missing"),
        (distributed.Cluster("host:1234", 2, 2), "--process_id=2"),
        (distributed.Cluster("host:1234", 0, 0), "--num_processes=0"),
        (distributed.Cluster("no-port", 2, 0), "must be host:port"),
    ],
)
def test_a_partial_or_bad_cluster_is_refused_in_one_line(cluster, message):
    with pytest.raises(ValueError, match=message):
        cluster.check()


def test_the_command_refuses_a_bad_cluster_before_anything_runs(tmp_path):
    done = subprocess.run(
        [str(COMMAND), *_train_args(tmp_path / "w", 1), "--num_processes=2", "--process_id=0"],
        env=_env(1, tmp_path / "cache"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stderr.startswith("error: --coordinator_address missing"), done.stderr
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize(
    ("env", "launcher"),
    [
        ({"SLURM_NTASKS": "4", "SLURM_PROCID": "1"}, "slurm"),
        ({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, None),
        ({"OMPI_COMM_WORLD_SIZE": "2"}, "mpi"),
        ({"TPU_WORKER_HOSTNAMES": "a,b"}, "tpu"),
        ({}, None),
    ],
)
def test_a_launcher_is_detected_from_its_variables(monkeypatch, env, launcher):
    for name in ("SLURM_NTASKS", "SLURM_NPROCS", "SLURM_PROCID", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("MEGASCALE_COORDINATOR_ADDRESS", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert distributed.detected() == launcher


@pytest.mark.parametrize("experiment", ["conv", "ablation", "tuned"])
def test_an_experiment_refuses_a_bad_cluster_in_one_line(tmp_path, experiment):
    """The sweep experiments read the same cluster flags as naisnet-train and refuse a partial
    cluster the same way: one line, exit status 2, nothing written."""
    done = subprocess.run(
        [sys.executable, "-m", f"experiments.{experiment}", f"--workdir={tmp_path / 'w'}", "--num_processes=2"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert (
        done.stderr.startswith("error: --coordinator_address, --process_id missing") and done.stderr.count("\n") == 1
    ), done.stderr
    assert not (tmp_path / "w").exists()
