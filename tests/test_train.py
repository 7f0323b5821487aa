"""Training end to end on tiny data: metrics, checkpoints, constraints, resume, divergence,
config validation and the command line.

Every run here is a tiny NAIS-Net (a handful of units, a few unroll steps) on a few hundred
examples, so each ``train_and_evaluate`` costs about one XLA compilation. Subprocess tests that
kill and restart training are marked ``slow``.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import ml_collections
import numpy as np
import pytest

from naisnet_jax import checkpoint as ckpt
from naisnet_jax import train
from naisnet_jax.projection import fc_delta

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # experiments import from the repository root
    sys.path.insert(0, str(REPO))

RECORD_FIELDS = {
    "epoch",
    "step",
    "learning_rate",
    "train_loss",
    "train_accuracy",
    "test_loss",
    "test_accuracy",
    "generalisation_gap",
    "rho_max",
    "epoch_seconds",
}
DEPTH_FIELDS = {"depth_mean", "depth_min", "depth_max"}
PROJECTION_RTOL = 1e-5  # float32 parameters: ||R^T R||_F may exceed delta by round-off


def get_config(name="digits_tiny", **overrides):
    """An experiment config, shrunk: 256 train / 100 test digits, an 8-unit block, 3 steps."""
    config = importlib.import_module(f"naisnet_jax.configs.{name}").get_config()
    config.limit_train = 256
    config.limit_test = 100  # not a multiple of eval_batch_size: the last eval batch is padded
    config.batch_size = 64  # 4 steps per epoch
    config.eval_batch_size = 64
    config.steps_per_chunk = 3  # chunks of 3 and 1 steps
    config.num_epochs = 2
    config.progress = False
    config.model_kwargs.features = 8
    config.model_kwargs.steps = 3
    for key, value in overrides.items():
        config[key] = value
    return config


def read_metrics(workdir):
    with open(os.path.join(workdir, train.METRICS_FILE)) as f:
        return [json.loads(line) for line in f if line.strip()]


def steps_of(workdir):
    directory = os.path.join(workdir, train.CHECKPOINT_DIR)
    return sorted(int(d) for d in os.listdir(directory) if d.isdigit())


def assert_trees_equal(a, b):
    a_leaves, a_def = jax.tree_util.tree_flatten(a)
    b_leaves, b_def = jax.tree_util.tree_flatten(b)
    assert a_def == b_def
    for x, y in zip(a_leaves, b_leaves):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def assert_projection_bounds(params, *, eps):
    """Every NAIS block of ``params`` lies in Algorithm 1's or 2's set (float64 numpy).

    Dense: ``||R^T R||_F <= 1 - 2 eps``. Conv (HWIO ``(..., k, k, C, C)``): centre taps
    ``-1 - delta_c`` and the other taps feeding channel ``c`` sum (in absolute value) to at most
    ``1 - eps - |delta_c|``. Returns the number of blocks checked.
    """
    checked = 0

    def visit(node):
        nonlocal checked
        if not hasattr(node, "items"):
            return
        if "R" in node:
            R = np.asarray(node["R"], np.float64)
            for Rk in R.reshape((-1,) + R.shape[-2:]):
                assert np.linalg.norm(Rk.T @ Rk, "fro") <= fc_delta(eps) * (1 + PROJECTION_RTOL)
            checked += 1
        if "state_kernel" in node:
            kernel = np.asarray(node["state_kernel"], np.float64)
            k, c = kernel.shape[-4], kernel.shape[-1]
            delta = np.asarray(node.get("delta", np.zeros(kernel.shape[:-4] + (c,))), np.float64)
            centre = np.diagonal(kernel[..., k // 2, k // 2, :, :], axis1=-2, axis2=-1)
            np.testing.assert_allclose(centre, -1.0 - delta, rtol=0, atol=1e-6)
            others = np.abs(kernel).sum(axis=(-4, -3, -2)) - np.abs(centre)
            assert np.all(others <= (1 - eps - np.abs(delta)) * (1 + PROJECTION_RTOL))
            checked += 1
        for value in node.values():
            visit(value)

    visit(params)
    return checked


def dense_rho(params, *, eps, h):
    """max over dense blocks of rho(I + h A), A = -R^T R - eps I, from float64 eigenvalues."""
    rhos = []
    for node in _dense_nodes(params):
        R = np.asarray(node["R"], np.float64)
        for Rk in R.reshape((-1,) + R.shape[-2:]):
            A = -Rk.T @ Rk - eps * np.eye(Rk.shape[1])
            rhos.append(np.max(np.abs(np.linalg.eigvals(np.eye(len(A)) + h * A))))
    return max(rhos)


def _dense_nodes(node):
    if hasattr(node, "items"):
        if "R" in node:
            yield node
        for value in node.values():
            yield from _dense_nodes(value)


def reference_eval(result, config):
    """Test loss and accuracy of the returned state, by numpy over the whole test split at once."""
    from naisnet_jax import data

    ds = data.load_dataset(config.dataset, limit_train=config.limit_train, limit_test=config.limit_test)
    x = ((ds.test_images / 255.0 - result["mean"]) / result["std"]).astype(np.float32)
    state = result["state"]
    logits = np.asarray(state.apply_fn({"params": state.params}, x, train=False), np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    loss = -np.mean(logp[np.arange(len(x)), ds.test_labels])
    accuracy = np.mean(np.argmax(logits, -1) == ds.test_labels)
    return loss, accuracy


def float_dtypes(tree):
    dtypes = {np.dtype(x.dtype) for x in jax.tree.leaves(tree)}
    return {d for d in dtypes if np.issubdtype(d, np.floating)}


# ----------------------------------------------------------------- one shared uninterrupted run


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """Two uninterrupted epochs of the tiny digits config; reused by several tests."""
    config = get_config()
    workdir = str(tmp_path_factory.mktemp("uninterrupted"))
    result = train.train_and_evaluate(config, workdir)
    return config, workdir, result


# ----------------------------------------------------------------- 1. end to end


@pytest.mark.parametrize("warmup", [0, 3, 10, 12])
def test_learning_rate_schedule_matches_a_python_loop(warmup):
    """The warm-up's steps run at learning_rate * lr_warmup_factor, then the drops apply as
    without it (a warm-up longer than the first drop is scaled on top of the decayed rate)."""
    from naisnet_jax.configs import default

    config = default.get_config()
    config.learning_rate, config.lr_decay_factor, config.lr_boundaries_epochs = 0.1, 0.1, [2, 3]
    config.lr_warmup_steps, config.lr_warmup_factor = warmup, 0.25
    schedule = train.learning_rate_schedule(config, steps_per_epoch=5)
    for step in range(20):
        expected = 0.1
        for boundary in (10, 15):
            if step >= boundary:
                expected *= 0.1
        if step < warmup:
            expected *= 0.25
        assert float(schedule(step)) == pytest.approx(expected, rel=1e-6), step
        assert float(schedule(np.int32(step))) == pytest.approx(expected, rel=1e-6), step


def test_metrics_records_every_documented_field(finished_run):
    config, workdir, result = finished_run
    records = read_metrics(workdir)
    steps_per_epoch = config.limit_train // config.batch_size
    assert [r["epoch"] for r in records] == [1, 2]
    for r in records:
        assert RECORD_FIELDS <= set(r), RECORD_FIELDS - set(r)
        assert all(math.isfinite(r[k]) for k in RECORD_FIELDS)
        assert r["step"] == r["epoch"] * steps_per_epoch
        assert r["learning_rate"] == pytest.approx(config.learning_rate)
        assert 0 <= r["train_accuracy"] <= 1 and 0 <= r["test_accuracy"] <= 1
        assert r["generalisation_gap"] == pytest.approx(r["train_accuracy"] - r["test_accuracy"])
        assert r["train_loss"] > 0 and r["test_loss"] > 0 and r["epoch_seconds"] >= 0
        assert 0 < r["rho_max"] <= 1
        if DEPTH_FIELDS & set(r):  # a fixed unroll reports its depth as K exactly
            assert r["depth_min"] == r["depth_mean"] == r["depth_max"] == config.model_kwargs.steps
    # The returned record is the last line of the log.
    assert {k: result[k] for k in records[-1]} == records[-1]


def test_every_chunk_of_a_run_runs_in_one_compiled_program(tmp_path, monkeypatch):
    """Chunks of 3 and 1 steps (4 steps an epoch): the last one is padded to 3 rows and runs
    in the program the first compiled, not in a second one."""
    made = []
    make = train.make_train_chunk

    def recording(*args, **kwargs):
        made.append(make(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(train, "make_train_chunk", recording)
    train.train_and_evaluate(get_config(num_epochs=1), str(tmp_path / "run"))
    assert len(made) == 1 and made[0]._cache_size() == 1


def test_a_padded_chunk_equals_a_python_loop_of_train_steps():
    """``num_steps`` of the padded rows, against the plain loop: ``train_step`` on each real
    batch with the keys of ``split(key, num_steps)`` (pad-and-crop augmentation on)."""
    from naisnet_jax import data as data_lib

    config = get_config()
    state = train.create_train_state(config, train.build_model(config, 10), (8, 8, 1), 4)
    rng = np.random.default_rng(0)
    d = data_lib.DeviceData(
        images=rng.integers(0, 255, (64, 8, 8, 1)).astype(np.uint8), labels=rng.integers(0, 10, 64).astype(np.int32)
    )
    idx = rng.permutation(64).astype(np.int32).reshape(4, 16)
    key = jax.random.PRNGKey(3)
    rows, count = train.chunk_rows(idx, 2, 3)
    assert count == 2 and rows.shape == (3, 16)
    np.testing.assert_array_equal(rows, np.concatenate([idx[2:], idx[2:3]]))
    chunk = train.make_train_chunk(0.5, 0.25, "crop")
    copy = jax.tree.map(np.array, state)  # the chunk donates its state
    got, metrics = chunk(state, d, rows, key, np.int32(count))

    step = jax.jit(train.train_step)
    expected, losses = copy, []
    for i, k in enumerate(jax.random.split(key, count)):
        batch = data_lib.get_batch(d, idx[2 + i], mean=0.5, std=0.25, key=k, augment="crop")
        expected, m = step(expected, batch)
        losses.append(float(m["loss"]))
    assert int(got.step) == int(copy.step) + 2
    for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(expected.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert float(metrics["loss"]) == pytest.approx(np.mean(losses), rel=1e-5)
    # any number of real steps: one program (the first call's input state is typed otherwise)
    got, _ = chunk(got, d, rows, key, np.int32(3))
    programs = chunk._cache_size()
    chunk(got, d, rows, key, np.int32(1))
    assert chunk._cache_size() == programs


def test_test_metrics_match_an_independent_evaluation(finished_run):
    config, workdir, result = finished_run
    loss, accuracy = reference_eval(result, config)
    # 100 examples = 64 + 36 in a padded batch; float32 division, so 1e-6 (one example is 1e-2)
    assert result["test_accuracy"] == pytest.approx(accuracy, abs=1e-6)
    assert result["test_loss"] == pytest.approx(loss, rel=1e-4)


def test_final_params_satisfy_the_projection_and_rho_max_is_exact(finished_run):
    config, _, result = finished_run
    params = result["state"].params
    assert assert_projection_bounds(params, eps=config.eps) == 1
    rho = dense_rho(params, eps=config.eps, h=config.h)
    assert rho <= 1
    assert result["rho_max"] == pytest.approx(rho, rel=1e-6)


def test_checkpoint_holds_the_final_state(finished_run):
    config, workdir, result = finished_run
    steps_per_epoch = config.limit_train // config.batch_size
    assert steps_of(workdir) == [steps_per_epoch, 2 * steps_per_epoch]
    state, meta = ckpt.load(os.path.join(workdir, train.CHECKPOINT_DIR))
    assert meta["format"] == ckpt.FORMAT and meta["epoch"] == 2 and meta["step"] == 2 * steps_per_epoch
    assert meta["model"] == config.model and meta["dataset"] == "digits" and meta["num_classes"] == 10
    assert meta["model_kwargs"]["features"] == 8 and meta["eps"] == config.eps
    assert int(state["step"]) == 2 * steps_per_epoch
    assert_trees_equal(state["params"], jax.device_get(result["state"].params))


def test_everything_trained_is_float32_even_with_x64(finished_run):
    # conftest turns x64 on; inputs are float32, so params, optimiser state and logits must be too.
    assert jax.config.jax_enable_x64
    _, workdir, result = finished_run
    state = result["state"]
    assert float_dtypes(state.params) == {np.dtype(np.float32)}
    assert float_dtypes(state.opt_state) <= {np.dtype(np.float32)}
    stored, _ = ckpt.load(os.path.join(workdir, train.CHECKPOINT_DIR))
    assert float_dtypes(stored) == {np.dtype(np.float32)}
    x = np.zeros((2, 8, 8, 1), np.float32)
    assert state.apply_fn({"params": state.params}, x, train=False).dtype == np.float32


@pytest.mark.parametrize(
    "model, model_kwargs, shape",
    [
        ("naisnet_mnist", {"features": 8, "steps": 3}, (8, 8, 1)),
        ("naisnet_conv_tiny", {}, (8, 8, 3)),
    ],
)
def test_train_step_computes_in_float32_with_x64(model, model_kwargs, shape):
    # Under x64 only weakly typed scalar constants may be float64; no float64 array may appear.
    import re

    config = get_config(model=model)
    config.model_kwargs = model_kwargs
    model = train.build_model(config, 10)
    state = jax.eval_shape(lambda: train.create_train_state(config, model, shape, 4))  # no compile
    assert float_dtypes(state.params) == {np.dtype(np.float32)}
    batch = (jax.ShapeDtypeStruct((4, *shape), np.float32), jax.ShapeDtypeStruct((4,), np.int32))
    jaxpr = str(jax.make_jaxpr(train.train_step)(state, batch))
    assert re.findall(r"f64\[\d[^\]]*\]", jaxpr) == []
    new_state, metrics = jax.eval_shape(train.train_step, state, batch)
    assert float_dtypes(new_state.params) == {np.dtype(np.float32)}
    assert float_dtypes(new_state.opt_state) <= {np.dtype(np.float32)}


def test_compiled_initial_state_equals_eager_init_and_compiles_once(monkeypatch):
    """The initial state as a GPU builds it (compiled once per model and shape, then run per
    seed) equals eager ``init``'s, BatchNorm statistics included; a second seed reuses the
    compiled program; under ``eval_shape`` it is traced like the rest."""
    config = get_config(model="naisnet_cifar10")  # one block of 8 channels, with BatchNorm statistics
    config.model_kwargs = ml_collections.ConfigDict(dict(stage_sizes=(1,), filters=(8,), steps=2))
    net = train.build_model(config, 10)
    shape = (8, 8, 3)

    def seeded(seed):
        c = ml_collections.ConfigDict(config.to_dict())
        c.seed = seed
        return c

    eager = train.initial_variables(seeded(0), net, shape)
    monkeypatch.setattr(train, "COMPILED_INIT_BACKENDS", (jax.default_backend(),))
    train._compiled_initializer.cache_clear()
    compiled = [train.initial_variables(seeded(s), net, shape) for s in (0, 1)]
    assert eager[1] is not None
    info = train._compiled_initializer.cache_info()
    assert (info.misses, info.hits) == (1, 1)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7), eager, compiled[0])
    assert not all(np.allclose(a, b) for a, b in zip(*(jax.tree.leaves(c[0]) for c in compiled)))  # seeds differ
    shapes = jax.eval_shape(lambda: train.initial_variables(config, net, shape))
    assert jax.tree.map(lambda a: a.shape, shapes) == jax.tree.map(lambda a: a.shape, tuple(compiled[0]))


def test_adaptive_depth_statistics(tmp_path):
    config = get_config(num_epochs=1, adaptive_tol=1e-2, max_steps=6)
    result = train.train_and_evaluate(config, str(tmp_path))
    (record,) = read_metrics(tmp_path)
    assert DEPTH_FIELDS <= set(record)
    assert 1 <= record["depth_min"] <= record["depth_mean"] <= record["depth_max"] <= 6
    assert record["depth_min"] == int(record["depth_min"]) and record["depth_max"] == int(record["depth_max"])
    assert assert_projection_bounds(result["state"].params, eps=config.eps) == 1
    assert record["rho_max"] <= 1


def test_metrics_are_strict_json_for_a_baseline_without_nais_blocks(tmp_path):
    # A ResNet baseline has no NAIS block, so it has no rho_max; the log must still be JSON that
    # any reader accepts (NaN and Infinity are not JSON).
    config = get_config(model="resnet_sh", num_epochs=1)
    config.model_kwargs = {"features": 8, "depth": 3}
    train.train_and_evaluate(config, str(tmp_path))

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    lines = (tmp_path / train.METRICS_FILE).read_text().splitlines()
    (record,) = [json.loads(line, parse_constant=refuse) for line in lines]
    assert RECORD_FIELDS - {"rho_max"} <= set(record)
    assert record.get("rho_max") is None


# ----------------------------------------------------------------- 2. TFDS paths (mocked)


@pytest.mark.parametrize(
    "dataset, model, augment, model_kwargs",
    [
        ("mnist", "naisnet_fc_tiny", False, {}),
        ("cifar10", "naisnet_conv_tiny", True, {"learn_delta": True}),
    ],
)
def test_tfds_datasets_under_mock_data(tmp_path, dataset, model, augment, model_kwargs):
    tfds = pytest.importorskip("tensorflow_datasets")
    config = get_config(
        dataset=dataset,
        model=model,
        augment=augment,
        num_epochs=1,
        batch_size=8,
        limit_train=None,
        limit_test=None,
        data_dir=str(tmp_path / "tfds"),
    )
    config.model_kwargs = dict(model_kwargs)
    with tfds.testing.mock_data(num_examples=16, policy=tfds.testing.MockPolicy.USE_CODE):
        result = train.train_and_evaluate(config, str(tmp_path / "work"))
    (record,) = read_metrics(tmp_path / "work")
    assert record["step"] == 2 and RECORD_FIELDS <= set(record)
    assert all(math.isfinite(record[k]) for k in RECORD_FIELDS)
    assert assert_projection_bounds(result["state"].params, eps=config.eps) >= 1
    assert record["rho_max"] <= 1
    _, meta = ckpt.load(str(tmp_path / "work" / train.CHECKPOINT_DIR))
    assert meta["dataset"] == dataset and meta["num_classes"] == 10


# ----------------------------------------------------------------- 3. resume


def test_resume_matches_uninterrupted_training(finished_run, tmp_path):
    config, dir_a, result_a = finished_run
    dir_b = str(tmp_path)
    first = train.train_and_evaluate(config, dir_b, stop_after_epochs=1)
    assert first["epoch"] == 1 and [r["epoch"] for r in read_metrics(dir_b)] == [1]
    result_b = train.train_and_evaluate(get_config(), dir_b)  # a fresh call, same config
    assert result_b["epoch"] == 2

    assert_trees_equal(jax.device_get(result_b["state"].params), jax.device_get(result_a["state"].params))
    assert_trees_equal(jax.device_get(result_b["state"].opt_state), jax.device_get(result_a["state"].opt_state))
    records_a, records_b = read_metrics(dir_a), read_metrics(dir_b)
    assert [r["epoch"] for r in records_b] == [1, 2]
    for ra, rb in zip(records_a, records_b):
        ra.pop("epoch_seconds"), rb.pop("epoch_seconds")
        assert ra == rb
    assert steps_of(dir_b) == steps_of(dir_a)

    # A third call on the finished workdir trains nothing and returns the last record.
    again = train.train_and_evaluate(get_config(), dir_b)
    assert again["epoch"] == 2 and again["test_accuracy"] == records_b[-1]["test_accuracy"]
    assert [r["epoch"] for r in read_metrics(dir_b)] == [1, 2]
    assert_trees_equal(jax.device_get(again["state"].params), jax.device_get(result_a["state"].params))


class Crash(Exception):
    """Stands in for the process dying at a chosen point."""


def test_crash_right_after_a_checkpoint_keeps_every_metrics_record(tmp_path, monkeypatch):
    # The process dies just after checkpoint 1 is committed (e.g. SIGKILL, power loss). The
    # restarted run resumes at epoch 2, so the record of epoch 1 must already be on disk.
    real_save = ckpt.save

    def save_then_die(*args, **kwargs):
        real_save(*args, **kwargs)
        raise Crash

    monkeypatch.setattr(ckpt, "save", save_then_die)
    with pytest.raises(Crash):
        train.train_and_evaluate(get_config(), str(tmp_path))
    monkeypatch.setattr(ckpt, "save", real_save)
    train.train_and_evaluate(get_config(), str(tmp_path))
    assert [r["epoch"] for r in read_metrics(tmp_path)] == [1, 2]


def _cli(workdir, *flags):
    return [
        sys.executable,
        "-m",
        "naisnet_jax.train_cli",
        f"--config={REPO / 'src/naisnet_jax/configs/digits_tiny.py'}",
        f"--workdir={workdir}",
        "--config.model_kwargs.features=8",
        "--config.model_kwargs.steps=3",
        *flags,
    ]


@pytest.mark.slow
def test_sigkill_then_restart_finishes_like_an_uninterrupted_run(tmp_path):
    # Many short epochs; SIGKILL as soon as the first checkpoint is committed, which lands
    # within the next epoch or two (possibly inside the metrics write or a later save).
    flags = ["--config.num_epochs=25", "--config.batch_size=32", "--config.keep_checkpoints=2"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    proc = subprocess.Popen(
        _cli(killed, *flags), env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    checkpoints = killed / train.CHECKPOINT_DIR
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir()):
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "training finished before it could be killed"
    assert ckpt.load(str(checkpoints))[1]["epoch"] < 25

    for workdir in (killed, clean):
        out = subprocess.run(_cli(workdir, *flags), env=env, cwd=REPO, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "test accuracy" in out.stdout and "after epoch 25" in out.stdout
        assert ("Resuming from" in out.stdout) == (workdir == killed)
    assert [r["epoch"] for r in read_metrics(killed)] == list(range(1, 26))
    state_k, meta_k = ckpt.load(str(killed / train.CHECKPOINT_DIR))
    state_c, meta_c = ckpt.load(str(clean / train.CHECKPOINT_DIR))
    assert meta_k["epoch"] == meta_c["epoch"] == 25
    assert_trees_equal(state_k, state_c)
    assert len(steps_of(killed)) <= 2  # keep_checkpoints is honoured across the restart


# ----------------------------------------------------------------- 5. divergence


def test_divergence_raises_and_keeps_the_last_good_checkpoint(tmp_path):
    workdir = str(tmp_path)
    train.train_and_evaluate(get_config(), workdir, stop_after_epochs=1)
    good_state, good_meta = ckpt.load(os.path.join(workdir, train.CHECKPOINT_DIR))
    # Resume with an absurd learning rate: within a few steps the float32 loss is inf or NaN.
    with pytest.raises(train.TrainingDiverged) as info:
        train.train_and_evaluate(get_config(learning_rate=1e37), workdir)
    message = str(info.value)
    assert "epoch 2" in message and ("nan" in message or "inf" in message)
    assert "learning_rate" in message and f"step {good_meta['step']}" in message
    assert steps_of(workdir) == [good_meta["step"]]  # nothing saved after the divergence
    state, meta = ckpt.load(os.path.join(workdir, train.CHECKPOINT_DIR))
    assert meta["epoch"] == 1
    assert_trees_equal(state, good_state)
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state["params"]))
    assert [r["epoch"] for r in read_metrics(workdir)] == [1]


def test_divergence_in_the_last_step_of_an_epoch_is_not_checkpointed(tmp_path):
    # One step per epoch: the step's loss (computed before its update) is finite, but the update
    # (learning rate 1e38) leaves parameters whose logits are NaN. The epoch's test loss is NaN,
    # so this epoch must not be saved as a good checkpoint nor logged as a finite record.
    config = get_config(learning_rate=1e38, batch_size=256, num_epochs=1)
    with pytest.raises(train.TrainingDiverged):
        train.train_and_evaluate(config, str(tmp_path))
    directory = tmp_path / train.CHECKPOINT_DIR
    assert not directory.exists() or steps_of(tmp_path) == []


# ----------------------------------------------------------------- 6. config validation


BAD_VALUES = [
    ("eps", 0.7),
    ("eps", 0.0),
    ("h", 0.0),
    ("h", 1.5),
    ("h", float("nan")),
    ("batch_size", 0),
    ("batch_size", -3),
    ("learning_rate", -1.0),
    ("learning_rate", float("inf")),
    ("momentum", 1.0),
    ("momentum", -0.1),
    ("weight_decay", -1e-4),
    ("lr_decay_factor", 0.0),
    ("lr_boundaries_epochs", [3, 2]),
    ("lr_boundaries_epochs", [0]),
    ("num_epochs", 0),
    ("eta", 0.001),
    ("model", "nope"),
    ("dataset", "nope"),
    ("limit_train", 0),
    ("adaptive_tol", 0.0),
    ("steps_per_chunk", 0),
    ("checkpoint_every_epochs", 0),
]


@pytest.fixture
def no_compilation(monkeypatch):
    """Fail the test if anything is jitted or a train state is built."""

    def refuse(*args, **kwargs):
        raise AssertionError("compilation started before the config was refused")

    monkeypatch.setattr(jax, "jit", refuse)
    for name in ("make_train_chunk", "make_evaluate", "create_train_state"):
        monkeypatch.setattr(train, name, refuse)


@pytest.mark.parametrize("field, value", BAD_VALUES, ids=[f"{f}={v!r}" for f, v in BAD_VALUES])
def test_bad_config_values_are_refused_before_compilation(tmp_path, no_compilation, field, value):
    config = get_config()
    config[field] = value
    with pytest.raises(ValueError, match=rf"config\.{field}\b"):
        train.train_and_evaluate(config, str(tmp_path / "work"))
    assert not (tmp_path / "work").exists()  # refused before anything is written


def test_unknown_model_kwargs_are_refused_before_compilation(tmp_path, no_compilation):
    config = get_config()
    config.model_kwargs.widht = 8
    with pytest.raises(ValueError, match=r"config\.model_kwargs.*widht"):
        train.train_and_evaluate(config, str(tmp_path))


@pytest.mark.parametrize("field", ["h", "eps"])
def test_model_kwargs_may_not_shadow_the_config_fields(tmp_path, no_compilation, field):
    """eps and h live once, at the top level: the projection, the model and the
    checkpoint metadata (read by the verifier) must agree."""
    config = get_config()
    config.model_kwargs[field] = 0.25
    with pytest.raises(ValueError, match=rf"config\.model_kwargs sets \['{field}'\]; set config\.{field}"):
        train.train_and_evaluate(config, str(tmp_path))


def test_batch_larger_than_the_dataset_is_refused_before_compilation(tmp_path, no_compilation):
    config = get_config(batch_size=257)  # limit_train = 256
    with pytest.raises(ValueError, match=r"config\.batch_size=257.*256"):
        train.train_and_evaluate(config, str(tmp_path))


# ----------------------------------------------------------------- 7. command line


def test_cli_trains_and_prints_the_test_accuracy(tmp_path):
    out = subprocess.run(
        _cli(tmp_path, "--config.num_epochs=1", "--config.limit_train=256", "--config.limit_test=100"),
        cwd=REPO,
        capture_output=True,
        text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (record,) = read_metrics(tmp_path)
    assert f"test accuracy {record['test_accuracy']:.4f} after epoch 1" in out.stdout
    assert steps_of(tmp_path) == [4]


def test_cli_refuses_a_bad_value_with_exit_code_2(tmp_path):
    out = subprocess.run(
        _cli(tmp_path / "work", "--config.eps=0.7"),
        cwd=REPO,
        capture_output=True,
        text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert out.returncode == 2
    assert "config.eps=0.7" in out.stderr and "(0, 0.5)" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "work").exists()


def test_resuming_with_other_speed_options_continues(tmp_path):
    """Speed options change neither the parameters nor the maths: a run resumes with others."""
    config = get_config(num_epochs=1)
    first = int(train.train_and_evaluate(config, str(tmp_path))["state"].step)
    other = get_config(num_epochs=2)
    other.model_kwargs.scan_unroll = 2
    other.model_kwargs.remat = "block"
    assert int(train.train_and_evaluate(other, str(tmp_path))["state"].step) == 2 * first > 0


def test_resuming_with_another_model_says_what_differs(tmp_path):
    config = get_config(num_epochs=1)
    train.train_and_evaluate(config, str(tmp_path))
    other = get_config(num_epochs=2)
    other.model_kwargs.features = 4
    with pytest.raises(
        ValueError,
        match=r"holds a run that differs from this one \(model_kwargs: checkpoint .*'features': 8.*now .*'features': 4",
    ):
        train.train_and_evaluate(other, str(tmp_path))


# ------------------------------------------------------------------ the run directory


def test_the_chunk_size_paces_the_progress_only(tmp_path):
    """Augmentation keys come from the step: chunks of 3 and 1 steps, or of 1, train the same
    parameters, bit for bit."""
    runs = {}
    for size in (3, 1):
        config = get_config(num_epochs=1, augment=True, steps_per_chunk=size)
        runs[size] = train.train_and_evaluate(config, str(tmp_path / f"chunk{size}"))
    jax.tree.map(np.testing.assert_array_equal, runs[3]["state"].params, runs[1]["state"].params)
    assert runs[3]["train_loss"] == pytest.approx(runs[1]["train_loss"], rel=1e-6)  # summed in another order


def test_a_checkpoint_of_the_former_key_stream_is_refused_for_resume_only(tmp_path):
    """A format-1 checkpoint (augmentation keys split per chunk) would resume another random
    stream: refused in one line; it still loads for evaluation and the verifier."""
    workdir = tmp_path / "run"
    train.train_and_evaluate(get_config(num_epochs=1), str(workdir))
    for meta_file in (workdir / train.CHECKPOINT_DIR).glob("*/metadata/metadata"):
        meta = json.loads(meta_file.read_text())
        meta["format_version"] = 1
        del meta[ckpt.METADATA_DIGEST]  # format 1 came before the metadata's own digest
        meta_file.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"format_version 1, written before augmentation keys came from the step"):
        train.train_and_evaluate(get_config(num_epochs=2), str(workdir))
    _, meta = ckpt.load(str(workdir / train.CHECKPOINT_DIR))
    assert meta["epoch"] == 1 and meta["format_version"] == 1


def test_resuming_another_seed_is_refused(tmp_path):
    train.train_and_evaluate(get_config(num_epochs=1), str(tmp_path))
    with pytest.raises(ValueError, match=r"differs from this one \(seeds: checkpoint \[0\], now \[5\]\)"):
        train.train_and_evaluate(get_config(num_epochs=2, seed=5), str(tmp_path))


def test_naming_a_model_default_resumes_the_same_network_and_another_value_is_refused(tmp_path):
    """The model is compared as built (its class's and its name's values under the run's keyword
    arguments), not as the keyword arguments spell it: naming tanh and x(0) = 0, the defaults, is
    the same run."""
    train.train_and_evaluate(get_config(num_epochs=1), str(tmp_path))
    same = get_config(num_epochs=2)
    same.model_kwargs.activation = "tanh"
    same.model_kwargs.initial_state = "zero"
    train.train_and_evaluate(same, str(tmp_path))
    assert [r["epoch"] for r in read_metrics(tmp_path)] == [1, 2]
    other = get_config(num_epochs=3)
    other.model_kwargs.activation = "relu"
    with pytest.raises(ValueError, match=r"differs from this one \(model_kwargs: checkpoint"):
        train.train_and_evaluate(other, str(tmp_path))


def test_an_old_log_without_a_checkpoint_is_kept_beside_the_new(tmp_path, capsys):
    old = [{"epoch": 1, "step": 4}, {"epoch": 2, "step": 8}, {"epoch": 3, "step": 12}]
    (tmp_path / train.METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in old))
    train.train_and_evaluate(get_config(num_epochs=1), str(tmp_path))
    kept = tmp_path / "metrics.1.jsonl"
    assert [json.loads(line) for line in kept.read_text().splitlines()] == old
    assert [r["epoch"] for r in read_metrics(tmp_path)] == [1]
    assert f"kept as {kept}" in capsys.readouterr().err


def test_a_scalars_log_already_there_on_a_fresh_start_is_kept_beside_not_emptied(tmp_path, capsys):
    """A run without a checkpoint (deleted, or never saved) left its scalars; or the file is the
    user's own, not even JSON. Neither is emptied: it is renamed, and said, as the metrics log is."""
    from naisnet_jax import metric_writers

    old = [{"step": 4, "train_loss": 1.0}, {"step": 8, "train_loss": 0.5}]
    scalars = tmp_path / metric_writers.SCALARS_FILE
    scalars.write_text("".join(json.dumps(r) + "\n" for r in old))
    train.train_and_evaluate(get_config(num_epochs=1), str(tmp_path))
    kept = tmp_path / "scalars.1.jsonl"
    assert [json.loads(line) for line in kept.read_text().splitlines()] == old
    assert all(json.loads(line)["step"] <= 4 for line in scalars.read_text().splitlines())  # the new run's own
    assert f"{scalars} was there before this run, which has no checkpoint; kept as {kept}" in capsys.readouterr().err

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.jsonl").write_text("precious\n")
    train.train_and_evaluate(
        get_config(num_epochs=1), str(mine), writer=metric_writers.JsonlWriter(mine / "notes.jsonl")
    )
    assert (mine / "notes.1.jsonl").read_text() == "precious\n"


