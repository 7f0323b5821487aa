"""Data-parallel training: the sharded step gives the single-device numbers.

``--xla_force_host_platform_device_count`` must be set before jax initialises, so
the comparison runs in a fresh Python process with two CPU devices.
"""

import json
import os
import subprocess
import sys
import textwrap
import types

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, sys, tempfile
    import jax, numpy as np
    from naisnet_jax.configs import digits_tiny
    from naisnet_jax import train

    assert jax.device_count() == 2, jax.devices()

    def run(num_devices):
        config = digits_tiny.get_config()
        config.model = "naisnet_conv_tiny"   # convolutions, BatchNorm (synchronised), projection
        config.model_kwargs = {"steps": 2}
        config.limit_train, config.limit_test = 192, 100
        config.batch_size, config.eval_batch_size = 32, 50
        config.num_epochs, config.steps_per_chunk = 1, 3
        config.augment = True                # per-example random crops must not depend on sharding
        config.num_devices = num_devices
        with tempfile.TemporaryDirectory() as workdir:
            out = train.train_and_evaluate(config, workdir)
        return out

    one, two = run(1), run(2)
    leaves = jax.tree.leaves(two["state"].params)
    devices = {len(leaf.sharding.device_set) for leaf in leaves}
    diffs = [float(np.max(np.abs(np.asarray(a) - np.asarray(b)) / (1e-3 + np.abs(np.asarray(b)))))
             for a, b in zip(jax.tree.leaves(two["state"].params), jax.tree.leaves(one["state"].params))]
    stats = [float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
             for a, b in zip(jax.tree.leaves(two["state"].batch_stats), jax.tree.leaves(one["state"].batch_stats))]
    # the compiled step really splits the batch: it all-reduces the gradients
    mesh = train.make_mesh(2)
    chunk = train.make_train_chunk(0.0, 1.0, False, mesh)
    state = train.replicate(one["state"], mesh)
    rows = train.replicate(np.zeros((1, 32), np.int32), mesh)
    hlo = chunk.lower(state, train.replicate(one["test_data"], mesh), rows,
                      train.replicate(jax.random.PRNGKey(0), mesh)).compile().as_text()

    def collectives(model_kwargs):
        # (ops, ops inside a block's loop) of the compiled data-parallel step of a
        # naisnet_conv_tiny with 4 steps per block: each an (op, op_name) pair
        import re
        from naisnet_jax import data as data_lib
        config = digits_tiny.get_config()
        config.model, config.model_kwargs = "naisnet_conv_tiny", {"steps": 4, **model_kwargs}
        net = train.build_model(config, 10, batch_axis=train.DATA_AXIS)
        st = train.create_train_state(config, net, (8, 8, 1), 10)
        d = data_lib.DeviceData(images=np.zeros((64, 8, 8, 1), np.uint8), labels=np.zeros(64, np.int32))
        text = chunk.lower(train.replicate(st, mesh), train.replicate(d, mesh),
                           train.replicate(np.zeros((2, 32), np.int32), mesh),
                           train.replicate(jax.random.PRNGKey(0), mesh)).compile().as_text()
        ops = [(m.group(1), m.group(2)) for m in re.finditer(
            r'= [^=]*? (all-reduce|all-gather|all-to-all|collective-permute)(?:-start)?\\(.*?op_name="([^"]*)"', text)]
        return ops, [o for o in ops if re.search(r"block\\d+/while", o[1])]

    loops = {}
    for name, kw in (("autodiff", {}), ("stacked", {"block_vjp": "stacked"})):
        ops, in_loops = collectives(kw)
        loops[name] = {"kinds": sorted({o[0] for o in ops}), "in_block_loops": len(in_loops)}
    print(json.dumps({
        "collectives": loops,
        "devices": sorted(devices), "param_rel_diff": max(diffs), "batch_stats_diff": max(stats),
        "loss": [one["train_loss"], two["train_loss"]], "test": [one["test_accuracy"], two["test_accuracy"]],
        "all_reduce": "all-reduce" in hlo,
    }))
    """
)


def _run_on_two_cpu_devices(script: str) -> dict:
    """Run ``script`` in a fresh Python with two CPU devices; its last line of output, as JSON."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([root, os.path.join(root, "src")]),
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_sharded_training_matches_single_device():
    result = _run_on_two_cpu_devices(SCRIPT)
    assert result["devices"] == [2]  # parameters replicated over both devices
    assert result["all_reduce"]
    # Data parallelism by shard_map: each device unrolls its own rows; no collective runs inside a
    # block's K-step loop (the partitioner all-reduced the state kernel's gradient at every step),
    # and no device gathers the others' rows (it did, for the stacked VJP's weight gradients).
    for name, found in result["collectives"].items():
        assert found["in_block_loops"] == 0, (name, found)
        assert found["kinds"] == ["all-reduce"], (name, found)
    assert result["param_rel_diff"] < 1e-4, result
    assert result["batch_stats_diff"] < 1e-5, result
    assert result["loss"][0] == pytest.approx(result["loss"][1], rel=1e-5)
    assert result["test"][0] == pytest.approx(result["test"][1], abs=0.011)  # one example of 100


