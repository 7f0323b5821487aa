"""Flax models against plain float64 numpy loops, hand-counted parameters and Algorithms 1-2."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from naisnet_jax import models as M
from naisnet_jax.projection import stability_projection

# An RBG key: initialisation compiles in a fraction of threefry's time on CPU,
# which is most of what these tiny models cost.
KEY = jax.random.key(0, impl="rbg")
M_IN, N, DEPTH, CLASSES = 7, 5, 4, 3  # input width, state width, layers/steps, classes
SWITCHES = {  # paper label -> (shared, nonautonomous, batch_norm, stable)
    "ResNet": (False, False, False, False),
    "ResNet-SH": (True, False, False, False),
    "ResNet-NA": (False, True, False, False),
    "ResNet-BN": (False, False, True, False),
    "ResNet-SH-NA": (True, True, False, False),
    "ResNet-SH-BN": (True, False, True, False),
    "ResNet-NA-BN": (False, True, True, False),
    "ResNet-SH-NA-BN": (True, True, True, False),
    "ResNet-SH-Stable": (True, False, False, True),
}


# ------------------------------------------------------------------ helpers


def _f64(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def _count(tree):
    return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(tree))


def _shapes(model, x):
    """Variables' shapes by abstract evaluation: no compute, no compilation."""
    return jax.eval_shape(model.init, KEY, x)


def _resnet(label, **kw):
    return M.RESNET_VARIANTS[label](num_classes=CLASSES, features=N, depth=DEPTH, **kw)


def _fc_input(batch=6, seed=0):
    return np.random.default_rng(seed).standard_normal((batch, M_IN))