def test_a_metrics_log_that_is_not_ours_is_refused_before_the_checkpoint_folder_is_made(tmp_path):
    (tmp_path / train.METRICS_FILE).write_text('{"step": 3}\n')
    with pytest.raises(ValueError, match=r"record 1: \{\"step\": 3\} is not an epoch record"):
        train.train_and_evaluate(get_config(num_epochs=1), str(tmp_path))
    assert not (tmp_path / train.CHECKPOINT_DIR).exists()
    assert (tmp_path / train.METRICS_FILE).read_text() == '{"step": 3}\n'


def test_a_log_deleted_during_the_run_is_written_anew(tmp_path, capsys):
    from naisnet_jax import engine

    view = {"model": "m", "seeds": [0]}
    with engine.RunDirectory(str(tmp_path), view) as run:
        assert run.resume({}) is None
        run.commit(1, 4, [{"epoch": 1, "step": 4}], None, None)
        os.remove(run.metrics_path)
        run.commit(2, 8, [{"epoch": 2, "step": 8}], None, None)
    assert read_metrics(tmp_path) == [{"epoch": 1, "step": 4}, {"epoch": 2, "step": 8}]
    assert "was deleted during the run; written anew from the 1 records" in capsys.readouterr().err


def test_resuming_with_other_optimiser_settings_says_so(tmp_path, capsys):
    train.train_and_evaluate(get_config(num_epochs=1), str(tmp_path))
    capsys.readouterr()
    train.train_and_evaluate(get_config(num_epochs=2, learning_rate=0.05, batch_size=32), str(tmp_path))
    err = capsys.readouterr().err
    assert (
        f"notice: resuming {tmp_path} with learning_rate 0.05 (the checkpoint's: 0.1), "
        "batch_size 32 (the checkpoint's: 64)." in err
    )


