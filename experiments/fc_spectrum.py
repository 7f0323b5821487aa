"""What Algorithm 1 does to the FC NAIS-Net's state matrix in its first steps, at each step size h.

    python -m experiments.fc_spectrum --workdir=runs/fc_spectrum [--hs=1,0.5,0.25,0.1,1/30]
    python -m experiments.fc_spectrum --smoke --workdir=/tmp/fc_spectrum    # digits, seconds
    python -m experiments.fc_spectrum --drive_probe --hs=1 --steps=50 --workdir=runs/fc_spectrum

Section 5.1's NAIS-Net (``naisnet_mnist``: one block, 128 tanh units, K = 30, ``A = -R^T R - eps I``)
is trained with the ablation's optimisation (``src/naisnet_jax/configs/ablation_paper.py``: SGD 0.1,
momentum 0.9, batch 128, inputs standardised by the training set's mean and std, seed 0) for
``--steps`` steps at every h. After the
steps listed in :data:`CHECKPOINTS` it records the spectrum of ``R^T R`` (its Frobenius norm, which
Algorithm 1 caps at ``delta = 1 - 2 eps``; its largest eigenvalue; its participation ratio
``(sum lambda)^2 / sum lambda^2``, the number of directions it effectively spans; the eigenvalues
above ``0.01``), the norm of the SGD step on ``R`` against ``||R||_F``, and, on 1,000 test images,
how the unroll moves: the last step's length over the first's (1 for a straight line, near 0 for a
trajectory that has settled) and the share of tanh units saturated (``|pre-activation| > 2``).

A direction of ``R^T R`` with eigenvalue ``lambda`` contracts by ``1 - h (lambda + eps)`` a step.
Writes ``results.json``, ``results.md`` and ``spectrum.png`` (participation ratio and trajectory
straightness against the step, one line per h) to ``--workdir``.

``--drive_probe`` measures instead what saturates the tanh units (:func:`drive_probe`), at each h
and each ``eps`` of ``--probe_eps``: on the same 1,000 test images, the drive ``u B^T + b`` (the
block's ``"input"`` Dense), the state term ``x_k A^T`` and the pre-activation ``x_k A^T + u B^T + b``
over all K steps (``k = 0 .. K-1``, ``x_0 = 0``); the share of pre-activations beyond 2; and that
share again with ``R`` put back at its start (the trained drive alone) and with the drive put back
at its start (the trained ``R`` alone). It writes ``drive_probe.json`` and ``drive_probe.md`` and
leaves the spectrum's outputs as they are.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
from absl import app, flags

from experiments import sweep_report
from experiments.sweep_report import exit_with_error, script_version

HS = ("1", "0.5", "0.25", "0.1", "1/30")
PROBE_EPS = ("0.01", "0.25")
CHECKPOINTS = (0, 1, 2, 5, 10, 20, 50, 100, 200, 500)
SATURATED = 2.0  # |tanh pre-activation| above this: tanh' < 0.071


def make_config(h: float, smoke: bool):
    from naisnet_jax.configs import ablation_paper

    config = ablation_paper.get_config()
    config.h = h
    config.progress = False
    if smoke:
        config.dataset = "digits"
        config.model_kwargs.update({"features": 8, "steps": 3})
    return config


def spectrum(R: np.ndarray) -> dict:
    """The numbers above of ``R^T R`` (float64)."""
    m = R.T @ R
    ev = np.linalg.eigvalsh(m)
    return {
        "frobenius": float(np.linalg.norm(m)),
        "largest": float(ev.max()),
        "participation": float(ev.sum() ** 2 / np.sum(ev**2)),
        "above_0.01": int(np.sum(ev > 0.01)),
        "smallest": float(ev.min()),
    }


def _training(config):
    """What both measurements share: the train state at initialisation, the jitted SGD step (with
    Algorithm 1 after it), the first 1,000 test images (normalised as in training) and the endless
    stream of training batches ``(x, y)`` drawn from ``config.seed``."""
    import jax
    import jax.numpy as jnp

    from naisnet_jax import data as data_lib
    from naisnet_jax import train

    train.validate_config(config)
    ds = data_lib.load_dataset(config.dataset)
    mean, std = train.input_stats(config, ds.train_images)
    net = train.build_model(config, ds.num_classes)
    steps_per_epoch = len(ds.train_images) // config.batch_size
    state = train.create_train_state(config, net, ds.image_shape, steps_per_epoch)
    train_data = data_lib.put_on_device(ds.train_images, ds.train_labels)
    test_data = data_lib.put_on_device(ds.test_images, ds.test_labels)
    x_test, _ = data_lib.get_batch(test_data, jnp.arange(min(1000, test_data.num_examples)), mean=mean, std=std)
    key = jax.random.PRNGKey(config.seed)

    def batches():
        epoch = 0
        while True:
            for idx in data_lib.epoch_batches(
                jax.random.fold_in(key, epoch), train_data.num_examples, config.batch_size
            ):
                yield data_lib.get_batch(train_data, idx, mean=mean, std=std)
            epoch += 1

    return state, jax.jit(train.train_step), x_test, batches()


def measure(h: float, *, steps: int, smoke: bool) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from naisnet_jax.parametrize import fc_state_matrix

    config = make_config(h, smoke)
    state, step, x_test, order = _training(config)

    @jax.jit
    def unroll(state):
        params = state.params
        _, aux = state.apply_fn({"params": params}, x_test, train=False, return_aux=True)
        traj = aux["trajectory"]  # (K, batch, n): x_1 .. x_K
        first = jnp.linalg.norm(traj[0], axis=-1)  # x_1 - x_0 with x_0 = 0
        last = jnp.linalg.norm(traj[-1] - traj[-2], axis=-1)
        block = params["block"]
        a = fc_state_matrix(block["R"], config.eps)
        drive = x_test.reshape(x_test.shape[0], -1) @ block["input"]["kernel"] + block["input"]["bias"]
        pre = jnp.einsum("kbi,ij->kbj", traj[:-1], a.T) + drive  # steps 1..K-1 (x_0 = 0 gives the drive)
        return jnp.mean(last / first), jnp.mean(jnp.abs(pre) > SATURATED)

    rows, marks = [], {c for c in CHECKPOINTS if c <= steps} | {steps}
    for i in range(steps + 1):
        R = np.asarray(state.params["block"]["R"], np.float64)
        if i in marks:
            straight, saturated = unroll(state)
            rows.append(
                {"h": h, "step": i, **spectrum(R), "straightness": float(straight), "saturated": float(saturated)}
            )
        if i == steps:
            break
        state, _ = step(state, next(order))
        if i in marks:
            moved = np.asarray(state.params["block"]["R"], np.float64) - R
            rows[-1]["update_over_R"] = float(np.linalg.norm(moved) / np.linalg.norm(R))
    return rows


def block_terms(apply_fn, params, x, *, eps: float):
    """``(drive, state_term, pre)`` of the FC NAIS-Net's block on the images ``x``: the drive
    ``u B^T + b`` ``(batch, n)`` and, for ``k = 0 .. K-1``, ``x_k A^T`` and ``x_k A^T + u B^T + b``
    ``(K, batch, n)``, with ``A = -R^T R - eps I``. Plain-Python meaning, from the net's own unroll::

        x = 0
        for k in range(K):
            pre[k] = x A^T + drive
            x = x + h act(pre[k])
    """
    import jax.numpy as jnp

    from naisnet_jax.parametrize import fc_state_matrix

    _, aux = apply_fn({"params": params}, x, train=False, return_aux=True)
    traj = aux["trajectory"]  # x_1 .. x_K
    xs = jnp.concatenate([jnp.zeros_like(traj[:1]), traj[:-1]])  # x_0 = 0 .. x_(K-1)
    block = params["block"]
    drive = x.reshape(x.shape[0], -1) @ block["input"]["kernel"] + block["input"]["bias"]
    state_term = jnp.einsum("kbi,ij->kbj", xs, fc_state_matrix(block["R"], eps).T)
    return drive, state_term, state_term + drive


def drive_probe(h: float, eps: float, *, steps: int, smoke: bool) -> list[dict]:
    """The drive, the state term and the saturated share (module docstring) after the steps in
    :data:`CHECKPOINTS` up to ``steps``, training as :func:`measure` does with ``config.eps = eps``."""
    import jax
    import jax.numpy as jnp

    config = make_config(h, smoke)
    config.eps = eps
    state, step, x_test, order = _training(config)

    def terms(params):
        return block_terms(state.apply_fn, params, x_test, eps=eps)

    @jax.jit
    def probe(params, start):
        def saturated(p):
            return jnp.mean(jnp.abs(terms(p)[2]) > SATURATED)

        def start_of(name):  # params with the block's `name` put back at its start
            return {**params, "block": {**params["block"], name: start["block"][name]}}

        drive, state_term, pre = terms(params)
        return {
            "drive_rms": jnp.sqrt(jnp.mean(jnp.square(drive))),
            "input_kernel_norm": jnp.linalg.norm(params["block"]["input"]["kernel"]),
            "state_term_rms": jnp.sqrt(jnp.mean(jnp.square(state_term))),
            "saturated": jnp.mean(jnp.abs(pre) > SATURATED),
            "drive_beyond_2": jnp.mean(jnp.abs(drive) > SATURATED),
            "saturated_R_at_start": saturated(start_of("R")),
            "saturated_drive_at_start": saturated(start_of("input")),
        }

    start, rows = state.params, []
    marks = {c for c in CHECKPOINTS if c <= steps} | {steps}
    for i in range(steps + 1):
        if i in marks:
            values = {k: float(v) for k, v in jax.device_get(probe(state.params, start)).items()}
            R = np.asarray(state.params["block"]["R"], np.float64)
            rows.append({"h": h, "eps": eps, "step": i, **values, "participation": spectrum(R)["participation"]})
        if i == steps:
            break
        state, _ = step(state, next(order))
    return rows


def probe_table(rows: list[dict]) -> str:
    head = (
        "| h | eps | step | drive RMS | ‖B‖_F | state term RMS | participation ratio of RᵀR | "
        "pre-activations beyond 2 | drive alone beyond 2 | beyond 2, R at its start | "
        "beyond 2, drive at its start |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['h']:.4g} | {r['eps']:g} | {r['step']} | {r['drive_rms']:.3g} | {r['input_kernel_norm']:.3g} | "
            f"{r['state_term_rms']:.3g} | {r['participation']:.1f} | {100 * r['saturated']:.1f}% | "
            f"{100 * r['drive_beyond_2']:.1f}% | {100 * r['saturated_R_at_start']:.1f}% | "
            f"{100 * r['saturated_drive_at_start']:.1f}% |"
        )
    return "\n".join(lines)


def parse_eps(text) -> float:
    """One value of ``--probe_eps``: a number the model takes as ``eps``."""
    from naisnet_jax.parametrize import check_eps

    try:
        eps = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"--probe_eps has {text!r}; expected a number in (0, 0.5)") from None
    return check_eps(eps, "--probe_eps")


def run_drive_probe(*, workdir: str, hs, eps_values, steps: int, smoke: bool) -> list[dict]:
    """:func:`drive_probe` at every h and eps; writes ``drive_probe.json`` and ``drive_probe.md``."""
    from experiments.ablation import parse_h
    from naisnet_jax import sweep

    hs, eps_values = [parse_h(h) for h in hs], [parse_eps(e) for e in eps_values]  # before anything is written
    script = script_version()
    os.makedirs(workdir, exist_ok=True)
    t0 = time.time()
    rows = [r for h in hs for eps in eps_values for r in drive_probe(h, eps, steps=steps, smoke=smoke)]
    header = {
        "model": "naisnet_mnist (one block, 128 tanh units, K = 30, x_0 = 0), ablation_paper.py's optimisation, "
        "seed 0" + (" (smoke: digits, 8 units, K = 3)" if smoke else ""),
        "images": "the first 1,000 test images, normalised as in training",
        "drive": "u B^T + b, the block's 'input' Dense",
        "saturated": f"|x_k A^T + u B^T + b| > {SATURATED:g} over k = 0 .. K-1 (x_0 = 0: k = 0 is the drive)",
        "device": sweep.device_description(),
        "script": script,
        "wall time": f"{time.time() - t0:.0f} s",
    }
    with open(os.path.join(workdir, "drive_probe.json"), "w") as f:
        json.dump({"header": header, "rows": rows}, f, indent=1)
    md = ["# What saturates the FC NAIS-Net's tanh units: the drive or the state term", ""]
    md += [f"- {k}: {v}" for k, v in header.items()]
    md += [
        "",
        "RMS over the images and units (the state term also over the K steps); 'R at its start': the "
        "trained drive with R put back at its initial value; 'drive at its start': the trained R with "
        "B and b put back at theirs.",
        "",
        probe_table(rows),
        "",
    ]
    with open(os.path.join(workdir, "drive_probe.md"), "w") as f:
        f.write("\n".join(md))
    print(probe_table(rows))
    return rows


def table(rows: list[dict]) -> str:
    head = (
        "| h | step | ‖RᵀR‖_F | largest eigenvalue | participation ratio | eigenvalues > 0.01 | "
        "‖ΔR‖ / ‖R‖ of the next step | last step / first step of the unroll | tanh units saturated |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        upd = f"{r['update_over_R']:.3g}" if "update_over_R" in r else "-"
        lines.append(
            f"| {r['h']:.4g} | {r['step']} | {r['frobenius']:.3f} | {r['largest']:.3f} | {r['participation']:.1f} | "
            f"{r['above_0.01']} | {upd} | {r['straightness']:.3f} | {100 * r['saturated']:.0f}% |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], workdir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, h in enumerate(sorted({r["h"] for r in rows}, reverse=True)):
        sub = [r for r in rows if r["h"] == h]
        steps = [max(r["step"], 0.5) for r in sub]  # step 0 drawn at 0.5 on the log axis
        axes[0].plot(steps, [r["participation"] for r in sub], "o-", color=f"C{i}", label=f"h = {h:.4g}")
        axes[1].plot(steps, [r["straightness"] for r in sub], "o-", color=f"C{i}", label=f"h = {h:.4g}")
    axes[0].set(xscale="log", yscale="log", xlabel="SGD step (0 at 0.5)", ylabel="participation ratio of RᵀR")
    axes[0].set_title("Directions R^T R spans (of 128)")
    axes[1].set(xscale="log", xlabel="SGD step (0 at 0.5)", ylabel="|x_K - x_(K-1)| / |x_1 - x_0|")
    axes[1].set_title("Unroll straightness (1: a straight line, 0: settled)")
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "spectrum.png"), dpi=120)
    plt.close(fig)


def run(*, workdir: str, hs, steps: int, smoke: bool) -> list[dict]:
    from experiments.ablation import parse_h
    from naisnet_jax import sweep

    hs = [parse_h(h) for h in hs]  # before anything is written
    os.makedirs(workdir, exist_ok=True)
    t0 = time.time()
    rows = [r for h in hs for r in measure(h, steps=steps, smoke=smoke)]
    header = {
        "model": "naisnet_mnist (one block, 128 tanh units, K = 30), ablation_paper.py's optimisation, seed 0"
        + (" (smoke: digits, 8 units, K = 3)" if smoke else ""),
        "device": sweep.device_description(),
        "script": script_version(),
        "wall time": f"{time.time() - t0:.0f} s",
    }
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump({"header": header, "rows": rows}, f, indent=1)
    md = ["# Algorithm 1 in the first steps: the spectrum of RᵀR against h", ""]
    md += [f"- {k}: {v}" for k, v in header.items()]
    md += ["", table(rows), ""]
    with open(os.path.join(workdir, "results.md"), "w") as f:
        f.write("\n".join(md))
    plot(rows, workdir)
    print(table(rows))
    return rows


FLAGS = flags.FLAGS


def _define_flags() -> None:
    flags.DEFINE_string("workdir", "runs/fc_spectrum", "Where the table and figure go.")
    flags.DEFINE_list("hs", list(HS), "Step sizes (numbers or fractions).")
    flags.DEFINE_integer("steps", 500, "SGD steps at each h.", lower_bound=1)
    flags.DEFINE_bool("smoke", False, "Tiny sizes on digits: seconds on a CPU.")
    flags.DEFINE_bool(
        "drive_probe",
        False,
        "Measure what saturates the tanh units (drive_probe.json, drive_probe.md) instead of the spectrum.",
    )
    flags.DEFINE_list("probe_eps", list(PROBE_EPS), "With --drive_probe: the values of eps to train with.")


def _main(argv):
    del argv
    sweep_report.check_workdir(FLAGS.workdir)
    try:
        if FLAGS.drive_probe:
            run_drive_probe(
                workdir=FLAGS.workdir, hs=FLAGS.hs, eps_values=FLAGS.probe_eps, steps=FLAGS.steps, smoke=FLAGS.smoke
            )
            return
        run(workdir=FLAGS.workdir, hs=FLAGS.hs, steps=FLAGS.steps, smoke=FLAGS.smoke)
    except sweep_report.USER_ERRORS as e:
        exit_with_error(e)


if __name__ == "__main__":
    _define_flags()
    app.run(_main, flags_parser=sweep_report.parse_flags)