def _np_conv_same(x, w, stride=1):
    """Cross-correlation NHWC x HWIO with TF/XLA 'SAME' padding, by explicit taps."""
    b, H, W, _ = x.shape
    k = w.shape[0]
    Ho, Wo = -(-H // stride), -(-W // stride)
    ph, pw = max((Ho - 1) * stride + k - H, 0), max((Wo - 1) * stride + k - W, 0)
    xp = np.pad(x, ((0, 0), (ph // 2, ph - ph // 2), (pw // 2, pw - pw // 2), (0, 0)))
    out = np.zeros((b, Ho, Wo, w.shape[3]))
    for di in range(k):
        for dj in range(k):
            rows = slice(di, di + stride * (Ho - 1) + 1, stride)
            cols = slice(dj, dj + stride * (Wo - 1) + 1, stride)
            patch = xp[:, rows, cols]
            out += patch @ w[di, dj]
    return out


def _nais_fc_reference(p, u, *, steps, h, eps, untied, act=np.tanh):
    """x_{k+1} = x_k + h act(x_k A_k^T + u B_k^T + b_k), x_0 = 0, A_k = -R_k^T R_k - eps I."""
    n = p["R"].shape[-1]
    Rs = p["R"] if untied else [p["R"]] * steps
    kern, bias = p["input"]["kernel"], p["input"]["bias"]
    x, xs = np.zeros((u.shape[0], n)), []
    for k in range(steps):
        A = -Rs[k].T @ Rs[k] - eps * np.eye(n)
        sl = slice(k * n, (k + 1) * n) if untied else slice(0, n)
        x = x + h * act(x @ A.T + u @ kern[:, sl] + bias[sl])
        xs.append(x)
    return np.stack(xs)


def _resnet_reference(p, u, *, shared, nonautonomous, batch_norm, stable, h, eps):
    """The ablation's layer loop, written out layer by layer from the params tree."""
    L = DEPTH
    layer = (lambda a, k: a) if shared else (lambda a, k: a[k])
    if stable:
        Ws = [-layer(p["R"], k).T @ layer(p["R"], k) - eps * np.eye(N) for k in range(L)]
    else:
        Ws = [layer(p["W"], k) for k in range(L)]
    if nonautonomous:
        x = np.zeros((u.shape[0], N))
        kern, bias = p["input"]["kernel"], p["input"]["bias"]
        cols = [slice(0, N) if shared else slice(k * N, (k + 1) * N) for k in range(L)]
        drives = [u @ kern[:, c] + bias[c] for c in cols]  # u enters every layer
    else:
        x = np.tanh(u @ p["embed"]["kernel"] + p["embed"]["bias"])  # u enters through x_0 only
        drives = [layer(p["b"], k) for k in range(L)]
    xs = []
    for k in range(L):
        pre = x @ Ws[k].T + drives[k]
        if batch_norm:  # training mode: batch statistics
            bn = p[f"bn{k}"]
            pre = (pre - pre.mean(0)) / np.sqrt(pre.var(0) + M.BN_EPSILON)
            pre = pre * bn["scale"] + bn["bias"]
        x = x + h * np.tanh(pre)
        xs.append(x)
    return np.stack(xs)


def _walk(tree, key):
    """Every dict in a params tree that holds ``key``."""
    if hasattr(tree, "items"):
        if key in tree:
            yield tree
        for v in tree.values():
            if hasattr(v, "items"):
                yield from _walk(v, key)


def _dense_violations(params, *, eps, h):
    """Per R slice: Algorithm 1's bound and the eigenvalues of I + hA (numpy float64)."""
    bad = []
    for node in _walk(params, "R"):
        R = np.asarray(node["R"], np.float64)
        for Rk in R.reshape((-1,) + R.shape[-2:]):
            n = Rk.shape[1]
            if not np.all(np.isfinite(Rk)):
                bad.append("not finite")
                continue
            if np.linalg.norm(Rk.T @ Rk, "fro") > (1 - 2 * eps) * (1 + 1e-6):
                bad.append("frobenius")
            lam = np.linalg.eigvals(np.eye(n) + h * (-Rk.T @ Rk - eps * np.eye(n)))
            tol = 1e-6
            if (
                np.abs(lam.imag).max() > tol
                or lam.real.min() < 1 - h * (1 - eps) - tol
                or lam.real.max() > 1 - h * eps + tol
            ):
                bad.append("eigenvalues")
    return bad


def _conv_violations(params, *, eps, eta):
    """Per output channel: centre tap, Gershgorin radius and delta range of Algorithm 2."""
    bad = []
    for node in _walk(params, "state_kernel"):
        K = np.asarray(node["state_kernel"], np.float64)
        K = K.reshape((-1,) + K.shape[-4:])
        delta = np.asarray(node.get("delta", np.zeros(K.shape[:1] + K.shape[-1:])), np.float64)
        delta = delta.reshape(K.shape[0], -1)
        p = K.shape[1] // 2
        for Kk, dk in zip(K, delta):
            C = Kk.shape[-1]
            if not (np.all(np.isfinite(Kk)) and np.all(np.isfinite(dk))):
                bad.append("not finite")
                continue
            centre = Kk[p, p, np.arange(C), np.arange(C)]
            others = np.abs(Kk).sum(axis=(0, 1, 2)) - np.abs(centre)
            if not np.allclose(centre, -1 - dk, rtol=0, atol=1e-6):
                bad.append("centre")
            if np.any(others > 1 - eps - np.abs(dk) + 1e-6):
                bad.append("gershgorin")
            if np.any(np.abs(dk) > 1 - eta + 1e-6):
                bad.append("delta")
    return bad


def _train(model, variables, x, y, tx, steps=100):
    params, stats = variables["params"], variables.get("batch_stats", {})
    opt = tx.init(params)

    @jax.jit
    def step(params, stats, opt):
        def loss_fn(p):
            logits, new = model.apply({"params": p, "batch_stats": stats}, x, train=True, mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), new

        (loss, new), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), new.get("batch_stats", stats), opt, loss

    losses = []
    for _ in range(steps):
        params, stats, opt, loss = step(params, stats, opt)
        losses.append(float(loss))
    return params, np.array(losses)


# ------------------------------------------------------------ parameter counts


@pytest.mark.parametrize("label", list(SWITCHES))
def test_resnet_fc_parameter_count(label):
    shared, na, bn, _ = SWITCHES[label]
    sets = 1 if shared else DEPTH  # parameter sets: one if shared, else one per layer
    expected = sets * N * N  # W (or R)
    expected += sets * (M_IN * N + N) if na else (M_IN * N + N) + sets * N  # input | embed + b
    expected += DEPTH * 2 * N if bn else 0  # per-layer BatchNorm scale and offset
    expected += N * CLASSES + CLASSES
    variables = _shapes(_resnet(label), _fc_input())
    assert _count(variables["params"]) == expected
    assert ("batch_stats" in variables) == bn


@pytest.mark.parametrize("untied", [False, True])
@pytest.mark.parametrize("rank", [None, 2])
def test_naisnet_fc_parameter_count(untied, rank):
    r, K = rank or N, DEPTH
    sets = K if untied else 1
    expected = sets * r * N + sets * (M_IN * N + N) + N * CLASSES + CLASSES
    model = M.NaisNetFC(num_classes=CLASSES, features=N, steps=K, untied=untied, rank=rank)
    params = _shapes(model, _fc_input())["params"]
    assert _count(params) == expected
    assert params["block"]["R"].shape == ((K,) if untied else ()) + (r, N)


@pytest.mark.parametrize("untied", [False, True])
@pytest.mark.parametrize("learn_delta", [False, True])
def test_naisnet_conv_parameter_count(untied, learn_delta):
    k, K, cin, (c0, c1) = 3, 2, 3, (4, 8)
    s = K if untied else 1

    def block(c_in, c, normalised):
        n = s * k * k * c * c + (s * c if learn_delta else 0)  # state kernel, delta
        n += k * k * c_in * s * c  # input conv D
        n += 2 * s * c if normalised else s * c  # BatchNorm on the drive, or the bias E
        return n

    expected = k * k * cin * c0 + 2 * c0  # stem (no bias) + stem BatchNorm
    expected += block(c0, c0, True) + block(c0, c1, True) + block(c1, c1, True)  # every drive normalised
    expected += c1 * CLASSES + CLASSES
    model = M.NaisNetConv(
        num_classes=CLASSES,
        stage_sizes=(1, 2),
        filters=(c0, c1),
        steps=K,
        untied=untied,
        learn_delta=learn_delta,
    )
    params = _shapes(model, jnp.ones((2, 8, 8, cin)))["params"]
    assert _count(params) == expected
    per_step = (K,) if untied else ()
    assert params["stage1_block0"]["state_kernel"].shape == per_step + (k, k, c1, c1)


def test_cifar_sizes_parameter_count():
    """Full-size section 5.2 nets, by abstract evaluation (no compute)."""

    def nais(c_in, c, first):
        del first  # every block's drive is normalised: BatchNorm's scale and offset, no bias
        return 9 * c * c + 9 * c_in * c + 2 * c

    def res(c_in, c, first):
        return 9 * c_in * c + 2 * c + (c_in * c if first else 0)

    for ctor, blk in [(M.NaisNetCifar10, nais), (M.NaisNetCifar1, nais), (M.ResNetCifar, res)]:
        expected = 27 * 16 + 2 * 16 + 64 * 10 + 10
        prev = 16
        for i, c in enumerate((16, 32, 64)):
            expected += blk(prev, c, i > 0) + 17 * blk(c, c, False)
            prev = c
        assert _count(_shapes(ctor(), jnp.ones((1, 32, 32, 3)))["params"]) == expected


# -------------------------------------------------------- loops vs references


@pytest.mark.parametrize("untied", [False, True])
@pytest.mark.parametrize("rank", [None, 3])
@pytest.mark.parametrize("activation", ["tanh", "relu"])
def test_naisnet_fc_equals_numpy_loop(untied, rank, activation):
    h, eps = 0.7, 0.05
    model = M.NaisNetFC(
        num_classes=CLASSES, features=N, steps=DEPTH, h=h, eps=eps, activation=activation, untied=untied, rank=rank
    )
    x = np.random.default_rng(1).standard_normal((6, 1, M_IN))  # flattened by the model
    params = _f64(model.init(KEY, x)["params"])
    logits, aux = model.apply({"params": params}, x, return_aux=True)
    act = np.tanh if activation == "tanh" else (lambda z: np.maximum(z, 0))
    xs = _nais_fc_reference(params["block"], x.reshape(6, -1), steps=DEPTH, h=h, eps=eps, untied=untied, act=act)
    cls = params["classifier"]
    np.testing.assert_allclose(aux["trajectory"], xs, rtol=0, atol=1e-10)
    np.testing.assert_array_equal(aux["initial_state"], np.zeros((6, N)))  # the paper's x_0 = 0
    np.testing.assert_allclose(aux["step_logits"], xs @ cls["kernel"] + cls["bias"], atol=1e-10)
    np.testing.assert_allclose(logits, xs[-1] @ cls["kernel"] + cls["bias"], atol=1e-10)
    np.testing.assert_array_equal(aux["step_logits"][-1], logits)
    np.testing.assert_array_equal(aux["depth"], np.full((1, 6), DEPTH))


@pytest.mark.parametrize("untied", [False, True])
@pytest.mark.parametrize("strides", [1, 2])
def test_nais_conv_block_equals_numpy_loop(untied, strides):
    """X_{k+1} = X_k + h relu(conv(X_k, C_k) + conv(U, D_k) + E_k), centre taps -1 - delta."""
    h, eps, K, C = 0.9, 0.02, 3, 4
    block = M.NaisConvBlock(C, steps=K, h=h, eps=eps, strides=strides, learn_delta=True, untied=untied)
    rng = np.random.default_rng(2)
    u = rng.standard_normal((2, 6, 6, 3))
    params = _f64(block.init(KEY, u)["params"])
    # Non-zero delta, and garbage in the stored centre taps (they must be ignored).
    params["delta"] = rng.uniform(-0.4, 0.4, params["delta"].shape)
    params["state_kernel"] = params["state_kernel"] + 0.05 * rng.standard_normal(params["state_kernel"].shape)
    x_K, aux = block.apply({"params": params}, u, return_aux=True)

    kernels = params["state_kernel"] if untied else [params["state_kernel"]] * K
    deltas = params["delta"] if untied else [params["delta"]] * K
    D, E = params["input"]["kernel"], params["input"]["bias"]
    drive = _np_conv_same(u, D, strides) + E
    x = np.zeros(drive.shape[:3] + (C,))
    for k in range(K):
        Ck = np.array(kernels[k])
        Ck[1, 1, np.arange(C), np.arange(C)] = -1 - deltas[k]
        dk = drive[..., k * C : (k + 1) * C] if untied else drive
        x = x + h * np.maximum(_np_conv_same(x, Ck) + dk, 0)
        np.testing.assert_allclose(aux["trajectory"][k], x, rtol=0, atol=1e-10)
    np.testing.assert_allclose(x_K, x, rtol=0, atol=1e-10)
    np.testing.assert_array_equal(aux["initial_state"], np.zeros(x.shape))
    assert x_K.shape == (2, 6 // strides, 6 // strides, C)


@pytest.mark.parametrize("square", [True, False])
def test_resnet_conv_block_equals_numpy(square):
    """relu(x + BN(conv(x))) in train mode (batch statistics), 1x1 shortcut where shape changes."""
    c_in, c = (4, 4) if square else (3, 4)
    strides = 1 if square else 2
    block = M.ResNetConvBlock(c, strides=strides, zero_init_residual=False)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 6, 6, c_in))
    variables = _f64(block.init(KEY, x))
    params = variables["params"]
    params["bn"]["scale"] = rng.uniform(0.5, 1.5, c)
    params["bn"]["bias"] = rng.uniform(-0.3, 0.3, c)
    out, _ = block.apply({**variables, "params": params}, x, train=True, mutable=["batch_stats"])
    z = _np_conv_same(x, params["conv"]["kernel"], strides)
    mean, var = z.mean(axis=(0, 1, 2)), z.var(axis=(0, 1, 2))
    y = (z - mean) / np.sqrt(var + M.BN_EPSILON) * params["bn"]["scale"] + params["bn"]["bias"]
    skip = x if square else _np_conv_same(x, params["shortcut"]["kernel"], strides)
    np.testing.assert_allclose(out, np.maximum(skip + y, 0), rtol=0, atol=1e-9)


@pytest.mark.parametrize("square", [True, False])
def test_two_convolution_resnet_block_equals_numpy(square):
    """``convs=2``: He et al.'s basic block relu(skip + BN2(conv2(relu(BN(conv(x)))))), the stride on
    the first convolution, batch statistics in train mode."""
    c_in, c = (4, 4) if square else (3, 4)
    strides = 1 if square else 2
    block = M.ResNetConvBlock(c, strides=strides, zero_init_residual=False, convs=2)
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, 6, 6, c_in))
    variables = _f64(block.init(KEY, x))
    params = variables["params"]
    for bn in ("bn", "bn2"):
        params[bn]["scale"] = rng.uniform(0.5, 1.5, c)
        params[bn]["bias"] = rng.uniform(-0.3, 0.3, c)
    out, _ = block.apply({**variables, "params": params}, x, train=True, mutable=["batch_stats"])

    def bn(z, name):
        mean, var = z.mean(axis=(0, 1, 2)), z.var(axis=(0, 1, 2))
        return (z - mean) / np.sqrt(var + M.BN_EPSILON) * params[name]["scale"] + params[name]["bias"]

    y = np.maximum(bn(_np_conv_same(x, params["conv"]["kernel"], strides), "bn"), 0)
    y = bn(_np_conv_same(y, params["conv2"]["kernel"], 1), "bn2")
    skip = x if square else _np_conv_same(x, params["shortcut"]["kernel"], strides)
    np.testing.assert_allclose(out, np.maximum(skip + y, 0), rtol=0, atol=1e-9)
    # zero_init_residual zeroes the last BatchNorm's scale only: the block starts as the identity
    fresh = M.ResNetConvBlock(c, convs=2).init(KEY, np.abs(x[..., :c]))["params"]
    assert np.all(np.asarray(fresh["bn2"]["scale"]) == 0) and np.all(np.asarray(fresh["bn"]["scale"]) == 1)