SIDE_STREAM_SCRIPT = textwrap.dedent(
    """
    import json
    import jax, numpy as np
    from naisnet_jax.kernels import common
    from naisnet_jax.configs import digits_tiny
    from naisnet_jax import data as data_lib, train

    def run(side_stream):
        common.gpu_backend = lambda: side_stream  # as on a GPU: the weight gradients on stream 1
        mesh = train.make_mesh(2)
        config = digits_tiny.get_config()
        config.model, config.model_kwargs = "naisnet_conv_tiny", {"steps": 4, "block_vjp": "stacked"}
        net = train.build_model(config, 10, batch_axis=train.DATA_AXIS)
        state = train.create_train_state(config, net, (8, 8, 1), 10)
        rng = np.random.default_rng(0)
        d = data_lib.DeviceData(images=rng.integers(0, 255, (64, 8, 8, 1)).astype(np.uint8),
                                labels=rng.integers(0, 10, 64).astype(np.int32))
        args = [train.replicate(a, mesh) for a in
                (state, d, np.arange(64, dtype=np.int32).reshape(2, 32), jax.random.PRNGKey(0))]
        lowered = train.make_train_chunk(0.0, 1.0, False, mesh).lower(*args)
        out, _ = lowered.compile()(*args)
        return out.params, "_xla_stream_annotation" in lowered.as_text()

    plain, plain_annotated = run(False)
    side, side_annotated = run(True)
    diff = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
               for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(side)))
    print(json.dumps({"annotated": [plain_annotated, side_annotated], "max_diff": diff}))
    """
)


def test_side_stream_weight_gradients_inside_the_data_parallel_step():
    """The stacked VJP's weight gradients on a second stream (forced here, as on a GPU) inside
    ``shard_map``: the step compiles with the annotation and trains to the same parameters."""
    result = _run_on_two_cpu_devices(SIDE_STREAM_SCRIPT)
    assert result["annotated"] == [False, True]
    assert result["max_diff"] == 0.0, result


def test_bad_device_counts_are_refused():
    import jax
    import numpy as np

    from naisnet_jax import train

    two = types.SimpleNamespace(devices=np.empty(2, object))  # only .devices.size is read
    train.check_batch_divides({"batch_size": 4, "eval_batch_size": 6}, two)
    with pytest.raises(ValueError, match=r"config.eval_batch_size=5 is not a multiple of the 2 devices"):
        train.check_batch_divides({"batch_size": 4, "eval_batch_size": 5}, two)
    n = jax.device_count()
    with pytest.raises(ValueError, match=rf"num_devices={n + 1} is outside \[1, {n}\]"):
        train.make_mesh(n + 1)


SWEEP_SCRIPT = textwrap.dedent(
    """
    import json, re, tempfile
    import jax, numpy as np
    from naisnet_jax.configs import digits_tiny
    from naisnet_jax import sweep

    assert jax.device_count() == 2, jax.devices()

    def config(num_devices):
        c = digits_tiny.get_config()
        c.model, c.model_kwargs = "naisnet_conv_tiny", {"steps": 2}
        c.limit_train, c.limit_test = 128, 64
        c.batch_size, c.eval_batch_size = 32, 32
        c.num_epochs, c.steps_per_chunk = 1, 2
        c.num_devices = num_devices
        return c

    def run(num_devices, seeds):
        with tempfile.TemporaryDirectory() as workdir:
            out = sweep.train_sweep(config(num_devices), workdir, seeds=seeds, audit=False,
                                    per_step_loss=False, verbose=False)
        return out

    one, two = run(1, (3, 4)), run(None, (3, 4))
    devices = sorted({len(leaf.sharding.device_set) for leaf in jax.tree.leaves(two.state.params)})
    diffs = [float(np.max(np.abs(np.asarray(a) - np.asarray(b)) / (1e-3 + np.abs(np.asarray(b)))))
             for a, b in zip(jax.tree.leaves(two.state.params), jax.tree.leaves(one.state.params))]
    odd = sweep.seed_mesh(config(None), 3).devices.size  # 3 seeds do not split over 2 devices
    # the compiled epoch of two seeds on two devices: no communication at all
    s = sweep.prepare(config(None), (3, 4))
    fn = sweep.make_sweep_epoch(s.mean, s.std, augment=True, batch_size=32, eval_batch_size=32, mesh=s.mesh)
    text = fn.lower(s.state, sweep.shard_seeds(np.zeros(2, np.int32), s.mesh), s.base_keys,
                    s.train_data, s.test_data, np.int32(1)).compile().as_text()
    collectives = sorted(set(re.findall(r"(all-reduce|all-gather|all-to-all|collective-permute)", text)))
    print(json.dumps({"devices": devices, "param_rel_diff": max(diffs), "odd": odd,
                      "collectives": collectives, "mesh": int(s.mesh.devices.size),
                      "test": [[r.test_accuracy for r in one.runs], [r.test_accuracy for r in two.runs]]}))
    """
)


