"""Shared parts of the benchmark scripts: paths, one subprocess per variant (resumable),
result tables (JSON + markdown), FLOP counting on jaxprs, and the cards' peak rates.

Every script runs the whole benchmark with one command, prints a short table last,
writes ``<name>.json``, ``<name>.md`` and figures under ``--out``, keeps one JSON file
per finished variant under ``--out/variants/`` (a rerun skips those: resume), and has
``--smoke`` for a tiny CPU-sized run.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Dense (no sparsity) peak rates from NVIDIA's data sheets, FLOP/s and bytes/s.
# H200 has H100 SXM's compute with faster HBM.
PEAKS = {
    "H100 SXM": dict(fp32=67e12, tf32=494.7e12, bf16=989.4e12, hbm=3.35e12),
    "H100 PCIe": dict(fp32=51e12, tf32=378e12, bf16=756e12, hbm=2.0e12),
    "H200": dict(fp32=67e12, tf32=494.7e12, bf16=989.4e12, hbm=4.8e12),
}


def importable() -> None:
    """Run from a checkout without installing: src/ and the repository root on the path."""
    for path in (ROOT, os.path.join(ROOT, "src")):
        if path not in sys.path:
            sys.path.insert(0, path)


def cifar_config():
    """The section 5.2 training config (SGD, momentum, weight decay, projection), with
    ``fast_path="plain"``: each benchmark's model options are exactly those it names (the trainer
    would otherwise give a NAIS net the fused path on a GPU)."""
    importable()
    try:
        from naisnet_jax.configs import cifar10_naisnet
    except ImportError as e:  # the device image has no ml_collections unless carried
        raise SystemExit(
            f"cannot import the experiment config ({e}); install ml_collections, e.g. carry "
            f"its wheel (pip download ml_collections -d .whl) and pip install --no-index .whl/*"
        ) from e
    config = cifar10_naisnet.get_config()
    config.fast_path = "plain"
    return config


def card_peaks(device_kind: str) -> dict | None:
    """Peak rates of a card from its JAX/PyTorch device name, or None if unknown."""
    kind = device_kind.upper()
    if "H200" in kind:
        return PEAKS["H200"]
    if "H100" in kind:
        return PEAKS["H100 PCIe" if "PCIE" in kind else "H100 SXM"]
    return None


def host_summary() -> dict:
    """The host's CPU model and core count (a step bound by kernel launches runs at the
    host's pace: ``torch.compile``'s default mode on NAIS-Net10, thousands of kernels a step),
    the version of the script (:func:`script`) and any ``XLA_FLAGS`` the run was given."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    summary = {"host_cpu": model or platform.processor() or "unknown", "host_cores": os.cpu_count(), "script": script()}
    if os.environ.get("XLA_FLAGS"):
        summary["xla_flags"] = os.environ["XLA_FLAGS"]
    return summary


def script() -> str:
    """The commit of the tree the benchmark ran from (``experiments.sweep_report.script_version``)."""
    importable()
    from experiments.sweep_report import script_version

    return script_version()


def device_summary() -> dict:
    import jax

    d = jax.devices()[0]
    return {
        "device_kind": d.device_kind,
        "platform": d.platform,
        "device_count": jax.device_count(),
        "jax": jax.__version__,
        **host_summary(),
    }


def peak_bytes() -> float:
    """The allocator's peak since the process started (GPU); NaN where not reported."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return float(stats.get("peak_bytes_in_use", math.nan))


def memory_analysis(compiled) -> dict:
    """XLA's buffer assignment for a compiled function: bytes of temporaries, arguments, outputs."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # pragma: no cover - not every backend reports it
        return {}
    if m is None:
        return {}
    out = {}
    for field in (
        "temp_size_in_bytes",
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "alias_size_in_bytes",
        "generated_code_size_in_bytes",
    ):
        value = getattr(m, field, None)
        if value is not None:
            out[field] = int(value)
    return out


# ------------------------------------------------------------------ FLOP counting


def _subjaxprs(params: dict) -> Iterable:
    from jax.extend import core

    for value in params.values():
        items = value if isinstance(value, (tuple, list)) else (value,)
        for item in items:
            if isinstance(item, core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, core.Jaxpr):
                yield item


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