def test_two_convolution_resnet_matches_the_nais_nets_parameters():
    """Section 5.2's parameter-matched baseline: with two convolutions a block the 3 x 18-block
    ResNet (ResNet-110) has NAIS-Net's parameter count within 1%, the paper's one-convolution form half."""

    def count(name, **kw):
        model = M.get_model(name, num_classes=10, **kw)
        shapes = jax.eval_shape(lambda: model.init(KEY, jnp.zeros((1, 32, 32, 3))))
        return sum(int(np.prod(p.shape)) for p in jax.tree.leaves(shapes["params"]))

    nais, one, two = count("naisnet_cifar10"), count("resnet_cifar"), count("resnet_cifar", convs=2)
    assert abs(two / nais - 1) < 0.01 and one < 0.51 * nais, (nais, one, two)
    with pytest.raises(ValueError, match="convs"):
        M.get_model("resnet_cifar", convs=3).init(KEY, jnp.zeros((1, 8, 8, 3)))


def test_zero_init_residual_starts_as_identity_and_its_scale_learns():
    """A fresh block maps a non-negative x to itself, and its BatchNorm scale gets a non-zero
    gradient (with the ReLU inside the branch, relu(0 * z) would have a zero gradient
    everywhere and the branch would never learn)."""
    block = M.ResNetConvBlock(4)
    x = np.abs(np.random.default_rng(6).standard_normal((4, 5, 5, 4)))
    variables = block.init(KEY, x)
    assert np.all(np.asarray(variables["params"]["bn"]["scale"]) == 0)
    out = block.apply(variables, x)
    np.testing.assert_allclose(out, x, rtol=0, atol=1e-6)
    w = np.random.default_rng(7).standard_normal(x.shape)

    def loss(params):
        y, _ = block.apply({**variables, "params": params}, x, train=True, mutable=["batch_stats"])
        return jnp.sum(y * w)

    grads = jax.grad(loss)(variables["params"])
    assert np.abs(np.asarray(grads["bn"]["scale"])).min() > 1e-3


