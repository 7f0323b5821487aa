"""Performance options (scan unrolling, ...) against the plain loop and the default path."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import naisnet_jax as nj
from naisnet_jax import models as M
from naisnet_jax import train
from naisnet_jax.kernels import common
from naisnet_jax.models import nais

KEY = jax.random.key(0, impl="rbg")


def _f64(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def _fc_system(rng, n=5, batch=3):
    R = nj.project_fc(jnp.asarray(rng.standard_normal((n, n))), eps=0.05)
    A = np.asarray(nj.fc_state_matrix(R, 0.05))
    drive = rng.standard_normal((batch, n))
    return A, drive


# ------------------------------------------------------------------ scan_unroll


@pytest.mark.parametrize("scan_unroll", [2, 3, True])
def test_unroll_scan_unroll_matches_python_loop(scan_unroll):
    rng = np.random.default_rng(0)
    A, drive = _fc_system(rng)
    step = functools.partial(nj.fc_step, drive=jnp.asarray(drive), A=jnp.asarray(A), h=0.6)
    x, xs = nj.unroll(step, jnp.zeros((3, 5)), steps=7, trajectory=True, scan_unroll=scan_unroll)
    ref, traj = np.zeros((3, 5)), []
    for _ in range(7):
        ref = ref + 0.6 * np.tanh(ref @ A.T + drive)
        traj.append(ref)
    np.testing.assert_allclose(x, ref, rtol=1e-12)
    np.testing.assert_allclose(xs, np.stack(traj), rtol=1e-12)


def test_unroll_untied_and_bounded_accept_scan_unroll():
    rng = np.random.default_rng(1)
    As = np.stack([_fc_system(rng)[0] for _ in range(4)])
    drives = rng.standard_normal((4, 3, 5))
    x = nj.unroll(
        lambda x, p: nj.fc_step(x, p[1], p[0]),
        jnp.zeros((3, 5)),
        steps=4,
        xs=(jnp.asarray(As), jnp.asarray(drives)),
        scan_unroll=3,
    )
    ref = np.zeros((3, 5))
    for k in range(4):
        ref = ref + np.tanh(ref @ As[k].T + drives[k])
    np.testing.assert_allclose(x, ref, rtol=1e-12)

    A, drive = _fc_system(rng, batch=6)
    drive = drive * np.linspace(0.1, 5, 6)[:, None]
    step = functools.partial(nj.fc_step, drive=jnp.asarray(drive), A=jnp.asarray(A))
    x0 = jnp.zeros((6, 5))
    ref_x, ref_depth = nj.unroll_adaptive(step, x0, tol=1e-3, max_steps=60)
    for u in (4, True):
        x, depth = nj.unroll_adaptive_bounded(step, x0, tol=1e-3, max_steps=60, scan_unroll=u)
        np.testing.assert_array_equal(depth, ref_depth)
        np.testing.assert_allclose(x, ref_x, rtol=0, atol=1e-13)


@pytest.mark.parametrize("bad", [0, -2, 1.5, "2", None])
def test_bad_scan_unroll_is_refused(bad):
    with pytest.raises(ValueError, match="scan_unroll="):
        nj.unroll(lambda x: x, jnp.zeros((1, 2)), steps=3, scan_unroll=bad)
    with pytest.raises(ValueError, match="scan_unroll="):
        M.NaisNetFC(scan_unroll=bad)
    with pytest.raises(ValueError, match="scan_unroll="):
        M.NaisConvBlock(4, scan_unroll=bad)


def _value_and_grad(model, variables, x, train=True):
    """Loss and parameter gradients of a model (float64 parameters)."""

    def loss(params):
        v = dict(variables, params=params)
        if "batch_stats" in v:
            logits, _ = model.apply(v, x, train=train, mutable=["batch_stats"])
        else:
            logits = model.apply(v, x, train=train)
        return jnp.sum(jnp.sin(logits))

    return jax.jit(jax.value_and_grad(loss))(variables["params"])


def _init(model, x):
    return _f64(jax.jit(model.init)(KEY, x))


# ------------------------------------------------------- block VJP, remat, dtype


@pytest.mark.parametrize("residuals", ["store", "recompute"])
def test_unroll_tied_matches_python_loop_values_and_gradients(residuals):
    """Values against a numpy loop; gradients against reverse mode through a Python loop."""
    rng = np.random.default_rng(4)
    cases = [  # (op, activation, x shape, W, drive)
        (nj.kernels.dense_op, "tanh", (4, 5), 0.4 * rng.standard_normal((5, 5)), rng.standard_normal((4, 5))),
        (
            nj.kernels.dense_op,
            "relu",
            (4, 5),
            0.4 * rng.standard_normal((5, 5)),
            rng.standard_normal((5,)),
        ),  # a drive broadcast over the batch
        (
            nj.kernels.conv_op,
            "relu",
            (2, 5, 6, 3),
            0.3 * rng.standard_normal((3, 3, 3, 3)),
            rng.standard_normal((2, 5, 6, 3)),
        ),
    ]
    for op, activation, shape, W, drive in cases:
        act = jnp.tanh if activation == "tanh" else jax.nn.relu
        x0 = rng.standard_normal(shape)

        def loop(x0, drive, W):
            x = x0
            for _ in range(4):
                x = x + 0.7 * act(op(x, W) + drive)
            return x

        def fast(x0, drive, W):
            return nj.unroll_tied(op, x0, drive, W, steps=4, h=0.7, activation=activation, residuals=residuals)

        args = tuple(jnp.asarray(a) for a in (x0, drive, W))
        ref_x = x0
        for _ in range(4):
            z = (
                ref_x @ W.T
                if op is nj.kernels.dense_op
                else np.asarray(
                    jax.lax.conv_general_dilated(ref_x, W, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
                )
            ) + drive
            ref_x = ref_x + 0.7 * (np.tanh(z) if activation == "tanh" else np.maximum(z, 0))
        np.testing.assert_allclose(jax.jit(fast)(*args), ref_x, rtol=1e-12, atol=1e-12)

        def loss(f):
            return lambda *a: jnp.sum(jnp.sin(f(*a)))

        got = jax.jit(jax.grad(loss(fast), argnums=(0, 1, 2)))(*args)
        ref = jax.grad(loss(loop), argnums=(0, 1, 2))(*args)
        for a, b in zip(got, ref):
            assert a.shape == b.shape
            np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12)


def test_unroll_tied_under_vmap():
    """The sweep engine vmaps the training step over seeds: per-seed kernels and drives."""
    rng = np.random.default_rng(12)
    W = jnp.asarray(0.3 * rng.standard_normal((3, 3, 3, 3, 3)))  # 3 seeds
    d = jnp.asarray(rng.standard_normal((3, 2, 5, 5, 3)))
    x0 = jnp.zeros((2, 5, 5, 3))
    conv = nj.kernels.conv_op

    def loss(W, d, fast):
        if fast:
            x = nj.unroll_tied(conv, x0, d, W, steps=3, activation="relu", residuals="recompute")
        else:
            x = x0
            for _ in range(3):
                x = x + jax.nn.relu(conv(x, W) + d)
        return jnp.sum(jnp.sin(x))

    got = jax.jit(jax.vmap(jax.grad(lambda W, d: loss(W, d, True), argnums=(0, 1))))(W, d)
    ref = jax.vmap(jax.grad(lambda W, d: loss(W, d, False), argnums=(0, 1)))(W, d)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12)


def test_unroll_tied_bad_arguments():
    x = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="residuals='keep'"):
        nj.unroll_tied(nj.kernels.dense_op, x, x, jnp.eye(3), steps=2, residuals="keep")
    with pytest.raises(ValueError, match="steps=0"):
        nj.unroll_tied(nj.kernels.dense_op, x, x, jnp.eye(3), steps=0)


_X_FC = np.random.default_rng(5).standard_normal((4, 7))
_X_CONV = np.random.default_rng(6).standard_normal((2, 6, 6, 3))
MODEL_CASES = {  # name -> (constructor, input)
    "fc_tanh": (functools.partial(M.NaisNetFC, num_classes=3, features=5, steps=4), _X_FC),
    "fc_relu_untied": (
        functools.partial(M.NaisNetFC, num_classes=3, features=5, steps=3, activation="relu", untied=True),
        _X_FC,
    ),
    "conv_relu": (functools.partial(M.NaisConvBlock, 4, steps=3, learn_delta=True), _X_CONV),
}
FAST_PATHS = [  # (options, model cases checked in the default run)
    (dict(scan_unroll=2), ["fc_relu_untied", "conv_relu"]),
    (dict(block_vjp="stacked"), ["fc_tanh", "conv_relu"]),
    (dict(block_vjp="stacked_recompute", scan_unroll=2), ["conv_relu"]),
    (dict(block_vjp="fused", scan_unroll=2), ["fc_tanh", "conv_relu"]),  # on a CPU: the stacked VJP
    (dict(remat="block"), ["conv_relu"]),
    (dict(remat="step"), ["fc_relu_untied"]),
    (dict(block_vjp="stacked", remat="block", scan_unroll=True), ["fc_tanh"]),
]


@functools.cache
def _reference(case):
    ctor, x = MODEL_CASES[case]
    variables = _init(ctor(), x)
    return variables, _value_and_grad(ctor(), variables, x)


def _check_fast_path(options, case):
    ctor, x = MODEL_CASES[case]
    variables, ref = _reference(case)
    out = _value_and_grad(ctor(**options), variables, x)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12), out, ref)


def _ids(options):
    return ",".join(f"{k}={v}" for k, v in options.items())


@pytest.mark.parametrize("options, cases", FAST_PATHS, ids=[_ids(o) for o, _ in FAST_PATHS])
def test_fast_paths_same_values_and_gradients_as_plain_scan(options, cases):
    """Fast paths against the plain ``lax.scan`` path in float64: loss and every gradient."""
    for case in cases:
        _check_fast_path(options, case)


@pytest.mark.slow
@pytest.mark.parametrize("options", [o for o, _ in FAST_PATHS], ids=[_ids(o) for o, _ in FAST_PATHS])
@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_fast_paths_every_model(options, case):
    if case == "fc_relu_untied" and "block_vjp" in options:
        pytest.skip("block_vjp needs tied weights")
    _check_fast_path(options, case)


@pytest.mark.filterwarnings("ignore::naisnet_jax.models.StateUnusedWarning")  # steps=1, on purpose
@pytest.mark.parametrize("steps", [1, 2, 4])
@pytest.mark.parametrize("block_vjp", ["stacked", "fused"])
def test_fast_paths_from_zero_start_at_the_first_step(monkeypatch, steps, block_vjp):
    """From the paper's ``x_0 = 0`` a tied fast path runs ``K - 1`` steps from ``x_1 = h act(drive)``
    (``models.nais._from_first_step``), with the plain scan's values and gradients (float64); with
    one step the state kernel never acts and its gradient is exactly zero. From ``x_0 = u`` it
    runs all K steps from ``u``."""
    x = jnp.asarray(_X_CONV[..., :1].repeat(4, -1))  # 4 channels: x_0 = u fits the state
    calls = []
    original = nais.unroll_tied  # the NAIS modules' reference to the stacked VJP

    def spy(op, x0, *, steps, **kw):
        calls.append((steps, x0))
        return original(op, x0, steps=steps, **kw)

    monkeypatch.setattr(nais, "unroll_tied", spy)
    if block_vjp == "fused":  # on a CPU the fused conv entry point falls back to the stacked VJP
        monkeypatch.setattr(
            nais,
            "unroll_tied_conv",
            lambda x0, *, drive, kernel, policy, **kw: spy(nj.kernels.conv_op, x0, drive=drive, W=kernel, **kw),
        )
    for start in ("zero", "input"):
        ctor = functools.partial(M.NaisConvBlock, 4, steps=steps, h=0.7, learn_delta=True, initial_state=start)
        variables = _init(ctor(), x)
        ref = _value_and_grad(ctor(), variables, x)
        calls.clear()
        out = _value_and_grad(ctor(block_vjp=block_vjp), variables, x)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12), out, ref)
        if start == "input":
            assert [k for k, _ in calls] == [steps]
            continue
        assert [k for k, _ in calls] == ([steps - 1] if steps > 1 else [])
        if steps == 1:
            assert not np.any(out[1]["state_kernel"]), "one step from zero: the kernel never acts"
            continue
        calls.clear()
        ctor(block_vjp=block_vjp).apply(variables, x)  # eagerly: the first state the spy sees
        D, E = variables["params"]["input"]["kernel"], variables["params"]["input"]["bias"]
        drive = jax.lax.conv_general_dilated(x, D, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")) + E
        np.testing.assert_allclose(calls[0][1], 0.7 * np.maximum(np.asarray(drive), 0), rtol=1e-13, atol=1e-15)


def test_default_model_keeps_forward_mode_and_the_hand_written_vjp_has_none():
    """Why the default stays ``block_vjp="autodiff"``: ``jax.jvp`` through the default dense
    net equals a central difference (float64), while a custom VJP has no forward rule."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 4, 4, 1)), jnp.float64)
    v = jnp.asarray(np.random.default_rng(1).standard_normal(x.shape), jnp.float64)
    model = M.get_model("naisnet_mnist", features=6, steps=4, num_classes=3)
    variables = jax.tree.map(lambda a: a.astype(jnp.float64), model.init(KEY, x))
    f = functools.partial(model.apply, variables)
    _, tangent = jax.jvp(f, (x,), (v,))
    eps = 1e-6
    central = (np.asarray(f(x + eps * v)) - np.asarray(f(x - eps * v))) / (2 * eps)
    np.testing.assert_allclose(np.asarray(tangent), central, rtol=1e-6, atol=1e-8)
    stacked = M.get_model("naisnet_mnist", features=6, steps=4, num_classes=3, block_vjp="stacked")
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(functools.partial(stacked.apply, variables), (x,), (v,))