def test_a_complete_run_says_so(tmp_path, capsys):
    train.train_and_evaluate(get_config(num_epochs=1), str(tmp_path))
    capsys.readouterr()
    train.train_and_evaluate(get_config(num_epochs=1), str(tmp_path))
    out = capsys.readouterr().out
    assert f"{tmp_path} holds a complete run of 1 epochs (config.num_epochs=1): nothing left to train" in out
    assert "Resuming" not in out
    # a command names the field by its own flag
    train.train_and_evaluate(get_config(num_epochs=1), str(tmp_path), labels={"num_epochs": "--epochs"})
    out = capsys.readouterr().out
    assert "holds a complete run of 1 epochs (--epochs=1): nothing left to train; raise --epochs to train on." in out


def test_progress_off_a_terminal_says_a_line_every_interval(capsys, monkeypatch):
    from naisnet_jax import engine

    clock = iter([0.0, 10.0, 31.0, 40.0, 70.0])
    monkeypatch.setattr(engine.time, "monotonic", lambda: next(clock))
    bar = engine.LineProgress(100, "step", interval=30.0)  # starts at 0 s
    bar.set_postfix(epoch=1)
    for _ in range(4):  # at 10, 31, 40 and 70 s
        bar.update(25)
    assert capsys.readouterr().err.splitlines() == ["50/100 steps (50%), epoch 1", "100/100 steps (100%), epoch 1"]