def test_drive_norm_every_normalises_every_drive_and_keeps_the_dynamics():
    """``drive_norm="every"`` (the default) gives every block a drive BatchNorm (and no drive bias),
    ``"transitions"`` only the first block of a later stage, ``"none"`` no block; the state kernels,
    hence the stability condition, are the same parameters in every form."""
    kw = dict(num_classes=CLASSES, stage_sizes=(2, 2), filters=(4, 8), steps=2)
    x = jnp.ones((2, 8, 8, 1))
    names = ["stage0_block0", "stage0_block1", "stage1_block0", "stage1_block1"]
    every = _shapes(M.NaisNetConv(**kw), x)["params"]
    transitions = _shapes(M.NaisNetConv(**kw, drive_norm="transitions"), x)["params"]
    none = _shapes(M.NaisNetConv(**kw, drive_norm="none"), x)["params"]
    assert [n for n in names if "drive_norm" in transitions[n]] == ["stage1_block0"]
    assert all("drive_norm" in every[n] and "bias" not in every[n]["input"] for n in names)
    assert all("drive_norm" not in none[n] and "bias" in none[n]["input"] for n in names)
    for n in names:
        assert every[n]["state_kernel"].shape == transitions[n]["state_kernel"].shape == none[n]["state_kernel"].shape
    with pytest.raises(ValueError, match="drive_norm"):
        M.NaisNetConv(**kw, drive_norm="always")