def test_sweep_spreads_seeds_over_devices():
    """Two seeds on two CPU devices: one seed per device, no collective in the compiled epoch,
    and each seed's parameters those of the one-device sweep."""
    result = _run_on_two_cpu_devices(SWEEP_SCRIPT)
    assert result["mesh"] == 2 and result["devices"] == [2]  # the seed axis split over both
    assert result["collectives"] == [], result  # seeds are independent: nothing to exchange
    assert result["odd"] == 1  # 3 seeds: the most devices that divide them evenly
    assert result["param_rel_diff"] < 1e-4, result
    for a, b in zip(*result["test"]):
        assert a == pytest.approx(b, abs=0.02)  # one example of 64


HOPPER_SCRIPT = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    import ml_collections
    from naisnet_jax.configs import digits_tiny
    from naisnet_jax import train
    from naisnet_jax.kernels import common

    assert jax.device_count() == 2, jax.devices()
    config = digits_tiny.get_config()
    config.model = "naisnet_conv_tiny"
    config.model_kwargs = ml_collections.ConfigDict({"steps": 2, "filters": (16, 32), "block_vjp": "fused"})
    model = train.build_model(config, 10, batch_axis=train.DATA_AXIS)
    state = train.create_train_state(config, model, (8, 8, 1), steps_per_epoch=10)
    # as on a Hopper GPU: the fused blocks take the wgmma kernels
    common.gpu_backend = lambda: True
    common.gpu_kernels_available = lambda x0: True
    common.hopper_available = lambda: True
    mesh = train.make_mesh(2)
    x = jnp.zeros((8, 8, 8, 1), jnp.float32)
    y = jnp.zeros((8,), jnp.int32)
    step = jax.jit(lambda s, x, y: train.data_parallel_step(s, (x, y), mesh))
    text = step.trace(state, x, y).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu_v2" in line]
    print(json.dumps({"calls": len(calls), "local": sum("tensor<4x" in c for c in calls),
                      "global": sum("tensor<8x" in c for c in calls)}))
    """
)


def test_data_parallel_step_lowers_with_wgmma_kernels_per_device():
    """On two GPUs each device runs the wgmma block kernels on its own half of the batch: the
    sharded step lowers for CUDA with every Mosaic kernel at the per-device batch (4 of 8)."""
    result = _run_on_two_cpu_devices(HOPPER_SCRIPT)
    assert result["calls"] >= 4, result  # forward and backward kernels of both stages
    assert result["local"] == result["calls"] and result["global"] == 0, result


PER_DEVICE_BN_SCRIPT = textwrap.dedent(
    """
    import json, re
    import jax, jax.numpy as jnp, numpy as np
    from naisnet_jax.configs import digits_tiny
    from naisnet_jax import data as data_lib, train

    config = digits_tiny.get_config()
    config.model, config.model_kwargs = "naisnet_conv_tiny", {"steps": 2}
    state = train.create_train_state(config, train.build_model(config, 10), (8, 8, 1), 10)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8, 8, 1)).astype(np.float32)
    y = rng.integers(0, 10, 32).astype(np.int32)
    mesh = train.make_mesh(2)

    def sharded(sync):  # BatchNorm across the devices: a model built with the mesh's axis
        net = train.build_model(config, 10, batch_axis=train.batch_norm_axis(mesh, sync))
        st = state.replace(apply_fn=net.apply)
        step = jax.jit(lambda s, b: train.data_parallel_step(s, b, mesh, sync_batch_norm=sync))
        args = (train.replicate(st, mesh), train.replicate((x, y), mesh))
        text = step.lower(*args).compile().as_text()
        new, metrics = step(*args)
        return new, metrics, len(re.findall(r" all-reduce(?:-start)?\\(", text))

    # the reference: each half of the batch through the model alone (its own BatchNorm
    # statistics), the two gradients averaged, one update; running averages averaged
    grads, stats, losses = [], [], []
    for half in (slice(0, 16), slice(16, 32)):
        def loss_fn(p):
            logits, upd = state.apply_fn({"params": p, "batch_stats": state.batch_stats}, x[half],
                                         train=True, mutable=["batch_stats"])
            return jnp.mean(train.cross_entropy(logits, y[half])), upd
        (loss, upd), g = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        grads.append(g); stats.append(upd["batch_stats"]); losses.append(float(loss))
    mean = lambda a, b: (a + b) / 2
    expected = state.apply_gradients(grads=jax.tree.map(mean, *grads))
    expected_stats = jax.tree.map(mean, *stats)

    local, metrics, local_reduces = sharded(False)
    _, _, global_reduces = sharded(True)
    rel = lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)) / (1e-3 + np.abs(np.asarray(b)))))
    bn_layers = len([p for p, _ in jax.tree_util.tree_flatten_with_path(state.batch_stats)[0]
                     if "mean" in jax.tree_util.keystr(p)])
    print(json.dumps({
        "params": max(rel(a, b) for a, b in zip(jax.tree.leaves(local.params), jax.tree.leaves(expected.params))),
        "stats": max(rel(a, b) for a, b in zip(jax.tree.leaves(local.batch_stats), jax.tree.leaves(expected_stats))),
        "loss": [float(metrics["loss"]), float(np.mean(losses))],
        "all_reduces": [local_reduces, global_reduces], "bn_layers": bn_layers,
    }))
    """
)


def test_per_device_batch_norm_is_each_half_alone_with_the_gradients_averaged():
    """``sync_batch_norm=False``: each device normalises its rows by their own statistics. The
    reference runs each half of the batch through the model on its own, averages the two
    gradients into one update and the two running averages into one; the compiled step loses
    the BatchNorm layers' all-reduces: what is left (gradients, running averages, metrics) XLA
    combines into one, where the synchronised step all-reduces each layer's statistics in turn."""
    result = _run_on_two_cpu_devices(PER_DEVICE_BN_SCRIPT)
    assert result["params"] < 1e-5, result
    assert result["stats"] < 1e-6, result
    assert result["loss"][0] == pytest.approx(result["loss"][1], rel=1e-6)
    local, synced = result["all_reduces"]
    assert local == 1 and synced >= 1 + result["bn_layers"], result


