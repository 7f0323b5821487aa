"""The checkpoint audit (``naisnet-verify``) against independent float64 numpy references.

(Soundness on random blocks is in ``test_verify_soundness.py``; the in-memory API in
``test_verify_api.py``.)

1. The Arnoldi estimate of a conv block's radius at its resolution matches numpy.
2. Teeth: a trained checkpoint passes (exit 0); the same checkpoint with its state matrix
   scaled up and re-saved consistently fails (exit 1) naming the block and why; corrupt,
   foreign and missing checkpoints are refused (exit 2) with a message; nothing is unpickled.
3. Trajectory figures mean something: equilibria, contraction bounds, trajectory radii and
   gains of projected tanh blocks, and ``x*`` recomputed by hand from the checkpoint's arrays.
4. Baselines are audited, never certified, with exact radii of ``I + h diag(g) W``.
5. The JSON certificate, the figures and the ``--data`` modes.

Checkpoints are built once per module: one real 1-epoch training run, the others written
directly through :mod:`naisnet_jax.checkpoint` with metadata shaped like ``train.py``'s.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import pickle
import shutil
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from naisnet_jax.verify import AuditOptions, _conv, audit, cli, report
from naisnet_jax.verify._common import Block
from references import loop_conv_matrix, rho

from naisnet_jax import checkpoint as ckpt
from naisnet_jax import data as data_lib
from naisnet_jax.parametrize import fc_state_matrix
from naisnet_jax.probe import BlockProbe
from naisnet_jax.projection import fc_delta, project_conv, project_params

pytestmark = pytest.mark.filterwarnings(
    # Orbax leaves asyncio tasks behind when a read fails; harmless, and out of our hands.
    "ignore::pytest.PytestUnraisableExceptionWarning"
)

SAMPLES = 16  # inputs per audit: digits test images
BN_EPSILON = 1e-5  # flax BatchNorm's epsilon as the models use it (independent constant)


# ------------------------------------------------------------------ numpy references


def centre_set(kernel, delta):
    """The kernel the forward pass uses: centre taps of channel c's own filter at -1 - delta_c."""
    kernel = np.array(kernel, np.float64)
    k, c = kernel.shape[0], kernel.shape[-1]
    p = k // 2
    kernel[p, p, np.arange(c), np.arange(c)] = -1.0 - np.asarray(delta, np.float64)
    return kernel


def off_centre(kernel):
    kernel = np.array(kernel, np.float64)
    p, c = kernel.shape[0] // 2, kernel.shape[-1]
    kernel[p, p, np.arange(c), np.arange(c)] = 0.0
    return kernel


def bn_multiplier(scale, var):
    return np.asarray(scale, np.float64) / np.sqrt(np.asarray(var, np.float64) + BN_EPSILON)


def strict_json(path):
    """The certificate must be strict JSON: no NaN or Infinity literals."""

    def refuse(const):
        raise ValueError(f"non-standard JSON constant {const}")

    with open(path) as f:
        return json.loads(f.read(), parse_constant=refuse)


def block(cert, name):
    (b,) = [b for b in cert["blocks"] if b["name"] == name]
    return b


# ------------------------------------------------------------------ the command line


def run_cli(*argv):
    """``naisnet-verify ARGV`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        with pytest.raises(SystemExit) as exc:
            cli.main([str(a) for a in argv])
    return exc.value.code, out.getvalue(), err.getvalue()


def run_cli_with_json(directory, tmp, *extra):
    path = os.path.join(tmp, "certificate.json")
    code, out, err = run_cli(directory, "--json", path, "--samples", SAMPLES, *extra)
    return code, out, err, (strict_json(path) if os.path.exists(path) else None)


# ------------------------------------------------------------------ checkpoints


@pytest.fixture(scope="module")
def digits():
    """Digits as the audit reads them: the first SAMPLES test images, normalised like training."""
    ds = data_lib.load_dataset("digits")
    mean, std = data_lib.channel_stats(ds.train_images)
    x = (ds.test_images[:SAMPLES].astype(np.float64) / 255.0 - mean) / std
    return types.SimpleNamespace(x=x, mean=mean, std=std)


def _randomise(tree, rng, rules):
    """Replace leaves named in ``rules`` (name -> fn(shape)) throughout a nested dict."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out[k] = _randomise(v, rng, rules)
        else:
            v = np.asarray(v, np.float32)
            out[k] = rules[k](v.shape).astype(np.float32) if k in rules else v
    return out