@pytest.mark.parametrize("label", list(SWITCHES))
def test_resnet_fc_equals_layer_loop(label):
    shared, na, bn, stable = SWITCHES[label]
    h, eps = 0.8, 0.03
    model = _resnet(label, h=h, eps=eps)
    u = _fc_input()
    variables = model.init(KEY, u)
    params = _f64(variables["params"])
    out, _ = model.apply({**variables, "params": params}, u, train=True, return_aux=True, mutable=["batch_stats"])
    logits, aux = out
    xs = _resnet_reference(params, u, shared=shared, nonautonomous=na, batch_norm=bn, stable=stable, h=h, eps=eps)
    np.testing.assert_allclose(aux["trajectory"], xs, rtol=0, atol=1e-10)
    # x_0: zeros where u drives every layer, else the embedding tanh(u E^T + e)
    x0 = np.zeros_like(xs[0]) if na else np.tanh(u @ params["embed"]["kernel"] + params["embed"]["bias"])
    np.testing.assert_allclose(aux["initial_state"], x0, rtol=0, atol=1e-12)
    cls = params["classifier"]
    np.testing.assert_allclose(logits, xs[-1] @ cls["kernel"] + cls["bias"], atol=1e-10)
    np.testing.assert_array_equal(aux["step_logits"][-1], logits)
    assert aux["step_logits"].shape == (DEPTH, u.shape[0], CLASSES)