def count_jaxpr(jaxpr) -> dict:
    """FLOPs of convolutions and matrix products in a jaxpr, and the bytes of their operands.

    ``lax.scan`` bodies count ``length`` times; ``cond`` counts its costliest branch;
    a ``while_loop`` body counts once (its trip count is not static) and is reported
    under ``"while_loops"``. Elementwise work is not counted (it is small next to the
    convolutions of these nets, and fuses into them). Plain meaning: sum over every
    conv/dot executed of ``2 * output size * reduction length``.
    """
    total = {"flops": 0.0, "bytes": 0.0, "while_loops": 0}

    def add(into, part, times=1):
        into["flops"] += times * part["flops"]
        into["bytes"] += times * part["bytes"]
        into["while_loops"] += part["while_loops"]

    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "conv_general_dilated":
            lhs, rhs = (v.aval for v in eqn.invars)
            out = eqn.outvars[0].aval
            dn = eqn.params["dimension_numbers"]
            rhs_spec = dn.rhs_spec  # (out feature, in feature, *spatial)
            reduce = rhs.shape[rhs_spec[1]] * _prod(rhs.shape[d] for d in rhs_spec[2:])
            total["flops"] += 2.0 * _prod(out.shape) * reduce
            total["bytes"] += sum(_prod(a.shape) * a.dtype.itemsize for a in (lhs, rhs, out))
        elif name == "dot_general":
            lhs, rhs = (v.aval for v in eqn.invars)
            out = eqn.outvars[0].aval
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            total["flops"] += 2.0 * _prod(out.shape) * _prod(lhs.shape[d] for d in lhs_contract)
            total["bytes"] += sum(_prod(a.shape) * a.dtype.itemsize for a in (lhs, rhs, out))
        elif name == "scan":
            add(total, count_jaxpr(eqn.params["jaxpr"].jaxpr), eqn.params["length"])
        elif name == "cond":
            parts = [count_jaxpr(b.jaxpr) for b in eqn.params["branches"]]
            add(total, max(parts, key=lambda p: p["flops"]))
        elif name == "while":
            part = count_jaxpr(eqn.params["body_jaxpr"].jaxpr)
            part["while_loops"] += 1
            add(total, part)
        else:
            for sub in _subjaxprs(eqn.params):
                add(total, count_jaxpr(sub))
    return total


def count_flops(fn: Callable, *args) -> dict:
    """:func:`count_jaxpr` of ``jax.make_jaxpr(fn)(*args)``."""
    import jax

    return count_jaxpr(jax.make_jaxpr(fn)(*args).jaxpr)


# ------------------------------------------------------- variants in subprocesses


def run_variants(
    script: str,
    names: list[str],
    out: str,
    *,
    child_args: list[str],
    env_for: Callable[[str], dict] = lambda name: {},
    timeout_for: Callable[[str], float] = lambda name: 600.0,
    fresh: bool = False,
    budget: float | None = None,
) -> list[dict]:
    """Run ``script --one=NAME --out=OUT *child_args`` for each name in its own process.

    A variant's row is the JSON file the child writes to ``OUT/variants/NAME.json``;
    an existing file is reused (resume) unless ``fresh``. A child that fails or runs
    past its timeout leaves a row ``{"name", "error"}`` and the others go on. With
    ``budget`` (seconds), no child outlives it: later ones are left for a rerun (a
    device command has a 10-minute limit; the same command resumes where this stopped).
    """
    vdir = os.path.join(out, "variants")
    os.makedirs(vdir, exist_ok=True)
    rows = []
    deadline = None if budget is None else time.time() + budget
    for name in names:
        if deadline is not None and deadline - time.time() < 30:
            rows.append({"name": name, "error": "not run yet (time budget): rerun the same command"})
            print(f"[{name}] left for a rerun (time budget)", flush=True)
            continue
        path = os.path.join(vdir, f"{name}.json")
        if os.path.exists(path) and not fresh:
            with open(path) as f:
                rows.append(json.load(f))
            print(f"[{name}] done earlier (resume)", flush=True)
            continue
        env = dict(os.environ)
        extra = env_for(name)
        if "XLA_FLAGS" in extra:
            extra = dict(extra, XLA_FLAGS=(env.get("XLA_FLAGS", "") + " " + extra["XLA_FLAGS"]).strip())
        env.update(extra)
        cmd = [sys.executable, script, f"--one={name}", f"--out={out}", *child_args]
        print(f"[{name}] running{' with ' + str(extra) if extra else ''}", flush=True)
        t0 = time.time()
        timeout = timeout_for(name)
        if deadline is not None:
            timeout = min(timeout, deadline - time.time())
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-12:]
            failed = proc.returncode != 0 or not os.path.exists(path)
            reason = f"exit code {proc.returncode}"
        except subprocess.TimeoutExpired as e:
            text = (e.stdout or b"") + (e.stderr or b"")
            text = text.decode(errors="replace") if isinstance(text, bytes) else text
            # a child killed after writing its row (atomically, at its very end) has finished
            tail, reason = text.strip().splitlines()[-12:], f"timeout {timeout:.0f} s"
            failed = not os.path.exists(path)
        if failed:
            row = {"name": name, "error": reason, "log_tail": tail, "wall_s": time.time() - t0}
            with open(path + ".err", "w") as f:
                json.dump(row, f, indent=2)
            print(f"[{name}] FAILED ({reason}): {' | '.join(tail[-3:])}", flush=True)
            rows.append(row)
            continue
        if os.path.exists(path + ".err"):  # an earlier attempt's failure, superseded
            os.remove(path + ".err")
        with open(path) as f:
            row = json.load(f)
        row["wall_s"] = time.time() - t0
        rows.append(row)
        print(f"[{name}] done in {row['wall_s']:.0f} s", flush=True)
    return rows


