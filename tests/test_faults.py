"""The fault drill: ``naisnet-train`` is killed with SIGKILL at random moments, some of them
inside a checkpoint write, and restarted each time; it must end with exactly the parameters,
optimiser state and metrics of an uninterrupted run.

After every kill the drill checks what a crash may leave behind: the latest committed
checkpoint loads (its digest matches), every epoch the process reported as done is in it,
``metrics.jsonl`` is readable with consecutive epochs reaching at least the checkpoint's, and a
restart resumes from the latest *committed* checkpoint, never from Orbax's temporary folder of
an interrupted write (``<step>.orbax-checkpoint-tmp...``). Writes are hit by polling the
checkpoint directory and killing the moment such a folder appears.

The full drill (12 kills, at least 4 inside a write) is slow; the default suite runs a short
one (2 kills, at least 1 inside a write). Restarts share a JAX compilation cache, so each costs
about a process start.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from naisnet_jax import checkpoint as ckpt
from naisnet_jax import metric_writers as mw
from naisnet_jax import train

REPO = pathlib.Path(__file__).resolve().parents[1]
COMMAND = pathlib.Path(sys.executable).parent / "naisnet-train"
TMP_MARK = ".orbax-checkpoint-tmp"
TIMING_FIELDS = {"epoch_seconds", "epoch/epoch_seconds", "train/steps_per_second"}


def _command(workdir, epochs):
    return [
        str(COMMAND),
        f"--config={REPO / 'src/naisnet_jax/configs/digits_tiny.py'}",
        f"--workdir={workdir}",
        "--config.model_kwargs.features=8",
        "--config.model_kwargs.steps=3",
        "--config.limit_train=256",
        "--config.limit_test=100",
        "--config.batch_size=32",
        "--config.eval_batch_size=100",
        "--config.steps_per_chunk=5",  # 8 steps an epoch: chunks of 5 and 3
        f"--config.num_epochs={epochs}",
        "--config.keep_checkpoints=2",
    ]


def _env(cache):
    return dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
        JAX_COMPILATION_CACHE_DIR=str(cache),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )


def _committed(checkpoints: pathlib.Path) -> list[int]:
    return sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()) if checkpoints.is_dir() else []


def _temporaries(checkpoints: pathlib.Path) -> set[str]:
    if not checkpoints.is_dir():
        return set()
    try:
        return {p.name for p in checkpoints.iterdir() if TMP_MARK in p.name}
    except FileNotFoundError:  # a folder renamed while listing
        return set()


def _printed_epochs(log: str) -> list[int]:
    return [int(m) for m in re.findall(r"^epoch (\d+):", log, flags=re.M)]


def _resumed_at(log: str) -> int | None:
    m = re.search(r"Resuming from .* at epoch (\d+) \(step (\d+)\)", log)
    return int(m.group(1)) if m else None


def _check_after_crash(workdir: pathlib.Path, log: str) -> int:
    """What a SIGKILL may leave: returns the epoch of the latest committed checkpoint (0: none)."""
    checkpoints = workdir / train.CHECKPOINT_DIR
    epoch = 0
    if _committed(checkpoints):
        state, meta = ckpt.load(str(checkpoints))  # digest checked: never a half-written state
        epoch = int(meta["epoch"])
        assert meta["step"] == _committed(checkpoints)[-1]
        assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state["params"]))
    printed = _printed_epochs(log)
    assert not printed or max(printed) <= epoch, "an epoch reported as done is not in the checkpoint"
    records = mw.read_jsonl(workdir / train.METRICS_FILE)  # a cut last line is tolerated
    epochs = [r["epoch"] for r in records]
    assert epochs == list(range(1, len(epochs) + 1)) and len(epochs) >= epoch
    return epoch


def _kill_when(proc, condition, deadline_s=300.0, poll_s=0.0005) -> bool:
    """Poll ``condition()`` until it holds, then SIGKILL; False if the process ended first."""
    deadline = time.monotonic() + deadline_s
    while proc.poll() is None and time.monotonic() < deadline:
        if condition():
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(poll_s)
    if proc.poll() is None:
        proc.kill()
        proc.wait()
        raise AssertionError("the drill's training run hung")
    return False


def drill(tmp_path, *, kills: int, write_kills: int, epochs: int, seed: int):
    assert COMMAND.exists(), f"{COMMAND} missing: install the package (pip install -e .)"
    rng = np.random.default_rng(seed)
    cache, workdir, clean = tmp_path / "jax-cache", tmp_path / "killed", tmp_path / "clean"
    env = _env(cache)
    reference = subprocess.run(_command(clean, epochs), env=env, capture_output=True, text=True, cwd=tmp_path)
    assert reference.returncode == 0, reference.stderr[-3000:]

    checkpoints = workdir / train.CHECKPOINT_DIR
    modes = ["write"] * write_kills + list(rng.choice(["early", "random", "write"], kills - write_kills))
    rng.shuffle(modes)
    hit_writes, expected_resume, i = 0, None, 0
    while i < len(modes) or hit_writes < write_kills:
        # a write kill that came a moment too late (the folder already renamed) is retried
        assert i < len(modes) + 10, "kills keep missing the checkpoint writes"
        mode = modes[i] if i < len(modes) else "write"
        before = _temporaries(checkpoints)  # left by earlier kills
        log_path = tmp_path / f"run{i}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                _command(workdir, epochs), env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, text=True
            )
            start, committed = time.monotonic(), _committed(checkpoints)
            if mode == "early":  # somewhere in start-up, compilation or the first epochs
                delay = rng.uniform(0.0, 4.0)
                killed = _kill_when(proc, lambda: time.monotonic() - start > delay)
            elif mode == "random":  # a random moment after this run's first new checkpoint
                delay, seen = rng.uniform(0.0, 0.6), {}

                def later():
                    if "t" not in seen and len(set(_committed(checkpoints)) - set(committed)) > 0:
                        seen["t"] = time.monotonic()
                    return "t" in seen and time.monotonic() - seen["t"] > delay

                killed = _kill_when(proc, later)
            else:  # inside the k-th checkpoint write of this run (k >= 2: the drill makes progress)
                k, fresh = int(rng.integers(2, 4)), set()

                def writing():
                    fresh.update(_temporaries(checkpoints) - before)
                    return len(fresh) >= k

                killed = _kill_when(proc, writing)
        log = log_path.read_text()
        assert killed, f"run {i} ({mode}) finished before it was killed; raise epochs\n{log[-2000:]}"
        if expected_resume is not None and _resumed_at(log) is not None:
            assert _resumed_at(log) == expected_resume  # the latest committed checkpoint, not a temporary
        if mode == "write" and _temporaries(checkpoints) - before:
            hit_writes += 1
        i += 1
        epoch = _check_after_crash(workdir, log)
        expected_resume = epoch + 1 if epoch else None

    assert hit_writes >= write_kills, f"only {hit_writes} kills landed inside a checkpoint write"
    final = subprocess.run(_command(workdir, epochs), env=env, capture_output=True, text=True, cwd=tmp_path)
    assert final.returncode == 0, final.stderr[-3000:]
    assert _resumed_at(final.stdout) == expected_resume
    assert f"after epoch {epochs}" in final.stdout

    # exactly the uninterrupted run: parameters, optimiser state, step, metrics, scalars
    state_k, meta_k = ckpt.load(str(checkpoints))
    state_c, meta_c = ckpt.load(str(clean / train.CHECKPOINT_DIR))
    assert meta_k["epoch"] == meta_c["epoch"] == epochs and meta_k["digest"] == meta_c["digest"]
    jax.tree.map(np.testing.assert_array_equal, state_k, state_c)
    for name in (train.METRICS_FILE, mw.SCALARS_FILE):
        killed_records, clean_records = (
            [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in mw.read_jsonl(d / name)]
            for d in (workdir, clean)
        )
        assert killed_records == clean_records, name
    assert [r["epoch"] for r in mw.read_jsonl(workdir / train.METRICS_FILE)] == list(range(1, epochs + 1))
    assert len(_committed(checkpoints)) <= 2  # keep_checkpoints honoured across restarts
    return hit_writes


def test_short_fault_drill(tmp_path):
    drill(tmp_path, kills=2, write_kills=1, epochs=16, seed=0)


@pytest.mark.slow
def test_fault_drill_twelve_kills(tmp_path):
    drill(tmp_path, kills=12, write_kills=4, epochs=60, seed=1)


def _hold_lock(lock_path) -> subprocess.Popen:
    """A process that takes ``lock_path`` as a running trainer holds it, prints ``held`` and waits."""
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import filelock, time; lock = filelock.FileLock({str(lock_path)!r}); lock.acquire(); "
            "print('held', flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )


def test_one_trainer_per_workdir(tmp_path):
    """While a trainer holds the workdir (a process holding its lock, as a running trainer does),
    a second ``naisnet-train`` on it is refused in one line with exit 2 before it writes anything;
    once the holder is SIGKILLed, its lock goes with it and the next run trains there."""
    from naisnet_jax import engine

    workdir = tmp_path / "run"
    workdir.mkdir()
    lock_path = workdir / engine.LOCK_FILE
    holder = _hold_lock(lock_path)
    try:
        assert holder.stdout.readline().strip() == "held"
        env = _env(tmp_path / "cache")
        refused = subprocess.run(_command(workdir, 1), env=env, capture_output=True, text=True, cwd=tmp_path)
        assert refused.returncode == 2, refused.stderr[-2000:]
        lines = [line for line in refused.stderr.splitlines() if line.strip()]
        assert lines[-1].startswith("error: ") and "in use by another trainer" in lines[-1], refused.stderr[-2000:]
        assert "Traceback" not in refused.stderr
        assert sorted(p.name for p in workdir.iterdir()) == [engine.LOCK_FILE]  # nothing written
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    ran = subprocess.run(_command(workdir, 1), env=env, capture_output=True, text=True, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert (workdir / train.METRICS_FILE).exists()


def test_workdir_lock_in_process(tmp_path):
    """The library's trainers take the same lock: a second holder in one process is refused too."""
    from naisnet_jax import engine

    with engine.workdir_lock(str(tmp_path)):
        with pytest.raises(engine.WorkdirInUse, match="in use by another trainer"):
            with engine.workdir_lock(str(tmp_path)):
                pass
    with engine.workdir_lock(str(tmp_path)):  # released: taken again
        pass


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
def test_an_interrupt_ends_in_one_line_and_resumes(tmp_path, signum):
    """SIGINT (Ctrl-C) or SIGTERM during training: one ``error:`` line naming it, exit 130 or 143,
    no traceback; the same command then resumes from the last checkpoint and finishes."""
    workdir, env = tmp_path / "run", _env(tmp_path / "cache")
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen(
            _command(workdir, 40), env=env, cwd=tmp_path, stdout=log, stderr=subprocess.PIPE, text=True
        )
        deadline = time.time() + 300
        while time.time() < deadline and not _committed(workdir / train.CHECKPOINT_DIR):
            time.sleep(0.05)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, err[-2000:]
    lines = [line for line in err.splitlines() if line.strip()]
    name = signal.Signals(signum).name
    assert len(lines) == 1 and lines[0].startswith(f"error: interrupted ({name}); the checkpoints"), err[-2000:]
    final = subprocess.run(_command(workdir, 40), env=env, capture_output=True, text=True, cwd=tmp_path)
    assert final.returncode == 0, final.stderr[-2000:]
    assert _resumed_at(final.stdout) is not None