def write_checkpoint(directory, model, model_kwargs, *, eps, h, digits, eta=0.5, seed=0, project=True):
    """Initialise ``model`` on digits, randomise biases / deltas / BatchNorm, project (as training
    does after every update) and save through the checkpoint module with its metadata."""
    meta = ckpt.CheckpointMetadata(
        model=model,
        model_kwargs={k: v for k, v in model_kwargs.items() if k not in ("eps", "eta", "h")},
        num_classes=10,
        input_shape=(8, 8, 1),
        dataset="digits",
        channel_mean=tuple(digits.mean.ravel()),
        channel_std=tuple(digits.std.ravel()),
        eps=eps,
        eta=eta,
        h=h,
        config={"model": model, "dataset": "digits", "data_dir": None},
        epoch=1,
    )
    net = meta.build_model()
    variables = net.init(jax.random.PRNGKey(seed), jnp.zeros((1, 8, 8, 1), jnp.float32), train=False)
    rng = np.random.default_rng(seed)
    params = _randomise(
        variables["params"],
        rng,
        {
            "delta": lambda s: rng.uniform(-0.4, 0.4, s),
            "scale": lambda s: rng.uniform(0.5, 1.5, s),
            "bias": lambda s: 0.1 * rng.standard_normal(s),
        },
    )
    if project:
        params = jax.tree.map(lambda x: np.asarray(x, np.float32), project_params(params, eps=eps, eta=eta))
    batch_stats = _randomise(
        variables.get("batch_stats", {}),
        rng,
        {
            "mean": lambda s: 0.1 * rng.standard_normal(s),
            "var": lambda s: rng.uniform(0.5, 2.0, s),
        },
    )
    state = {"step": np.asarray(1, np.int32), "params": params, "batch_stats": batch_stats}
    ckpt.save(ckpt.manager(str(directory)), 1, state, meta)
    return types.SimpleNamespace(
        path=str(directory), params=params, batch_stats=batch_stats, meta=meta, kwargs=dict(model_kwargs), eps=eps, h=h
    )


def resave_scaled(src, dst, path, factor):
    """Read ``src``, multiply ``params[path]`` by ``factor`` and save a consistent checkpoint
    (fresh digest) in ``dst``: what a trainer without the projection would have written."""
    state, meta = ckpt.load(str(src))
    node = state["params"]
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = (np.asarray(node[path[-1]]) * factor).astype(np.asarray(node[path[-1]]).dtype)
    ckpt.save(ckpt.manager(str(dst)), 1, state, ckpt.CheckpointMetadata.from_json(meta))
    return state, meta


def edit_metadata(directory, change):
    """Rewrite the stored metadata JSON of every step with ``change(dict)`` (bypassing the
    dataclass, as a foreign or damaged writer would; the arrays' digest stays valid)."""
    for path in pathlib.Path(directory).glob("*/metadata/metadata"):
        meta = json.loads(path.read_text())
        change(meta)
        path.write_text(json.dumps(meta))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One epoch of a digits_tiny-like config through the real trainer (tanh, dense)."""
    from naisnet_jax import train
    from naisnet_jax.configs import default

    config = default.get_config()
    config.dataset, config.num_epochs, config.batch_size, config.eval_batch_size = "digits", 1, 64, 128
    config.model_kwargs.features, config.model_kwargs.steps, config.progress = 16, 5, False
    config.h = 1.0  # so that R times 5 (test_scaled_up...) leaves the stable set; at h = 0.1 it does not
    workdir = tmp_path_factory.mktemp("trained")
    train.train_and_evaluate(config, str(workdir))
    return workdir / "checkpoints"


DENSE_KW = dict(features=8, steps=12, eps=0.05, h=0.7, activation="tanh")
CONV_KW = dict(activation="tanh", steps=6, learn_delta=True, eps=0.05, eta=0.5, h=0.8)


@pytest.fixture(scope="module")
def dense_tanh(tmp_path_factory, digits):
    return write_checkpoint(
        tmp_path_factory.mktemp("dense_tanh"), "naisnet_mnist", DENSE_KW, eps=0.05, h=0.7, digits=digits
    )


@pytest.fixture(scope="module")
def conv_tanh(tmp_path_factory, digits):
    """naisnet_conv_tiny with tanh: stage0_block0 (8x8x4) and stage1_block0 (stride 2, drive
    BatchNorm, 4x4x8), learnable delta."""
    return write_checkpoint(
        tmp_path_factory.mktemp("conv_tanh"), "naisnet_conv_tiny", CONV_KW, eps=0.05, h=0.8, digits=digits
    )


BASELINES = {
    "resnet_sh": dict(features=8, depth=3, h=1.0, eps=0.01),
    "resnet_sh_bn": dict(features=8, depth=3, h=0.5, eps=0.01),
    "resnet_conv_tiny": {},
}


@pytest.fixture(scope="module")
def baselines(tmp_path_factory, digits):
    return {
        name: write_checkpoint(
            tmp_path_factory.mktemp(name), name, kw, eps=0.01, h=kw.get("h", 1.0), digits=digits, project=False
        )
        for name, kw in BASELINES.items()
    }


@pytest.fixture(scope="module")
def certificates(tmp_path_factory, dense_tanh, conv_tanh, baselines):
    """``naisnet-verify DIR --json --figures --samples 16`` once per checkpoint, on demand."""
    dirs = {"dense_tanh": dense_tanh.path, "conv_tanh": conv_tanh.path, **{k: v.path for k, v in baselines.items()}}
    cache = {}

    def get(name):
        if name not in cache:
            tmp = tmp_path_factory.mktemp(f"cert_{name}")
            figures = os.path.join(tmp, "figures")
            # given with a trailing slash, as a shell completes a folder's name
            code, out, err, cert = run_cli_with_json(dirs[name], tmp, "--figures", figures + os.sep)
            cache[name] = types.SimpleNamespace(code=code, out=out, err=err, cert=cert, figures=figures)
        return cache[name]

    return get


# ============================================================ 1. the radius estimate


def test_conv_radius_by_batched_arnoldi_matches_numpy():
    """30 kernels of one shape (stable and not), their I + hA at 6x6x2 (n = 72 > the Krylov space
    of 64, so Arnoldi must restart) estimated side by side: numpy's radius, converged."""
    rng = np.random.default_rng(2)
    hw, C = (6, 6), 2
    blocks, truth = [], []
    for trial in range(30):
        stable = trial % 2 == 0
        eps, h = float(rng.uniform(0.01, 0.3)), float(np.float32(rng.uniform(0.1, 1.0)))
        raw = rng.standard_normal((3, 3, C, C)) * (0.5 if stable else 3.0)
        kernel = (
            np.asarray(project_conv(jnp.asarray(raw, jnp.float32), jnp.zeros(C, jnp.float32), eps=eps, eta=0.5)[0])
            if stable
            else centre_set(raw, np.zeros(C)).astype(np.float32)
        )
        truth.append(rho(np.eye(hw[0] * hw[1] * C) + h * loop_conv_matrix(kernel, *hw)))
        probe = BlockProbe(
            kind="conv",
            activation="relu",
            h=h,
            eps=eps,
            eta=0.5,
            operator=kernel,
            factor=np.zeros(C, np.float32),
            states=np.zeros((1, 1) + hw + (C,), np.float32),
        )
        blocks.append(Block(trial, f"b{trial}", probe, None, jax.random.PRNGKey(trial)))
    figures = _conv.parameters(blocks, AuditOptions(dense_max_n=0))
    for trial, true in enumerate(truth):
        par = figures[trial][0]
        assert par.rho_method == "arnoldi" and par.rho_converged, trial
        assert par.rho_I_plus_hA == pytest.approx(true, rel=1e-6), trial
        assert par.rho_I_plus_hA <= par.inf_norm_bound_I_plus_hA * (1 + 1e-9)