@pytest.mark.parametrize("na", [False, True])
def test_shared_weights_are_one_set_used_by_every_layer(na):
    """SH == the per-layer model with its single (W, b / B) copied into every layer."""
    sh = _resnet("ResNet-SH-NA" if na else "ResNet-SH")
    unshared = _resnet("ResNet-NA" if na else "ResNet")
    u = _fc_input()
    p_sh = _f64(sh.init(KEY, u)["params"])
    p = _f64(unshared.init(KEY, u)["params"])
    Ws = p["W"]
    assert p_sh["W"].shape == (N, N) and Ws.shape == (DEPTH, N, N)
    # The unshared model has depth-many distinct matrices.
    assert min(np.abs(Ws[i] - Ws[j]).max() for i in range(DEPTH) for j in range(i)) > 1e-3
    tiled = dict(p_sh, W=np.tile(p_sh["W"], (DEPTH, 1, 1)))
    if na:
        k, b = p_sh["input"]["kernel"], p_sh["input"]["bias"]
        tiled["input"] = {"kernel": np.tile(k, (1, DEPTH)), "bias": np.tile(b, DEPTH)}
    else:
        tiled["b"] = np.tile(p_sh["b"], (DEPTH, 1))
    np.testing.assert_allclose(unshared.apply({"params": tiled}, u), sh.apply({"params": p_sh}, u), rtol=0, atol=1e-12)

    # d logits / d W_shared is the sum of the per-layer gradients, and every layer contributes.
    def loss(model, params):
        return jnp.sum(jnp.sin(model.apply({"params": params}, u)))

    g_sh = jax.grad(loss, argnums=1)(sh, p_sh)["W"]
    g_layers = jax.grad(loss, argnums=1)(unshared, tiled)["W"]
    np.testing.assert_allclose(g_sh, g_layers.sum(0), rtol=1e-10, atol=1e-12)
    first = 1 if na else 0  # NA starts from x_0 = 0, so layer 0's W x_0 has no gradient
    assert np.all(np.abs(g_layers[first:]).max(axis=(1, 2)) > 1e-8)


@pytest.mark.parametrize("k", range(DEPTH))
def test_nonautonomous_input_enters_every_layer(k):
    """ResNet-NA with only layer k's B nonzero: x_1..x_k ignore u, x_{k+1} on depend on it."""
    model = _resnet("ResNet-NA")
    u1, u2 = _fc_input(seed=3), _fc_input(seed=4)
    p = _f64(model.init(KEY, u1)["params"])
    kern = np.zeros_like(p["input"]["kernel"])
    kern[:, k * N : (k + 1) * N] = p["input"]["kernel"][:, k * N : (k + 1) * N]
    p["input"] = dict(p["input"], kernel=kern)
    t1 = model.apply({"params": p}, u1, return_aux=True)[1]["trajectory"]
    t2 = model.apply({"params": p}, u2, return_aux=True)[1]["trajectory"]
    np.testing.assert_array_equal(t1[:k], t2[:k])
    assert np.all(np.abs(t1[k:] - t2[k:]).max(axis=(1, 2)) > 1e-6)


def test_autonomous_input_enters_only_through_x0():
    model = _resnet("ResNet")
    u1, u2 = _fc_input(seed=3), _fc_input(seed=4)
    p = _f64(model.init(KEY, u1)["params"])
    assert "input" not in p
    assert np.abs(model.apply({"params": p}, u1) - model.apply({"params": p}, u2)).max() > 1e-6
    p["embed"] = dict(p["embed"], kernel=np.zeros_like(p["embed"]["kernel"]))
    np.testing.assert_array_equal(model.apply({"params": p}, u1), model.apply({"params": p}, u2))


# ------------------------------------------------------------- adaptive depth


