"""What Algorithm 1 does to the FC NAIS-Net's state matrix in its first steps, at each step size h.

    python -m experiments.fc_spectrum --workdir=runs/fc_spectrum [--hs=1,0.5,0.25,0.1,1/30]
    python -m experiments.fc_spectrum --smoke --workdir=/tmp/fc_spectrum    # digits, seconds

Section 5.1's NAIS-Net (``naisnet_mnist``: one block, 128 tanh units, K = 30, ``A = -R^T R - eps I``)
is trained with the ablation's optimisation (``experiments/configs/ablation_paper.py``: SGD 0.1,
momentum 0.9, batch 128, pixels in [0, 1], seed 0) for ``--steps`` steps at every h. After the
steps listed in :data:`CHECKPOINTS` it records the spectrum of ``R^T R`` (its Frobenius norm, which
Algorithm 1 caps at ``delta = 1 - 2 eps``; its largest eigenvalue; its participation ratio
``(sum lambda)^2 / sum lambda^2``, the number of directions it effectively spans; the eigenvalues
above ``0.01``), the norm of the SGD step on ``R`` against ``||R||_F``, and, on 1,000 test images,
how the unroll moves: the last step's length over the first's (1 for a straight line, near 0 for a
trajectory that has settled) and the share of tanh units saturated (``|pre-activation| > 2``).

A direction of ``R^T R`` with eigenvalue ``lambda`` contracts by ``1 - h (lambda + eps)`` a step.
Writes ``results.json``, ``results.md`` and ``spectrum.png`` (participation ratio and trajectory
straightness against the step, one line per h) to ``--workdir``.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
from absl import app, flags

from experiments.sweep_report import script_version

HS = ("1", "0.5", "0.25", "0.1", "1/30")
CHECKPOINTS = (0, 1, 2, 5, 10, 20, 50, 100, 200, 500)
SATURATED = 2.0  # |tanh pre-activation| above this: tanh' < 0.071


def make_config(h: float, smoke: bool):
    from experiments.configs import ablation_paper

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


def measure(h: float, *, steps: int, smoke: bool) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from naisnet_jax import data as data_lib
    from naisnet_jax import train
    from naisnet_jax.parametrize import fc_state_matrix

    config = make_config(h, smoke)
    train.validate_config(config)
    ds = data_lib.load_dataset(config.dataset)
    mean, std = train.input_stats(config, ds.train_images)
    net = train.build_model(config, ds.num_classes)
    steps_per_epoch = len(ds.train_images) // config.batch_size
    state = train.create_train_state(config, net, ds.image_shape, steps_per_epoch)
    train_data = data_lib.put_on_device(ds.train_images, ds.train_labels)
    test_data = data_lib.put_on_device(ds.test_images, ds.test_labels)
    x_test, _ = data_lib.get_batch(test_data, jnp.arange(min(1000, test_data.num_examples)), mean=mean, std=std)
    step = jax.jit(train.train_step)

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

    key = jax.random.PRNGKey(config.seed)

    def batches():
        epoch = 0
        while True:
            yield from data_lib.epoch_batches(
                jax.random.fold_in(key, epoch), train_data.num_examples, config.batch_size
            )
            epoch += 1

    rows, marks, order = [], {c for c in CHECKPOINTS if c <= steps} | {steps}, batches()
    for i in range(steps + 1):
        R = np.asarray(state.params["block"]["R"], np.float64)
        if i in marks:
            straight, saturated = unroll(state)
            rows.append(
                {"h": h, "step": i, **spectrum(R), "straightness": float(straight), "saturated": float(saturated)}
            )
        if i == steps:
            break
        x, y = data_lib.get_batch(train_data, next(order), mean=mean, std=std)
        state, _ = step(state, (x, y))
        if i in marks:
            moved = np.asarray(state.params["block"]["R"], np.float64) - R
            rows[-1]["update_over_R"] = float(np.linalg.norm(moved) / np.linalg.norm(R))
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

    os.makedirs(workdir, exist_ok=True)
    t0 = time.time()
    rows = [r for h in hs for r in measure(parse_h(h), steps=steps, smoke=smoke)]
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


def _main(argv):
    del argv
    try:
        run(workdir=FLAGS.workdir, hs=FLAGS.hs, steps=FLAGS.steps, smoke=FLAGS.smoke)
    except ValueError as e:
        raise app.UsageError(str(e)) from e


if __name__ == "__main__":
    _define_flags()
    app.run(_main)