def test_a_checkpoints_path_that_is_a_file_is_refused_before_training(tmp_path):
    (tmp_path / train.CHECKPOINT_DIR).write_text("not a directory")
    with pytest.raises(ckpt.CheckpointWriteError, match=r"checkpoints: it is a file, not a directory\.$"):
        train.train_and_evaluate(get_config(num_epochs=1), str(tmp_path))
    assert not (tmp_path / train.METRICS_FILE).exists()


def test_a_checkpoint_write_that_fails_later_ends_at_once(tmp_path):
    """The checkpoints directory turns into a file during epoch 2: the save of step 8 fails in
    seconds, in one line naming the step and the cause; epoch 1's checkpoint stays intact."""
    checkpoints = tmp_path / train.CHECKPOINT_DIR
    moved = tmp_path / "kept"

    class Sabotage:
        def write_scalars(self, step, scalars):
            if scalars.get("epoch/epoch") == 2:
                checkpoints.rename(moved)
                checkpoints.write_text("a file now")

    start = time.time()
    with pytest.raises(ckpt.CheckpointWriteError, match=r"checkpoints \(step 8\): it is a file, not a directory\.$"):
        train.train_and_evaluate(get_config(num_epochs=2), str(tmp_path), writer=Sabotage())
    assert time.time() - start < 60
    _, meta = ckpt.load(str(moved))
    assert meta["epoch"] == 1


def test_a_metrics_log_that_cannot_be_written_ends_in_one_line(tmp_path, monkeypatch):
    """A full disk under the metrics log at epoch 2: one line naming the log, the epoch and the
    cause; epoch 1's checkpoint is intact."""
    import errno

    from naisnet_jax import engine
    from naisnet_jax import metric_writers as mw

    write = mw.JsonlWriter.write_record

    def full_at_epoch_2(self, record):
        if record.get("epoch") == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        write(self, record)

    monkeypatch.setattr(mw.JsonlWriter, "write_record", full_at_epoch_2)
    with pytest.raises(engine.RunWriteError, match=r"metrics\.jsonl \(epoch 2\): No space left on device; the checkpo"):
        train.train_and_evaluate(get_config(num_epochs=2), str(tmp_path))
    _, meta = ckpt.load(str(tmp_path / train.CHECKPOINT_DIR))
    assert meta["epoch"] == 1