def write_row(out: str, name: str, row: dict) -> None:
    """A child's result, written atomically (a half-written file is never resumed from)."""
    vdir = os.path.join(out, "variants")
    os.makedirs(vdir, exist_ok=True)
    path = os.path.join(vdir, f"{name}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(dict(row, name=name), f, indent=2, allow_nan=True)
    os.replace(path + ".tmp", path)


# ------------------------------------------------------------------------ tables


def fmt(value: Any, spec: str = ".3g") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return format(value, spec)
    return str(value)


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> tuple[str, str]:
    """``columns``: (key, header, format). Returns (plain text, markdown)."""
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        if "error" in r:
            cells.append([r.get("name", "?")] + [f"FAILED: {r['error']}"] + [""] * (len(columns) - 2))
            continue
        cells.append([fmt(r.get(k), f) for k, _, f in columns])
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    text = "\n".join(
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in cells
    )
    md = ["| " + " | ".join(cells[0]) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    md += ["| " + " | ".join(row) + " |" for row in cells[1:]]
    return text, "\n".join(md)


def write_results(out: str, stem: str, payload: dict, markdown: str) -> None:
    with open(os.path.join(out, f"{stem}.json"), "w") as f:
        json.dump(payload, f, indent=2, allow_nan=True)
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write(markdown.rstrip() + "\n")


def error_row(row: dict, e: Exception) -> None:
    """A variant that the compiler or the run refuses becomes a FAILED row, not the end of the run."""
    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def report(out: str, stem: str, header: str, rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """Writes ``<stem>.json`` (the device and ``rows``) and ``<stem>.md`` under ``out``, then prints
    the header (``{device}`` in it becomes the card's name) and the table."""
    os.makedirs(out, exist_ok=True)
    text, md = table(rows, columns)
    device = device_summary()
    header = header.format(device=device["device_kind"])
    write_results(out, stem, dict(device=device, rows=rows), header + "\n\n" + md)
    print(header)
    print(text)


def bar_chart(
    path: str,
    labels: list[str],
    values: list[float],
    *,
    xlabel: str,
    title: str,
    reference: float | None = None,
    reference_label: str = "",
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.35 * len(labels) + 1.5))
    y = range(len(labels))
    ax.barh(list(y), [v if v == v else 0 for v in values], color="tab:blue")
    ax.set_yticks(list(y), labels)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    if reference:
        ax.axvline(reference, color="tab:red", ls="--", label=reference_label)
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def mosaic_dump_env(directory: str) -> dict[str, str]:
    """The environment that makes Mosaic GPU's compiler write each kernel's PTX, SASS and ptxas
    report (its warnings say whether ``wgmma`` is serialized) under ``directory`` (created) as it
    builds them: set it before a kernel is first built, remove its keys to stop."""
    os.makedirs(directory, exist_ok=True)
    return {f"MOSAIC_GPU_DUMP_{k}": v for k, v in (("TO", directory), ("PTX", "1"), ("SASS", "1"), ("PTXAS", "1"))}


def hopper_here(out: str, stem: str) -> bool:
    """Whether JAX's default device is a Hopper GPU (the wgmma kernels' scripts need one); if not,
    says so and writes ``<stem>.md`` saying why, so that ``make bench`` goes on."""
    from naisnet_jax.kernels.common import hopper_available

    if hopper_available():
        return True
    import jax

    why = f"{stem}: skipped, the wgmma kernels need a Hopper GPU (default device: {jax.devices()[0].device_kind})"
    print(why)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write(why + "\n")
    return False


# ------------------------------------------------------------------ one tied conv block


def conv_block_inputs(batch, shape, seed=0):
    """``(x0, drive, kernel, cotangent)`` of a tied conv block at state ``shape`` ``(H, W, C)``:
    random, float32, the kernel a stable NAIS kernel for ``h = 1``."""
    import jax
    import jax.numpy as jnp

    H, W, C = shape
    k = jax.random.split(jax.random.key(seed), 4)
    x0 = jax.random.normal(k[0], (batch, H, W, C), jnp.float32)
    drive = jax.random.normal(k[1], (batch, H, W, C), jnp.float32)
    # a NAIS kernel: negative-definite centre tap, small neighbours (stable for h = 1)
    kernel = 0.01 * jax.random.normal(k[2], (3, 3, C, C), jnp.float32)
    kernel = kernel.at[1, 1].add(-0.5 * jnp.eye(C))
    cot = jax.random.normal(k[3], (batch, H, W, C), jnp.float32)
    return x0, drive, kernel, cot


def block_functions(run):
    """``run(x0, drive, kernel)`` jitted, and the jitted gradient of ``<run(...), cotangent>``."""
    import jax
    import jax.numpy as jnp

    def forward(x0, drive, kernel):
        return run(x0, drive, kernel)

    def loss(x0, drive, kernel, cot):
        return jnp.vdot(run(x0, drive, kernel), cot)

    return jax.jit(forward), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def best_time(fn, args, iters, repeats):
    """Seconds a call of ``fn(*args)``: the best of ``repeats`` runs of ``iters`` calls, after a
    compile and a warm-up."""
    import jax

    jax.block_until_ready(fn(*args))  # compile
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


def rel_error(a, b):
    """``max |a - b| / max |b|`` in float64."""
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