def test_scaling_benchmark_smoke_both_batch_norms(tmp_path):
    """``benchmarks/scaling.py --smoke`` (2 CPU devices): weak and strong rows for BatchNorm by
    the whole batch and by each device, against the targets (95% weak, 90% strong on 2)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.path.join(root, "src")]))
    script = os.path.join(root, "benchmarks", "scaling.py")
    args = [sys.executable, script, f"--out={tmp_path}", "--smoke", "--batch-norm=global,device"]
    proc = subprocess.run(
        [*args, "--per-device-batch=4,8"], env=env, cwd=root, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "scaling.json") as f:
        result = json.load(f)
    rows, runs = result["rows"], result["runs"]
    names = [
        "weak: 1 -> 2 devices",
        "strong: 1 -> 2 devices",
        "weak: 1 -> 2 devices, BatchNorm per device",
        "strong: 1 -> 2 devices, BatchNorm per device",
    ]
    expected = [
        (n.replace("devices", f"devices, {b} images a device", 1), 95.0 if n[0] == "w" else 90.0)
        for b in (4, 8)
        for n in names
    ]
    assert [(r["name"], r["target"]) for r in rows] == expected
    # one device at 8 images serves the strong rows of 4 a device and the weak rows of 8: measured once
    assert sorted(runs) == ["1x16", "1x4", "1x8", "2x16", "2x16_device_bn", "2x8", "2x8_device_bn"]
    for r in rows:
        assert r["efficiency"] > 0 and r["pass"] == (r["efficiency"] >= r["target"])
    weak4, strong4 = rows[0], rows[1]
    assert (
        weak4["images_per_s_1"] == runs["1x4"]["images_per_s"]
        and strong4["images_per_s_1"] == runs["1x8"]["images_per_s"]
    )
    # a single batch keeps the plain names; typed mistakes are one line, exit 2
    proc = subprocess.run(
        [*args, "--per-device-batch=8"], env=env, cwd=root, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "scaling.json") as f:
        assert [r["name"] for r in json.load(f)["rows"]] == names
    proc = subprocess.run(
        [*args, "--per-device-batch=8,x"], env=env, cwd=root, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 2 and "--per-device-batch='8,x'" in proc.stderr