def test_commands_keep_compiled_programs_between_runs(tmp_path):
    """``naisnet-train`` and ``naisnet-verify`` keep JAX's compiled programs in a persistent cache
    (``--compilation_cache``; by default the user's cache folder), every program however quickly
    it compiled: a second run reads them back instead of compiling (its cache gains nothing);
    ``none`` keeps nothing."""
    env = _env(tmp_path / "unused")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the commands' own default, not the test session's
    env.pop("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", None)  # the commands' default: every program
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    env.pop("NAISNET_JAX_CACHE", None)

    def entries(folder):
        return sorted(p.name for p in folder.iterdir()) if folder.exists() else []

    default = tmp_path / "xdg" / "naisnet_jax" / "jax_cache"
    first = subprocess.run(_command(tmp_path / "a", 1), env=env, capture_output=True, text=True, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    stored = entries(default)
    assert stored, "the first run stored no compiled program in the user's cache folder"
    again = subprocess.run(_command(tmp_path / "b", 1), env=env, capture_output=True, text=True, cwd=tmp_path)
    assert again.returncode == 0 and entries(default) == stored  # all read back, none compiled anew
    verify = [str(pathlib.Path(sys.executable).parent / "naisnet-verify"), str(tmp_path / "a" / "checkpoints")]
    audited = subprocess.run([*verify, "--data=none"], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert audited.returncode == 0, audited.stderr[-2000:]
    assert len(entries(default)) > len(stored)  # the audit's programs kept too
    off = subprocess.run(
        [*_command(tmp_path / "c", 1), "--compilation_cache=none"],
        env=dict(env, XDG_CACHE_HOME=str(tmp_path / "x2")),
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert off.returncode == 0 and not (tmp_path / "x2").exists()


def test_the_demo_refuses_a_workdir_a_trainer_holds(tmp_path):
    """``python -m experiments.demo`` on a workdir whose lock another process holds (as a running
    trainer does): one ``error:`` line, exit 2, and with ``--fresh`` nothing deleted; the workdir
    is read with ``~`` expanded, as ``naisnet-train`` reads it."""
    from naisnet_jax import engine

    workdir = tmp_path / "home" / "run"
    (workdir / train.CHECKPOINT_DIR / "4").mkdir(parents=True)
    (workdir / train.METRICS_FILE).write_text('{"epoch": 1}\n')
    lock_path = workdir / engine.LOCK_FILE
    holder = _hold_lock(lock_path)
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        HOME=str(tmp_path / "home"),
        NAISNET_FASHION_MNIST_DIR=str(tmp_path / "no-data"),  # were it not refused, it stops at the data
    )
    in_use = (
        f"error: {workdir} is in use by another trainer (it holds {lock_path}); wait for it to end or use "
        "another workdir."
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        for args, line in (
            ([f"--workdir={workdir}"], in_use),
            (["--workdir=~/run"], in_use),
            (["--fresh", "--workdir=~/run"], in_use + " Nothing was deleted."),
        ):
            done = subprocess.run(
                [sys.executable, "-m", "experiments.demo", *args],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
                timeout=45,
            )
            assert (done.returncode, done.stderr.splitlines()) == (2, [line]), done.stderr[-2000:]
            assert sorted(p.name for p in workdir.iterdir()) == [
                engine.LOCK_FILE,
                train.CHECKPOINT_DIR,
                train.METRICS_FILE,
            ]
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


SWEEP_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from test_sweep import get_config
from naisnet_jax import sweep
sweep.train_sweep(get_config(num_epochs=5), sys.argv[1], seeds=(0, 1), audit=False, per_step_loss=False)
"""


def test_a_sweep_killed_mid_run_resumes_as_the_uninterrupted_sweep(tmp_path):
    """A sweep killed by SIGKILL once two epochs are logged (inside the third epoch's program or
    the second's checkpoint) and run again ends with the uninterrupted sweep's records and
    parameters, seed by seed."""
    script = SWEEP_SCRIPT.format(tests=str(REPO / "tests"))
    env = _env(tmp_path / "jax_cache")
    killed, clean = tmp_path / "killed", tmp_path / "clean"

    def run(workdir):
        return subprocess.Popen(
            [sys.executable, "-c", script, str(workdir)],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    proc = run(killed)
    logged = lambda: len(mw.read_jsonl(killed / train.METRICS_FILE)) >= 4  # noqa: E731  (2 epochs x 2 seeds)
    assert _kill_when(proc, logged, deadline_s=240), "the sweep ended before it could be killed"
    outs = {}
    for workdir in (killed, clean):
        proc = run(workdir)
        outs[workdir], err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    assert "Resuming the sweep" in outs[killed] and "Resuming" not in outs[clean]
    records = [
        [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in mw.read_jsonl(d / train.METRICS_FILE)]
        for d in (killed, clean)
    ]
    assert records[0] == records[1] and len(records[0]) == 10
    for seed in (0, 1):
        state_k, meta_k = ckpt.load(str(killed / f"seed_{seed}" / train.CHECKPOINT_DIR))
        state_c, meta_c = ckpt.load(str(clean / f"seed_{seed}" / train.CHECKPOINT_DIR))
        assert meta_k["digest"] == meta_c["digest"]
        jax.tree.map(np.testing.assert_array_equal, state_k, state_c)


@contextlib.contextmanager
def _small_disk(where: pathlib.Path, size: str):
    """A tmpfs of ``size`` mounted at ``where`` (the test is skipped where mounting is not
    permitted), unmounted afterwards."""
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root and mount(8)")
    where.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


FULL_DISK_LINE = {
    "checkpoint": r"error: cannot write checkpoints to \S+ \(step (\d+)\): .*; the steps saved before are intact\.",
    "log": (
        r"error: cannot write (the metrics log )?\S+\.jsonl \(epoch \d+\): No space left on device; "
        r"the checkpoints in \S+ are intact, and the same command resumes from the last one\."
    ),
}


@pytest.mark.parametrize(
    "what, size, epochs, extra, first",
    [
        ("checkpoint", "150k", 40, [], 0),  # fails writing the third checkpoint (step 24)
        # a log, near epoch 130, after a first run's checkpoint at epoch 10 and with no checkpoint due
        # before epoch 600 (with one every 100 epochs, the one at epoch 100 filled the disk at times)
        ("log", "200k", 600, ["--config.checkpoint_every_epochs=600"], 10),
    ],
    ids=["checkpoint", "log"],
)
def test_a_full_disk_ends_in_one_line(tmp_path, what, size, epochs, extra, first):
    """A disk that fills during training: exit 2 and one ``error:`` line naming the write that
    failed, with no traceback after it (Orbax's writers of the failed step settle before the
    process ends: no ``Event loop is closed``); the checkpoint saved before still loads whole."""

    def run(argv):
        return subprocess.run(
            argv, env=_env(tmp_path / "cache"), capture_output=True, text=True, cwd=tmp_path, timeout=50
        )

    with _small_disk(tmp_path / "disk", size) as disk:
        workdir = disk / "run"
        if first:  # a run of `first` epochs that ends in a checkpoint, which the next run resumes from
            done = run([*_command(workdir, first), f"--config.checkpoint_every_epochs={first}"])
            assert done.returncode == 0, done.stderr[-3000:]
        done = run([*_command(workdir, epochs), *extra])
        assert done.returncode == 2, done.stderr[-3000:]
        assert "Traceback" not in done.stderr and "Event loop is closed" not in done.stderr, done.stderr[-3000:]
        lines = done.stderr.splitlines()
        assert len(lines) == 1, done.stderr[-3000:]
        m = re.fullmatch(FULL_DISK_LINE[what], lines[0])
        assert m, lines[0]
        checkpoints = workdir / train.CHECKPOINT_DIR
        assert _committed(checkpoints), "no checkpoint was saved before the disk filled"
        _, meta = ckpt.load(str(checkpoints))  # digest checked
        assert meta["step"] == _committed(checkpoints)[-1]
        if what == "checkpoint":
            assert meta["step"] < int(m.group(1))