def test_side_stream_weight_gradient_same_values_and_annotated_for_the_gpu(monkeypatch):
    """On a GPU the stacked VJP's weight gradient runs on a second stream: here forced on the
    CPU (where XLA runs it inline), the gradients equal autodiff's (float64) and the program
    lowered for CUDA carries the stream annotation; off, it does not."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 4, 4, 1)), jnp.float64)
    y = jnp.asarray([0, 1, 2])

    def grads(block_vjp):
        model = M.get_model("naisnet_mnist", features=6, steps=5, num_classes=3, block_vjp=block_vjp)
        variables = jax.tree.map(lambda a: a.astype(jnp.float64), model.init(KEY, x))

        def loss(params):
            logits = model.apply({**variables, "params": params}, x)
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))

        fn = jax.jit(jax.grad(loss))
        lowered = fn.trace(variables["params"]).lower(lowering_platforms=("cuda",)).as_text()
        return fn(variables["params"]), "_xla_stream_annotation" in lowered

    plain, _ = grads("autodiff")
    _, annotated = grads("stacked")
    assert not annotated  # on the CPU backend: inline
    monkeypatch.setattr(common, "gpu_backend", lambda: True)
    side, annotated = grads("stacked")
    assert annotated
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(side)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-10, atol=1e-12)
    f = nj.kernels.on_side_stream(lambda a, b: a @ b, enabled=True)  # vmap and grad pass through
    a = jnp.ones((2, 3, 3))
    np.testing.assert_allclose(jax.vmap(f)(a, a), a @ a)
    np.testing.assert_allclose(jax.grad(lambda m: f(m, m).sum())(a[0]), 2 * 3 * np.ones((3, 3)))


def test_side_stream_drive_convolution(monkeypatch):
    """The fast paths' drive convolution (``kernels.side_stream_conv``): on the CPU backend the
    plain ``lax.conv_general_dilated``; as on a GPU (forced here), the same values and float64
    gradients as that convolution (strided, explicit padding), its kernel gradient in a
    computation annotated for the second stream. A conv block on a fast path gets the
    annotation twice (its state kernel's and its drive kernel's gradients), on autodiff never,
    and its gradients stay those of the plain scan."""
    rng = np.random.default_rng(11)
    lhs = jnp.asarray(rng.standard_normal((2, 7, 7, 3)))
    rhs = jnp.asarray(rng.standard_normal((3, 3, 3, 4)))
    dn = ("NHWC", "HWIO", "NHWC")
    configs = [((1, 1), "SAME"), ((2, 2), [(1, 1), (0, 1)])]

    def losses(conv):
        return [lambda a, b, s=s, p=p: jnp.sum(jnp.sin(conv(a, b, s, p, dimension_numbers=dn))) for s, p in configs]

    def annotated(fn, *args):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        calls = [line for line in text.splitlines() if "call @compute_on" in line]
        assert all('_xla_stream_annotation = "1"' in line for line in calls)
        return len(calls)

    side = nj.kernels.side_stream_conv
    assert annotated(jax.grad(losses(side)[0], argnums=(0, 1)), lhs, rhs) == 0  # CPU backend: plain
    monkeypatch.setattr(common, "gpu_backend", lambda: True)
    for plain, wrapped in zip(losses(jax.lax.conv_general_dilated), losses(side)):
        np.testing.assert_allclose(wrapped(lhs, rhs), plain(lhs, rhs), rtol=1e-13)
        for a, b in zip(jax.grad(wrapped, (0, 1))(lhs, rhs), jax.grad(plain, (0, 1))(lhs, rhs)):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13)
        assert annotated(jax.grad(wrapped, argnums=(0, 1)), lhs, rhs) == 1
        assert annotated(wrapped, lhs, rhs) == 0  # the forward pass stays on the main stream
    seeds = (jnp.stack([lhs, 0.5 * lhs]), jnp.stack([rhs, -rhs]))  # a sweep vmaps over seeds
    plain, wrapped = losses(jax.lax.conv_general_dilated)[0], losses(side)[0]
    for a, b in zip(jax.vmap(jax.grad(wrapped, (0, 1)))(*seeds), jax.vmap(jax.grad(plain, (0, 1)))(*seeds)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13)
    ctor, x = MODEL_CASES["conv_relu"]
    variables, ref = _reference("conv_relu")
    for options, count in ((dict(block_vjp="stacked"), 2), (dict(block_vjp="fused"), 2), ({}, 0)):
        model = ctor(**options)

        def loss(params, model=model):
            return jnp.sum(jnp.sin(model.apply(dict(variables, params=params), x, train=True)))

        assert annotated(jax.grad(loss), variables["params"]) == count, options
        out = _value_and_grad(model, variables, x)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12), out, ref)


def test_bfloat16_compute_within_tolerance_and_parameters_stay_float32():
    """NAIS-Net conv (stem, BatchNorm, blocks) computing in bfloat16 against float32.

    bfloat16 keeps 8 significant bits (relative rounding 2^-9); through BatchNorm
    and ReLU masks the gradients move by a few percent, so the tolerance is 25%
    per leaf and 10% over all of them, far below an O(1) error of a broken path.
    """
    # BatchNorm only at the stage change: the bound below was set for that form. With every
    # drive normalised the plain chain of BatchNorm and ReLU amplifies bfloat16's rounding in the
    # gradients (one leaf off by 32% on this input), as it amplifies any perturbation.
    model32 = M.NaisNetConvTiny(steps=3, drive_norm="transitions")
    model16 = M.NaisNetConvTiny(steps=3, drive_norm="transitions", dtype="bfloat16", block_vjp="stacked")
    x = np.random.default_rng(7).standard_normal((8, 6, 6, 3)).astype(np.float32)
    variables = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), jax.jit(model32.init)(KEY, x))
    assert "bf16[" in str(jax.make_jaxpr(model16.apply)(variables, x))  # really bfloat16
    ref = _value_and_grad(model32, variables, x)
    out = _value_and_grad(model16, variables, x)
    np.testing.assert_allclose(out[0], ref[0], rtol=0.02)
    diffs, norms = [], []
    for a, b in zip(jax.tree.leaves(out[1]), jax.tree.leaves(ref[1])):
        assert a.dtype == jnp.float32  # gradients of float32 parameters
        diffs.append(np.linalg.norm(np.ravel(a - b)))
        norms.append(np.linalg.norm(np.ravel(b)))
        assert diffs[-1] <= 0.25 * norms[-1] + 1e-3
    assert np.linalg.norm(diffs) <= 0.1 * np.linalg.norm(norms)
    assert jax.eval_shape(model16.apply, variables, x).dtype == jnp.float32  # float32 logits


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(remat="all"), "remat='all'"),
        (dict(block_vjp="fuse"), "block_vjp='fuse'"),
        (dict(dtype="int8"), "dtype='int8'"),
        (dict(block_vjp="stacked", untied=True), "tied block"),
        (dict(block_vjp="stacked", adaptive_tol=1e-3), "tied block"),
        (dict(block_vjp="stacked", remat="step"), "remat='step'"),
    ],
)
def test_bad_perf_options_are_refused(bad, match):
    for ctor in (M.NaisNetFC, functools.partial(M.NaisConvBlock, 4), M.NaisNetConvTiny):
        with pytest.raises(ValueError, match=match):
            ctor(**bad)
    if set(bad) == {"dtype"}:
        with pytest.raises(ValueError, match=match):
            M.ResNetConvTiny(**bad)


# ------------------------------------------------------------- adaptive depth


def _adaptive_system(batch=20, n=5, seed=8):
    """A projected dense block whose patterns stop at many different depths."""
    rng = np.random.default_rng(seed)
    A, _ = _fc_system(rng, n=n)
    drive = rng.standard_normal((batch, n)) * np.geomspace(0.01, 6, batch)[:, None]
    return A, rng.permutation(drive)


def _per_pattern_loop(A, drive, x0, tol, max_steps):
    """The documented plain-Python meaning, one pattern at a time, in numpy."""
    xs, depths = [], []
    for i in range(drive.shape[0]):
        x, depth = x0[i], 0
        for _ in range(max_steps):
            x_new = x + np.tanh(x @ A.T + drive[i])
            depth += 1
            done = np.linalg.norm(x_new - x) < tol
            x = x_new
            if done:
                break
        xs.append(x)
        depths.append(depth)
    return np.stack(xs), np.array(depths)


@pytest.mark.parametrize("check_every, compact", [(4, False), (3, True), (1, True)])
def test_unroll_adaptive_check_every_and_compact_match_per_pattern_loop(check_every, compact):
    A, drive = _adaptive_system()
    x0 = np.random.default_rng(9).standard_normal(drive.shape) * 0.1
    ref_x, ref_depth = _per_pattern_loop(A, drive, x0, 1e-2, 60)
    assert len(set(ref_depth.tolist())) > 8 and ref_depth.max() == 60  # many depths, some capped
    step = lambda x, d: nj.fc_step(x, d, jnp.asarray(A))  # noqa: E731
    run = jax.jit(
        lambda x0, d: nj.unroll_adaptive(
            step, x0, inputs=d, tol=1e-2, max_steps=60, check_every=check_every, compact=compact
        )
    )
    x, depth = run(jnp.asarray(x0), jnp.asarray(drive))
    np.testing.assert_array_equal(depth, ref_depth)
    np.testing.assert_allclose(x, ref_x, rtol=0, atol=1e-12)


@pytest.mark.parametrize("slots, check_every", [(6, 1), (7, 5)])
def test_unroll_adaptive_stream_matches_per_pattern_loop(slots, check_every):
    A, drive = _adaptive_system(batch=23)
    x0 = np.zeros_like(drive)
    ref_x, ref_depth = _per_pattern_loop(A, drive, x0, 1e-2, 60)
    step = lambda x, d: nj.fc_step(x, d, jnp.asarray(A))  # noqa: E731
    run = jax.jit(
        lambda d: nj.unroll_adaptive_stream(
            step, jnp.zeros(d.shape), d, tol=1e-2, max_steps=60, slots=slots, check_every=check_every
        )
    )
    x, depth = run(jnp.asarray(drive))
    np.testing.assert_array_equal(depth, ref_depth)
    np.testing.assert_allclose(x, ref_x, rtol=0, atol=1e-12)


def test_models_adaptive_check_every_and_compact_same_outputs():
    """The eval path (while loops) of the dense and conv blocks, fast options against default."""
    x_fc = np.random.default_rng(10).standard_normal((12, 7)) * np.geomspace(0.05, 5, 12)[:, None]
    x_conv = np.random.default_rng(11).standard_normal((6, 5, 5, 3)) * np.geomspace(0.1, 5, 6)[:, None, None, None]
    cases = [
        (functools.partial(M.NaisNetFC, num_classes=3, features=5, eps=0.05, adaptive_tol=1e-2, max_steps=50), x_fc),
        (functools.partial(M.NaisConvBlock, 3, eps=0.05, adaptive_tol=1e-2, max_steps=30), x_conv),
    ]
    for ctor, x in cases:
        variables = _init(ctor(), x)
        ref = jax.jit(ctor().apply)(variables, x)
        out = jax.jit(ctor(check_every=4, compact=True).apply)(variables, x)
        np.testing.assert_allclose(out, ref, rtol=0, atol=1e-12)


def test_models_stream_slots_score_a_large_batch_as_the_per_pattern_loop():
    """``stream_slots`` below the batch: the dense and conv blocks stream it, with the outputs
    of the default while loop (each pattern's state after its own depth, so a depth off by
    one step shows); at or above the batch nothing changes."""
    x_fc = np.random.default_rng(12).standard_normal((13, 7)) * np.geomspace(0.05, 5, 13)[:, None]
    x_conv = np.random.default_rng(13).standard_normal((7, 5, 5, 3)) * np.geomspace(0.01, 50, 7)[:, None, None, None]
    cases = [
        (functools.partial(M.NaisDenseBlock, 5, eps=0.05, adaptive_tol=1e-2, max_steps=50, activation="tanh"), x_fc),
        (functools.partial(M.NaisConvBlock, 3, eps=0.05, adaptive_tol=1e-4, max_steps=30, activation="tanh"), x_conv),
    ]
    for ctor, x in cases:
        variables = _init(ctor(), x)
        _, ref_aux = jax.jit(functools.partial(ctor().apply, return_aux=True))(variables, x)
        assert len(set(np.asarray(ref_aux["depth"]).tolist())) > 2  # the patterns stop at different steps
        ref_x = jax.jit(ctor().apply)(variables, x)
        for slots, check_every in [(3, 1), (4, 5), (x.shape[0], 1)]:
            out = jax.jit(ctor(stream_slots=slots, check_every=check_every).apply)(variables, x)
            np.testing.assert_allclose(out, ref_x, rtol=0, atol=1e-12)


def test_bad_adaptive_arguments_are_refused():
    step = lambda x: x  # noqa: E731
    with pytest.raises(ValueError, match="check_every=0"):
        nj.unroll_adaptive(step, jnp.zeros((2, 3)), tol=0.1, max_steps=3, check_every=0)
    with pytest.raises(ValueError, match="inputs=..."):
        nj.unroll_adaptive(step, jnp.zeros((2, 3)), tol=0.1, max_steps=3, compact=True)
    with pytest.raises(ValueError, match="disagree with the 2 patterns"):
        nj.unroll_adaptive(lambda x, d: x + d, jnp.zeros((2, 3)), tol=0.1, max_steps=3, inputs=jnp.zeros((3, 3)))
    with pytest.raises(ValueError, match="slots=0"):
        nj.unroll_adaptive_stream(
            lambda x, d: x + d, jnp.zeros((2, 3)), jnp.zeros((2, 3)), tol=0.1, max_steps=3, slots=0
        )
    with pytest.raises(ValueError, match="check_every=0"):
        M.NaisNetFC(adaptive_tol=0.1, check_every=0)
    with pytest.raises(ValueError, match="stream_slots=0"):
        M.NaisNetFC(adaptive_tol=0.1, stream_slots=0)


# ------------------------------------------------------------- the fast path by default on a GPU


def test_config_takes_the_fast_path_on_a_gpu(monkeypatch):
    """``train.model_spec``: on a GPU a NAIS net whose config sets no speed option gets the fused path
    (``fast_path="auto"``, the default); ``"plain"``, a config's own speed options, a form the
    fused path does not take, a ResNet or a CPU keep the model's defaults; a bad value is named."""
    from naisnet_jax.configs import default

    def spec(**changes):
        config = default.get_config()
        for key, value in changes.items():
            if key.startswith("kw_"):
                config.model_kwargs[key[3:]] = value
            else:
                config[key] = value
        return train.model_spec(config)

    assert spec() == ("naisnet_mnist", {"eps": 0.01, "h": 0.1, "max_steps": 100})  # this CPU: plain
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert spec()[1] == {"eps": 0.01, "h": 0.1, "max_steps": 100, "block_vjp": "fused", "scan_unroll": 10}
    assert "block_vjp" not in spec(fast_path="plain")[1]
    assert (
        spec(kw_block_vjp="stacked")[1]["block_vjp"] == "stacked"
        and "scan_unroll" not in spec(kw_block_vjp="stacked")[1]
    )
    assert "block_vjp" not in spec(kw_untied=True)[1]
    assert "block_vjp" not in spec(adaptive_tol=1e-3)[1]
    assert "block_vjp" not in spec(model="resnet_sh")[1]
    assert spec(model="naisnet_cifar10")[1]["block_vjp"] == "fused"
    with pytest.raises(ValueError, match="config.fast_path='fast' must be one of"):
        spec(fast_path="fast")