# ============================================================ 2. teeth: exit statuses


def test_trained_checkpoint_is_certified_by_the_command(trained, tmp_path):
    """The real entry point, in a fresh interpreter (no test x64 flags): exit 0."""
    path = tmp_path / "c.json"
    proc = subprocess.run(
        [sys.executable, "-m", "naisnet_jax.verify.cli", str(trained), "--samples", "8", "--json", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "CERTIFIED: every block certified stable" in proc.stdout
    assert "RuntimeWarning" not in proc.stderr, proc.stderr  # the package does not import its __main__ module
    cert = strict_json(path)
    assert cert["certified"] is True and cert["checkpoint"]["model"] == "naisnet_mnist"
    state, meta = ckpt.load(str(trained))
    assert cert["checkpoint"]["digest"] == meta["digest"]
    R = np.asarray(state["params"]["block"]["R"], np.float64)
    A = -R.T @ R - meta["eps"] * np.eye(R.shape[1])
    b = block(cert, "block")
    assert b["parameter"]["rho_I_plus_hA"] == pytest.approx(rho(np.eye(len(A)) + meta["h"] * A), rel=1e-6)
    assert b["parameter"]["condition_holds"] is True and b["parameter"]["condition1_proven"] is True
    assert b["parameter"]["frobenius_RtR"] <= fc_delta(meta["eps"])  # no slack
    assert b["parameter"]["rho_I_plus_hA"] <= b["parameter"]["rho_I_plus_hA_bound"] < 1


def test_a_step_directory_is_audited_like_its_parent(trained):
    (step,) = [d for d in os.listdir(trained) if d.isdigit()]
    cert = audit(str(trained / step), AuditOptions(data="none"))
    assert cert.certified is True and cert.source.step == int(step) and cert.source.kind == "checkpoint"


@pytest.fixture(scope="module")
def scaled(tmp_path_factory, trained, conv_tanh):
    """R (dense, trained) or stage1_block0's state_kernel (conv) times 5, re-saved as a
    consistent checkpoint, and its certificate; on demand."""
    cache = {}

    def get(which):
        if which not in cache:
            if which == "dense":
                src, name, key = str(trained), "block", ("block", "R")
            else:
                src, name, key = conv_tanh.path, "stage1_block0", ("stage1_block0", "state_kernel")
            tmp = tmp_path_factory.mktemp(f"scaled_{which}")
            state, meta = resave_scaled(src, tmp / "ck", key, 5.0)
            code, out, err, cert = run_cli_with_json(tmp / "ck", tmp)
            cache[which] = types.SimpleNamespace(
                src=src, name=name, state=state, meta=meta, code=code, out=out, err=err, cert=cert
            )
        return cache[which]

    return get


@pytest.mark.parametrize("which", ["dense", "conv"])
def test_scaled_up_state_parameters_fail_naming_the_block(which, scaled, certificates):
    """R (dense) or state_kernel (conv) times 5, re-saved as a consistent checkpoint: exit 1,
    and the certificate names the block and the violated condition."""
    if which == "conv":
        assert certificates("conv_tanh").code == 0  # the unscaled checkpoint passes
    sc = scaled(which)
    src, name, state, meta, code, out, err, cert = (
        sc.src,
        sc.name,
        sc.state,
        sc.meta,
        sc.code,
        sc.out,
        sc.err,
        sc.cert,
    )
    assert code == 1, out + err
    assert "NOT CERTIFIED" in out
    _, original = ckpt.load(src)
    assert cert["checkpoint"]["digest"] != original["digest"]  # a new, consistent checkpoint
    assert cert["certified"] is False
    assert name in cert["reason"]
    b = block(cert, name)
    assert b["certified"] is False
    assert b["parameter"]["condition_holds"] is False
    assert "projection condition violated" in b["reason"]
    others = [x for x in cert["blocks"] if x["name"] != name]
    assert all(x["certified"] for x in others)  # only the damaged block is blamed
    params = state["params"]
    if which == "dense":
        R = np.asarray(params["block"]["R"], np.float64)
        A = -R.T @ R - meta["eps"] * np.eye(R.shape[1])
        true = rho(np.eye(len(A)) + meta["h"] * A)
        assert true >= 1
        assert b["parameter"]["rho_I_plus_hA"] == pytest.approx(true, rel=1e-6)
        assert b["parameter"]["condition1_proven"] is False
        assert "Condition 1 not proven" in b["reason"] and "rho(I + hA) bound" in b["reason"]
    else:
        node = params["stage1_block0"]
        eff = centre_set(node["state_kernel"], node["delta"])
        assert b["parameter"]["radius_over_budget_max"] > 4.9
        true = rho(np.eye(128) + meta["h"] * loop_conv_matrix(eff, 4, 4))
        assert b["parameter"]["rho_I_plus_hA"] == pytest.approx(true, rel=1e-6)
        assert true <= b["parameter"]["inf_norm_bound_I_plus_hA"]
        assert b["parameter"]["condition1_proven"] is False and "Condition 1 not proven" in b["reason"]


def _data_files(directory):
    """Every OCDBT data file: those under ``ocdbt.process_*/d/`` and the merged ``d/`` beside them.
    All of them are damaged: some are never read by a restore, which ones varies by run, and
    under load a small array's bytes can sit in the merged file alone (damaging the process
    files only was then restored without a fault, and certified)."""
    return [p for p in pathlib.Path(directory).rglob("*") if p.is_file() and p.parent.name == "d"]


def _flip(path):
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, min(len(data), len(data) // 2 + 16)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize(
    "damage", ["flip bytes of the array data", "truncate the array data", "garbage metadata", "delete the state item"]
)
def test_a_corrupted_checkpoint_exits_2_with_a_message(damage, trained, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(trained, copy)
    (step,) = [d for d in copy.iterdir() if d.name.isdigit()]
    if damage == "flip bytes of the array data":
        for path in _data_files(step / "state"):
            _flip(path)
    elif damage == "truncate the array data":
        for path in _data_files(step / "state"):
            _truncate(path)
    elif damage == "garbage metadata":
        (step / "metadata" / "metadata").write_bytes(b"{\x85 not json")
    else:
        shutil.rmtree(step / "state")
    code, out, err = run_cli(copy, "--samples", 4)
    assert code == 2, out + err
    assert "error: unusable checkpoint:" in err
    assert str(copy) in err
    assert "CERTIFIED" not in out


@pytest.mark.parametrize("layout", ["loose files", "fake step directory", "a plain file"])
def test_a_directory_of_garbage_exits_2_with_a_message(layout, tmp_path):
    rng = np.random.default_rng(3)
    target = tmp_path / "garbage"
    if layout == "loose files":
        target.mkdir()
        (target / "weights.bin").write_bytes(rng.bytes(256))
        (target / "notes.txt").write_text("not a checkpoint")
    elif layout == "fake step directory":
        for item in ("state", "metadata"):
            (target / "7" / item).mkdir(parents=True)
        (target / "7" / "state" / "_METADATA").write_bytes(rng.bytes(64))
        (target / "7" / "metadata" / "metadata").write_bytes(rng.bytes(64))
    else:
        target.write_bytes(rng.bytes(64))
    code, out, err = run_cli(target)
    assert code == 2, out + err
    assert err.startswith("error: unusable checkpoint:") and str(target) in err


def test_a_missing_directory_exits_2(tmp_path):
    code, out, err = run_cli(tmp_path / "does-not-exist")
    assert code == 2
    assert "no such checkpoint directory" in err


def test_a_non_positive_sample_count_is_refused(dense_tanh):
    code, out, err = run_cli(dense_tanh.path, "--samples", 0)
    assert code == 2 and "--samples=0" in err


def test_the_audit_never_unpickles(trained, conv_tanh, monkeypatch):
    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise AssertionError("the audit tried to unpickle")

    class Refusing:
        def __init__(self, *args, **kwargs):
            refuse(*args)

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", Refusing)
    for path in (trained, conv_tanh.path):
        code, out, err = run_cli(path, "--samples", 4)
        assert code == 0, out + err
    assert calls == []


# ============================================================ 3. trajectories and equilibria


def _dense_reference(ck, digits):
    """The dense block's drive, A, and x_0 .. x_K by a plain numpy loop from the saved arrays."""
    p = ck.params["block"]
    R = np.asarray(p["R"], np.float64)
    n, K, h, eps = R.shape[1], ck.kwargs["steps"], ck.h, ck.eps
    # the operator the model runs: formed in float32 from the float32 R (then numpy float64)
    A = np.asarray(fc_state_matrix(jnp.asarray(p["R"], jnp.float32), eps), np.float64)
    u = digits.x.reshape(len(digits.x), -1)
    drive = u @ np.asarray(p["input"]["kernel"], np.float64) + np.asarray(p["input"]["bias"], np.float64)
    X = [np.zeros((len(u), n))]
    for _ in range(K):
        X.append(X[-1] + h * np.tanh(X[-1] @ A.T + drive))
    return A, drive, np.stack(X)


def test_dense_tanh_block_trajectory_figures(dense_tanh, certificates, digits):
    c = certificates("dense_tanh")
    assert c.code == 0, c.out + c.err
    b = block(c.cert, "block")
    t = b["trajectory"]
    assert b["certified"] is True
    assert t["states"] == DENSE_KW["steps"] * SAMPLES
    assert 0 < t["rho_J_max"] < 1
    for key in ("gamma_theorem", "gamma_measured", "io_gain_measured", "rho_bar_theorem", "B_norm_2"):
        assert isinstance(t[key], float) and np.isfinite(t[key]), key
    assert t["rho_J_max"] <= t["rho_bar_theorem"] + 1e-12
    assert 0 < t["io_gain_measured"] <= t["gamma_theorem"]
    eq = t["equilibrium"]
    assert eq["energy_norm_bound_holds"] is True
    assert 0 < eq["contraction_energy_norm"] < 1
    # independent: max over visited states in P (every slope >= sigma_min) of rho(I + h diag(s) A)
    A, drive, X = _dense_reference(dense_tanh, digits)
    slopes = (1 - np.tanh(X[:-1] @ A.T + drive) ** 2).reshape(-1, len(A))
    radii = np.array([rho(np.eye(len(A)) + dense_tanh.h * s[:, None] * A) for s in slopes])
    in_p = np.all(slopes >= 1e-2, axis=1)
    assert t["states_in_P_fraction"] == pytest.approx(in_p.mean())
    assert in_p.any() and t["rho_J_max"] == pytest.approx(radii[in_p].max(), rel=1e-9)
    assert t["rho_J_max_visited"] == pytest.approx(radii.max(), rel=1e-9)
    assert t["rho_J_max"] <= block(c.cert, "block")["parameter"]["rho_bar_bound"]
    assert t["slope_min"] == pytest.approx(slopes.min(), rel=1e-6, abs=1e-12)
    B = np.asarray(dense_tanh.params["block"]["input"]["kernel"], np.float64)
    assert t["B_norm_2"] == pytest.approx(np.linalg.svd(B, compute_uv=False)[0], rel=1e-9)


def test_dense_equilibrium_matches_an_independent_numpy_unroll(dense_tanh, certificates, digits):
    """x* = -A^{-1}(u B + b) from the checkpoint's arrays and the digits inputs; a long plain
    unroll converges to it, and the residual after K steps is the audit's."""
    eq = block(certificates("dense_tanh").cert, "block")["trajectory"]["equilibrium"]
    A, drive, X = _dense_reference(dense_tanh, digits)
    x_star = -np.linalg.solve(A, drive.T).T
    residual = np.max(np.linalg.norm(X[-1] - x_star, axis=1) / np.linalg.norm(x_star, axis=1))
    assert eq["residual_rel_max"] == pytest.approx(residual, rel=1e-6)
    assert 1e-3 < residual < 1  # K steps got part of the way, not all of it
    x = X[-1]
    for _ in range(20_000):
        x_next = x + dense_tanh.h * np.tanh(x @ A.T + drive)
        if np.max(np.abs(x_next - x)) < 1e-15:
            break
        x = x_next
    np.testing.assert_allclose(x, x_star, rtol=0, atol=1e-9 * np.abs(x_star).max())
    energy = lambda e: np.sqrt(np.einsum("bi,ij,bj->b", e, -A, e))  # noqa: E731
    ratio = np.max(energy(X[-1] - x_star) / energy(X[0] - x_star))
    assert eq["residual_energy_ratio_max"] == pytest.approx(ratio, rel=1e-6)
    assert ratio <= eq["contraction_energy_norm"] ** DENSE_KW["steps"] * (1 + 1e-9)


def _conv_stage0_reference(ck, digits):
    """naisnet_conv_tiny's stem and first block by plain matrices: drive, state matrix, states."""
    p, bs = ck.params, ck.batch_stats
    H = W = 8
    x = digits.x.reshape(len(digits.x), -1)  # (batch, 64), row-major (y, x, c)
    y = x @ loop_conv_matrix(p["stem"]["kernel"], H, W).T
    g = bn_multiplier(p["stem_bn"]["scale"], bs["stem_bn"]["var"])
    y = (y - np.tile(bs["stem_bn"]["mean"], H * W)) * np.tile(g, H * W) + np.tile(p["stem_bn"]["bias"], H * W)
    u = np.tanh(y)
    blk = p["stage0_block0"]
    drive = u @ loop_conv_matrix(blk["input"]["kernel"], H, W).T
    if "drive_norm" in blk:  # BatchNorm on the drive (the default), its offset playing E
        n, stats = blk["drive_norm"], bs["stage0_block0"]["drive_norm"]
        g = bn_multiplier(n["scale"], stats["var"])
        drive = (drive - np.tile(stats["mean"], H * W)) * np.tile(g, H * W) + np.tile(n["bias"], H * W)
    else:
        drive = drive + np.tile(blk["input"]["bias"], H * W)
    M = loop_conv_matrix(centre_set(blk["state_kernel"], blk["delta"]), H, W)
    X = [np.zeros_like(drive)]
    for _ in range(ck.kwargs["steps"]):
        X.append(X[-1] + ck.h * np.tanh(X[-1] @ M.T + drive))
    return M, drive, np.stack(X)


def test_conv_tanh_blocks_trajectory_figures(conv_tanh, certificates):
    c = certificates("conv_tanh")
    assert c.code == 0, c.out + c.err
    assert [b["name"] for b in c.cert["blocks"]] == ["stage0_block0", "stage1_block0"]
    for b in c.cert["blocks"]:
        p, t = b["parameter"], b["trajectory"]
        assert b["kind"] == "conv" and b["certified"] is True
        assert p["condition_holds"] is True
        assert p["rho_I_plus_hA"] <= p["inf_norm_bound_I_plus_hA"] <= 1 - conv_tanh.h * conv_tanh.eps + 1e-6
        assert 0 < t["rho_J_max"] < 1
        assert t["rho_J_max"] <= t["inf_norm_J_max"] + 1e-12  # a radius is below any norm
        # the conv Lemma's worst case, up to the float32 round-off that rel_tol admits
        assert t["inf_norm_J_max"] <= t["rho_bar_theorem"] + 1e-6
        for key in ("gamma_theorem", "gamma_measured", "io_gain_measured", "B_norm_inf"):
            assert isinstance(t[key], float) and np.isfinite(t[key]), key
        assert 0 < t["io_gain_measured"] <= t["gamma_theorem"]
        eq = t["equilibrium"]
        assert eq["inf_norm_bound_holds"] is True
        assert 0 < eq["contraction_inf_norm"] < 1
        assert eq["x_star_error_bound_inf"] < 1e-9


def test_conv_parameter_radius_at_block_resolution_matches_numpy(conv_tanh, certificates):
    cert = certificates("conv_tanh").cert
    for name, (H, W) in (("stage0_block0", (8, 8)), ("stage1_block0", (4, 4))):
        node, p = conv_tanh.params[name], block(cert, name)["parameter"]
        eff = centre_set(node["state_kernel"], node["delta"])
        C = eff.shape[-1]
        assert p["state_shape"] == [H, W, C]
        true = rho(np.eye(H * W * C) + conv_tanh.h * loop_conv_matrix(eff, H, W))
        assert p["rho_I_plus_hA"] == pytest.approx(true, rel=1e-6)
        assert p["rho_converged"] is True


def test_conv_equilibrium_matches_an_independent_numpy_forward(conv_tanh, certificates, digits):
    """Stem, BatchNorm, tanh, input convolution and the state unroll of stage0_block0 written as
    plain matrices: x* = -M^{-1} drive, and the residual after K steps is the audit's."""
    eq = block(certificates("conv_tanh").cert, "stage0_block0")["trajectory"]["equilibrium"]
    M, drive, X = _conv_stage0_reference(conv_tanh, digits)
    x_star = -np.linalg.solve(M, drive.T).T
    residual = np.max(np.max(np.abs(X[-1] - x_star), axis=1) / np.max(np.abs(x_star), axis=1))
    assert eq["residual_rel_max"] == pytest.approx(residual, rel=1e-6)
    assert 1e-4 < residual < 1
    inf = np.max(np.abs(X - x_star), axis=2)  # (K+1, batch)
    k = np.arange(len(X))[:, None]
    assert np.all(inf <= eq["contraction_inf_norm"] ** k * inf[0] + 1e-12)


# ============================================================ 4. baselines


@pytest.mark.parametrize("name", ["resnet_sh", "resnet_sh_bn"])
def test_dense_baselines_are_never_certified_and_radii_are_exact(name, baselines, certificates):
    c, ck = certificates(name), baselines[name]
    assert c.code == 1, c.out + c.err
    assert c.cert["certified"] is False
    assert c.cert["reason"] == "baseline model: no NAIS block to certify"
    (b,) = c.cert["blocks"]
    assert b["kind"] == "dense-baseline" and b["certified"] is False and b["reason"]
    W = np.asarray(ck.params["W"], np.float64)
    h, n = ck.h, W.shape[0]
    if name.endswith("_bn"):
        gains = [
            bn_multiplier(ck.params[f"bn{k}"]["scale"], ck.batch_stats[f"bn{k}"]["var"])
            for k in range(ck.kwargs["depth"])
        ]
    else:
        gains = [np.ones(n)]
    radii = [rho(np.eye(n) + h * g[:, None] * W) for g in gains]
    np.testing.assert_allclose(b["parameter"]["rho_per_layer"], radii, rtol=1e-6)
    assert b["parameter"]["rho_I_plus_hA"] == pytest.approx(max(radii), rel=1e-6)
    assert c.cert["summary"]["certified_blocks"] == 0


def test_conv_baseline_is_never_certified_and_its_radius_is_exact(baselines, certificates):
    c, ck = certificates("resnet_conv_tiny"), baselines["resnet_conv_tiny"]
    assert c.code == 1, c.out + c.err
    assert c.cert["certified"] is False
    names = [b["name"] for b in c.cert["blocks"]]
    assert names == ["stage0_block0", "stage1_block0"]
    for b in c.cert["blocks"]:
        assert b["kind"] == "conv-baseline" and b["certified"] is False and b["reason"]
    square = block(c.cert, "stage0_block0")["parameter"]
    node = ck.params["stage0_block0"]
    g = bn_multiplier(node["bn"]["scale"], ck.batch_stats["stage0_block0"]["bn"]["var"])
    M = loop_conv_matrix(np.asarray(node["conv"]["kernel"], np.float64) * g, 8, 8)
    true = rho(np.eye(len(M)) + M)
    assert square["rho_I_plus_hA"] == pytest.approx(true, rel=1e-6)
    assert true <= square["inf_norm_bound_I_plus_hA"]
    assert block(c.cert, "stage1_block0")["parameter"]["rho_I_plus_hA"] is None  # width changes


# ============================================================ 5. certificate, figures, data modes

TOP_LEVEL = {
    "schema",
    "certified",
    "reason",
    "summary",
    "checkpoint",
    "versions",
    "device",
    "precision",
    "hyperparameters",
    "tolerances",
    "data",
    "seconds",
    "blocks",
    "timings",
    "figure_status",
}
TRAJECTORY = {
    "rho_J_max",
    "unsaturated_fraction",
    "states_in_P_fraction",
    "rho_bar_theorem",
    "rho_bar_measured",
    "gamma_theorem",
    "gamma_measured",
    "io_gain_measured",
    "equilibrium",
}


@pytest.mark.parametrize("name", ["dense_tanh", "conv_tanh", "resnet_conv_tiny"])
def test_certificate_has_the_documented_fields(name, certificates, dense_tanh, conv_tanh, baselines):
    ck = {"dense_tanh": dense_tanh, "conv_tanh": conv_tanh, **baselines}[name]
    cert = certificates(name).cert
    assert TOP_LEVEL <= set(cert)
    assert cert["schema"] == "naisnet-jax-certificate/2"
    assert {"path", "step", "epoch", "model", "model_kwargs", "dataset", "digest"} <= set(cert["checkpoint"])
    _, meta = ckpt.load(ck.path)
    for key in ("step", "epoch", "model", "model_kwargs", "dataset", "digest"):
        assert cert["checkpoint"][key] == meta[key], key
    assert cert["checkpoint"]["path"] == ck.path
    assert {"eps", "eta", "h", "relaxed", "activation"} <= set(cert["hyperparameters"])
    assert (cert["hyperparameters"]["eps"], cert["hyperparameters"]["h"]) == (ck.eps, ck.h)
    assert {"source", "samples"} <= set(cert["data"])
    assert cert["data"]["samples"] == SAMPLES and cert["data"]["source"].startswith("digits test split")
    assert {"blocks", "certified_blocks", "rho_I_plus_hA_max"} <= set(cert["summary"])
    assert cert["summary"]["blocks"] == len(cert["blocks"])
    assert cert["summary"]["certified_blocks"] == sum(b["certified"] for b in cert["blocks"])
    for b in cert["blocks"]:
        assert {"name", "kind", "certified", "verdict", "reason", "parameter", "trajectory", "spectrum"} <= set(b)
        assert b["kind"] in ("dense", "conv", "dense-baseline", "conv-baseline")
        assert not any(k.startswith("_") for k in b["parameter"])
        if b["kind"] in ("dense", "conv"):
            assert {"condition", "condition_holds", "condition1_proven", "rho_I_plus_hA", "rho_bar_bound"} <= set(
                b["parameter"]
            )
            assert TRAJECTORY <= set(b["trajectory"])
    for name_ in cert["figure_status"]:  # every figure says whether it is proven or estimated
        assert cert["figure_status"][name_] in ("proven", "computed", "estimate", "measured", "setting")
    rhos = [b["parameter"]["rho_I_plus_hA"] for b in cert["blocks"] if b["parameter"]["rho_I_plus_hA"] is not None]
    assert cert["summary"]["rho_I_plus_hA_max"] == pytest.approx(max(rhos))


@pytest.mark.parametrize("name", ["dense_tanh", "conv_tanh"])
def test_figures_write_one_png_per_block(name, certificates):
    c = certificates(name)
    assert f"figures: {c.figures}/\n" in c.out  # one slash, not two
    expected = sorted(report.figure_name(b["name"]) for b in c.cert["blocks"])
    assert sorted(os.listdir(c.figures)) == expected
    for f in expected:
        with open(os.path.join(c.figures, f), "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_figures_cover_baseline_blocks_with_a_radius(certificates):
    c = certificates("resnet_conv_tiny")
    assert report.figure_name("stage0_block0") in (os.listdir(c.figures) if os.path.isdir(c.figures) else [])


def test_conv_theorem_figures_bound_the_measured_ones_for_a_violated_kernel(scaled):
    t = block(scaled("conv").cert, "stage1_block0")["trajectory"]
    # a worst case that the measured contraction factor exceeds is not a bound
    assert t["inf_norm_J_max"] <= t["rho_bar_theorem"] * (1 + 1e-9)
    assert t["gamma_theorem"] == "inf" or t["rho_bar_theorem"] >= 1


def test_data_none_skips_the_trajectories(conv_tanh, tmp_path):
    code, out, err, cert = run_cli_with_json(conv_tanh.path, tmp_path, "--data=none")
    assert code == 0, out + err
    assert cert["data"] == {"source": "none", "samples": 0}
    for b in cert["blocks"]:
        assert b["trajectory"] is None
        assert b["parameter"]["rho_I_plus_hA"] < 1 and b["certified"] is True


@pytest.mark.parametrize("which", ["dense_tanh", "conv_tanh"])
def test_data_random_uses_synthetic_inputs(which, dense_tanh, conv_tanh, tmp_path):
    ck = {"dense_tanh": dense_tanh, "conv_tanh": conv_tanh}[which]
    code, out, err, cert = run_cli_with_json(ck.path, tmp_path, "--data=random")
    assert code == 0, out + err
    assert cert["data"]["source"].startswith("synthetic") and cert["data"]["samples"] == SAMPLES
    for b in cert["blocks"]:
        assert 0 < b["trajectory"]["rho_J_max"] < 1
        assert "equilibrium" in b["trajectory"]


# ============================================================ bugs found and fixed


@pytest.mark.parametrize("change", ["features that do not match R", "no input_shape", "no eps", "unknown dataset"])
def test_metadata_that_does_not_fit_the_arrays_exits_2(change, trained, tmp_path):
    shutil.copytree(trained, tmp_path / "ck")

    def damage(meta):
        if change == "features that do not match R":
            meta["model_kwargs"] = dict(meta["model_kwargs"], features=8)
        elif change == "unknown dataset":
            meta["dataset"] = "no_such_dataset"
        else:
            del meta[change.split()[1]]

    edit_metadata(tmp_path / "ck", damage)
    try:
        code, out, err = run_cli(tmp_path / "ck", "--samples", 4)
    except Exception as e:  # noqa: BLE001 - escaping at all is the bug
        pytest.fail(f"the audit raised {type(e).__name__}: {e}")
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err


def test_version_1_metadata_whose_h_disagrees_with_the_model_is_refused(tmp_path, digits):
    """Version-1 metadata repeated h in model_kwargs (what the network ran) and at top level;
    when the two disagree the audit cannot say which h to analyse: exit 2."""
    ck = write_checkpoint(tmp_path / "ck", "naisnet_mnist", DENSE_KW, eps=0.05, h=0.7, digits=digits)

    def to_version_1(meta):
        meta.pop("metadata_version")
        meta.pop("metadata_digest")  # version 1 came before the metadata's own digest
        meta["model_kwargs"] = dict(meta["model_kwargs"], eps=0.05, h=0.5)  # the network: h = 0.5

    edit_metadata(ck.path, to_version_1)
    code, out, err = run_cli(ck.path, "--samples", 4)
    assert code == 2 and "h=0.7 disagrees with model_kwargs h=0.5" in err