def test_adaptive_fc_depth_per_pattern_matches_plain_loop():
    tol, max_steps, h, eps = 1e-3, 60, 1.0, 0.25
    model = M.NaisNetFC(num_classes=CLASSES, features=N, h=h, eps=eps, adaptive_tol=tol, max_steps=max_steps)
    u = _fc_input(8) * np.geomspace(0.01, 10, 8)[:, None]  # patterns at very different scales
    params = _f64(model.init(KEY, u)["params"])
    logits_eval = model.apply({"params": params}, u)  # lax.while_loop
    logits_train, aux = model.apply({"params": params}, u, train=True, return_aux=True)
    np.testing.assert_allclose(logits_train, logits_eval, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(aux["step_logits"][-1], logits_train)
    assert aux["trajectory"].shape == (max_steps, 8, N)

    blk = params["block"]
    A = -blk["R"].T @ blk["R"] - eps * np.eye(N)
    drive = u @ blk["input"]["kernel"] + blk["input"]["bias"]
    depths = []
    for i in range(8):  # each pattern on its own
        x, d = np.zeros(N), 0
        for _ in range(max_steps):
            x_new = x + h * np.tanh(A @ x + drive[i])
            d, done, x = d + 1, np.linalg.norm(x_new - x) < tol, x_new
            if done:
                break
        depths.append(d)
    np.testing.assert_array_equal(aux["depth"], np.array([depths]))
    _, aux_eval = model.apply({"params": params}, u, return_aux=True)
    np.testing.assert_array_equal(aux_eval["depth"], aux["depth"])
    assert len(set(depths)) > 1 and min(depths) < max_steps

    # Training form is differentiable; the while_loop form refuses reverse mode.
    def loss(p, train):
        return model.apply({"params": p}, u, train=train).sum()

    grads = jax.grad(loss)(params, True)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    with pytest.raises(ValueError, match="unroll_adaptive_bounded"):
        jax.grad(loss)(params, False)


def test_adaptive_conv_train_and_eval_agree():
    block = M.NaisConvBlock(4, h=1.0, eps=0.05, adaptive_tol=1e-2, max_steps=40)
    scales = np.geomspace(0.1, 10, 5)[:, None, None, None]
    u = np.random.default_rng(5).standard_normal((5, 6, 6, 3)) * scales
    params = _f64(block.init(KEY, u)["params"])
    x_eval = block.apply({"params": params}, u)  # lax.while_loop
    x_train, aux = block.apply({"params": params}, u, train=True, return_aux=True)
    _, aux_eval = block.apply({"params": params}, u, return_aux=True)
    np.testing.assert_allclose(x_train, x_eval, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(aux["trajectory"][-1], x_train)
    np.testing.assert_array_equal(aux["depth"], aux_eval["depth"])
    assert aux["depth"].shape == (5,) and len(set(aux["depth"].tolist())) > 1

    # The stacked net reports one depth row per block (shapes by abstract evaluation).
    model = M.NaisNetConvTiny(adaptive_tol=1e-2, max_steps=15)
    variables = _shapes(model, u)
    for train in (False, True):
        apply = functools.partial(model.apply, train=train, return_aux=True, mutable=["batch_stats"])
        (logits, aux), _ = jax.eval_shape(apply, variables, u)
        assert aux["depth"].shape == (2, 5) and aux["depth"].dtype == jnp.int32
        assert [t.shape for t in aux["trajectory"]] == [(15, 5, 6, 6, 4), (15, 5, 3, 3, 8)]


# ---------------------------------------------------------------------- jit

_FC_RESNETS = [name for name, alias in M.MODELS.items() if alias in M.RESNET_VARIANTS.values()]
TINY = [  # (name, overrides)
    ("naisnet_fc_tiny", {}),
    ("naisnet_fc_tiny", dict(adaptive_tol=1e-2, max_steps=8)),
    ("naisnet_mnist", dict(features=N, steps=3)),
    ("naisnet_conv_tiny", {}),
    ("naisnet_conv_tiny", dict(adaptive_tol=1e-2, max_steps=3)),
    ("resnet_conv_tiny", {}),
    *[(name, dict(features=N, depth=3, num_classes=CLASSES)) for name in _FC_RESNETS],
]


@pytest.mark.parametrize("name, overrides", TINY)
def test_every_model_jits(name, overrides):
    model = M.get_model(name, **overrides)
    x = jnp.ones((2, 6, 6, 3) if "conv" in name else (2, M_IN), jnp.float32)
    variables = model.init(KEY, x)
    eager = model.apply(variables, x)
    logits, aux = jax.jit(functools.partial(model.apply, return_aux=True))(variables, x)
    np.testing.assert_allclose(logits, eager, rtol=1e-5, atol=1e-6)
    assert aux["depth"].dtype == jnp.int32 and aux["depth"].shape[1] == 2
    train = jax.jit(functools.partial(model.apply, train=True, mutable=["batch_stats"]))
    logits, new = train(variables, x)
    assert logits.shape == eager.shape and logits.dtype == jnp.float32
    assert set(new) == ({"batch_stats"} if "batch_stats" in variables else set())


def test_resnet_sh_na_is_naisnet_without_the_parametrisation():
    """ResNet-SH-NA with W := -R^T R - eps I and NAIS-Net's B, b, classifier is NAIS-Net."""
    eps, h = 0.1, 0.6
    nais = M.NaisNetFC(num_classes=CLASSES, features=N, steps=DEPTH, h=h, eps=eps)
    resnet = _resnet("ResNet-SH-NA", h=h)
    u = _fc_input()
    p = _f64(nais.init(KEY, u)["params"])
    R = p["block"]["R"]
    q = {"W": -R.T @ R - eps * np.eye(N), "input": p["block"]["input"], "classifier": p["classifier"]}
    assert jax.tree.structure(q) == jax.tree.structure(_shapes(resnet, u)["params"])
    out_nais, aux_nais = nais.apply({"params": p}, u, return_aux=True)
    out_res, aux_res = resnet.apply({"params": q}, u, return_aux=True)
    np.testing.assert_allclose(out_res, out_nais, rtol=0, atol=1e-12)
    np.testing.assert_allclose(aux_res["trajectory"], aux_nais["trajectory"], rtol=0, atol=1e-12)


def test_model_table_covers_the_paper():
    assert set(M.RESNET_VARIANTS) == set(SWITCHES)
    for label, (sh, na, bn, st) in SWITCHES.items():
        m = M.RESNET_VARIANTS[label]()
        assert (m.shared, m.nonautonomous, m.batch_norm, m.stable, m.depth) == (sh, na, bn, st, 30)
        assert M.MODELS[label.lower().replace("-", "_")] is M.RESNET_VARIANTS[label]
    assert M.NaisNetMNIST().steps == 30
    assert (M.NaisNetCifar1().steps, M.NaisNetCifar10().steps) == (1, 10)
    assert M.get_model("naisnet_cifar10", num_classes=100).num_classes == 100


# ------------------------------------------------- training with projections

EPS, ETA = 0.05, 0.5
PROJECTED = {  # name -> (model, learning rate)
    "nais_fc": (lambda: M.NaisNetFC(num_classes=CLASSES, features=N, steps=DEPTH, eps=EPS), 1.0),
    "nais_fc_untied_rank": (
        lambda: M.NaisNetFC(num_classes=CLASSES, features=N, steps=DEPTH, h=0.5, eps=EPS, untied=True, rank=3),
        1.0,
    ),
    "nais_conv_delta": (lambda: M.NaisNetConvTiny(eps=EPS, eta=ETA, learn_delta=True), 1.0),
    "nais_conv_untied": (lambda: M.NaisNetConvTiny(eps=EPS, eta=ETA, untied=True, learn_delta=True), 1.0),
    # Its input layer x_0 = act(Dense(u)) is unconstrained; it is trained at lr = 0.5
    # (NAIS-Nets start from x_0 = 0 and take lr = 1.0).
    "resnet_sh_stable": (lambda: M.ResNetSHStable(num_classes=CLASSES, features=N, depth=DEPTH, eps=EPS), 0.5),
}


def _violations(name, model, params):
    key = "state_kernel" if "conv" in name else "R"
    if not list(_walk(params, key)):
        return ["no NAIS block found"]
    if "conv" in name:
        return _conv_violations(params, eps=EPS, eta=ETA)
    return _dense_violations(params, eps=EPS, h=model.h)


@pytest.mark.parametrize("name", sorted(PROJECTED))
def test_sgd_with_projection_keeps_every_block_stable(name):
    build, lr = PROJECTED[name]
    model = build()
    rng = np.random.default_rng(6)
    conv = "conv" in name
    x = rng.standard_normal((6, 4, 4, 3) if conv else (16, M_IN)).astype(np.float32)
    y = rng.integers(0, CLASSES, x.shape[0])
    variables = jax.jit(model.init)(KEY, x)
    assert _violations(name, model, variables["params"]) == []  # feasible at init
    sgd = optax.sgd(lr, momentum=0.9)
    tx = optax.chain(sgd, stability_projection(eps=EPS, eta=ETA))
    projected, losses = _train(model, variables, x, y, tx)
    assert np.all(np.isfinite(losses))
    assert _violations(name, model, projected) == []
    # Teeth: the same training without the projection leaves the set.
    free, _ = _train(model, variables, x, y, sgd)
    assert _violations(name, model, free) != []


# ------------------------------------------------------ hyper-parameter errors


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: M.NaisDenseBlock(4, eps=0.7), "eps=0.7"),
        (lambda: M.NaisNetFC(eps=0.7), "eps=0.7"),
        (lambda: M.NaisConvBlock(4, eps=0.7), "eps=0.7"),
        (lambda: M.ResNetSHStable(eps=0.7), "eps=0.7"),
        (lambda: M.NaisDenseBlock(4, h=1.5), "h=1.5"),
        (lambda: M.NaisNetConvTiny(h=1.5), "h=1.5"),
        (lambda: M.ResNetSH(h=1.5), "h=1.5"),
        (lambda: M.NaisConvBlock(4, kernel_size=4), "kernel_size=4"),
        (lambda: M.NaisNetConv(kernel_size=2), "kernel_size=2"),
        (lambda: M.NaisDenseBlock(4, rank=5), "rank=5"),
        (lambda: M.NaisDenseBlock(4, steps=0), "steps=0"),
        (lambda: M.NaisDenseBlock(4, activation="sigmoid"), "sigmoid"),
        (lambda: M.NaisConvBlock(4, eta=0.001, eps=0.01), "eta=0.001"),
        (lambda: M.NaisNetFC(untied=True, adaptive_tol=1e-3), "adaptive_tol=0.001"),
        (lambda: M.NaisNetConv(stage_sizes=(1, 1), filters=(4,)), "filters=\\(4,\\)"),
        (lambda: M.get_model("resnet_sh_stabel"), "resnet_sh_stabel.*resnet_sh_stable"),
    ],
)
def test_bad_hyper_parameters_raise(build, match):
    with pytest.raises(ValueError, match=match):
        build()
