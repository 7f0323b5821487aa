"""Benchmark: the training step of the CIFAR-shaped nets, side by side in one run.

Images/s, peak memory per image and compile time of one training step (forward,
backward, SGD with momentum and weight decay, Algorithm 2 projection: exactly
``naisnet_jax.train.train_step``) at batch 128 on 32x32x3 inputs: NAIS-Net10 plain and on
its fast paths (``scan_unroll``, the stacked custom VJP, the fused block kernels and their
engine, bfloat16 compute), NAIS-Net1 on the fused kernels, the CIFAR ResNet, and the same
NAIS-Net10 in PyTorch eager and ``torch.compile`` (``benchmarks/torch_naisnet.py``; the
target's yardstick is ``torch.compile``'s default mode, and a reference row replays its CUDA
graphs, ``mode="reduce-overhead"``). Each variant runs in its own process (fresh allocator
statistics). Timed: ``--steps`` steps in one jitted ``lax.scan`` on a fixed random batch,
best of ``--repeats``.

The floor: FLOPs of forward + backward per image, counted on the jaxpr of the step
(convolutions and matrix products; ``lax.scan`` bodies times their length; a fused model is
counted as its stacked form, the same products), against the card's peak float32 (CUDA
cores), TF32 and bfloat16 tensor-core rates.

Precision: JAX's default on GPU computes float32 convolutions with TF32; the PyTorch
rows set ``torch.backends.cudnn.allow_tf32 = True`` (its default) and
``torch.backends.cuda.matmul.allow_tf32 = True`` (its default is False) to match.

    python benchmarks/train_step.py --out=runs/bench/train_step             # all 11 variants
    python benchmarks/train_step.py --out=... --preset=compare               # fast path and torch.compile
    python benchmarks/train_step.py --out=... --variants=A,B --order=abba    # A, B, B@2, A@2
    python benchmarks/train_step.py --out=/tmp/smoke --smoke                 # tiny, on CPU

Rerunning with the same ``--out`` resumes: finished variants are read back.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

N10 = "naisnet_cifar10"
#: NAIS-Net10's fast path on a GPU, as the speed-minded user builds it (README, "Speed options")
FAST = dict(block_vjp="fused", scan_unroll=10)

# name -> spec. kind "jax": model name, model kwargs (the fused conv blocks' engine among them),
# precision, XLA flags; kind "torch": mode (eager | compile | reduce-overhead) and precision (tf32 | highest | bf16).
VARIANTS = {
    # the trainer's default step: autodiff through lax.scan
    "nais10": dict(model=N10),
    "nais10_unroll10": dict(model=N10, kwargs=dict(scan_unroll=10)),
    # the fast path without Pallas kernels (what `fused` means on a CPU or TPU)
    "nais10_stacked_unroll10": dict(model=N10, kwargs=dict(block_vjp="stacked", scan_unroll=10)),
    # the shipped fast path: the fused block kernels (wgmma on Hopper cards, Triton elsewhere)
    "nais10_fused_unroll10": dict(model=N10, kwargs=FAST),
    # the same with the Triton kernels on a Hopper card too
    "nais10_fused_unroll10_triton": dict(model=N10, kwargs=dict(FAST, kernel_engine="triton")),
    "nais10_bf16_stacked_unroll10": dict(model=N10, kwargs=dict(dtype="bfloat16", block_vjp="stacked", scan_unroll=10)),
    "nais1_fused": dict(model="naisnet_cifar1", kwargs=dict(block_vjp="fused")),
    "resnet": dict(model="resnet_cifar"),
    "torch_eager": dict(kind="torch", mode="eager", precision="tf32"),
    # the yardstick: torch.compile's default mode
    "torch_compile": dict(kind="torch", mode="compile", precision="tf32"),
    # for reference: torch.compile replaying CUDA graphs (mode="reduce-overhead"), no launch cost
    "torch_compile_cudagraphs": dict(kind="torch", mode="reduce-overhead", precision="tf32"),
}
PRESETS = {
    "all": list(VARIANTS),
    # the headline figure: the fast path beside torch.compile in one run
    "compare": ["nais10_fused_unroll10", "torch_compile"],
    "quick": [
        "nais10",
        "nais10_stacked_unroll10",
        "nais10_fused_unroll10",
        "nais1_fused",
        "resnet",
        "torch_eager",
        "torch_compile",
    ],
}
SMOKE_MODELS = {  # the same code paths at a size a CPU runs in seconds
    N10: ("naisnet_conv_tiny", dict(steps=2, num_classes=10)),
    "naisnet_cifar1": ("naisnet_conv_tiny", dict(steps=1, num_classes=10)),
    "resnet_cifar": ("resnet_conv_tiny", dict(num_classes=10)),
}


# --------------------------------------------------------------------------- JAX


def model_and_state(spec, smoke):
    import ml_collections

    from naisnet_jax import train

    config = _common.cifar_config()
    name, kwargs = spec["model"], dict(spec.get("kwargs", {}))
    if smoke:
        name, base = SMOKE_MODELS[name]
        kwargs = {**base, **kwargs}
    kwargs.pop("num_classes", None)
    config.model = name
    config.model_kwargs = ml_collections.ConfigDict(kwargs)
    model = train.build_model(config, 10)
    state = train.create_train_state(config, model, (32, 32, 3), steps_per_epoch=1000)
    return config, model, state


def fixed_batch(batch, seed=0):
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(batch, 32, 32, 3), dtype=np.uint8)
    x = (images.astype(np.float32) / 255.0 - 0.5) / 0.25
    y = rng.integers(0, 10, size=batch).astype(np.int32)
    return jnp.asarray(x), jnp.asarray(y)


def step_flops(state, x, y) -> dict:
    """Counted FLOPs and conv/matmul operand bytes of one ``train_step``, per image of ``x``."""
    from naisnet_jax import train

    counted = _common.count_flops(lambda s: train.train_step(s, (x, y)), state)
    return {k: v / x.shape[0] if k != "while_loops" else v for k, v in counted.items()}


def _countable(config, state):
    """``state`` with a model whose step the jaxpr counter sees whole: the fused kernels'
    products sit inside ``pallas_call``, which it cannot count, so a ``block_vjp="fused"``
    model is counted as its ``"stacked"`` form (the same products: K convolutions forward,
    K input gradients and one stacked weight gradient backward)."""
    from naisnet_jax import train

    if config.model_kwargs.get("block_vjp") != "fused":
        return state
    import ml_collections

    kwargs = dict(config.model_kwargs.to_dict(), block_vjp="stacked")
    kwargs.pop("kernel_engine", None)  # an option of the fused path only
    config = config.copy_and_resolve_references()
    config.model_kwargs = ml_collections.ConfigDict(kwargs)
    return state.replace(apply_fn=train.build_model(config, 10).apply)


def training_chunk(steps: int):
    """``steps`` training steps (``naisnet_jax.train.train_step`` on a fixed batch) in one
    jitted ``lax.scan``, the state donated: ``(state, x, y) -> (state, last loss)``."""
    import jax

    from naisnet_jax import train

    def chunk(state, x, y):
        def body(s, _):
            s, m = train.train_step(s, (x, y))
            return s, m["loss"]

        state, losses = jax.lax.scan(body, state, None, length=steps)
        return state, losses[-1]

    return jax.jit(chunk, donate_argnums=(0,))


def run_jax(spec, *, batch, steps, repeats, smoke) -> dict:
    import jax
    import numpy as np

    if spec.get("precision"):
        jax.config.update("jax_default_matmul_precision", spec["precision"])
    config, model, state = model_and_state(spec, smoke)
    x, y = fixed_batch(batch)
    counted = step_flops(_countable(config, state), x, y)  # tracing only: no compile, no device work
    param_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(state.params))
    f = training_chunk(steps)
    t0 = time.perf_counter()
    lowered = f.lower(state, x, y)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    state, loss = compiled(state, x, y)
    loss = float(loss)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        state, loss_now = compiled(state, x, y)
        jax.block_until_ready(loss_now)
        times.append(time.perf_counter() - t)
    best = min(times)
    mem = _common.memory_analysis(compiled)
    peak = _common.peak_bytes()
    return {
        "kind": "jax",
        "model": spec["model"],
        "kwargs": spec.get("kwargs", {}),
        "precision": spec.get("precision") or "default",
        "xla_flags": spec.get("xla_flags", ""),
        "batch": batch,
        "ms_per_step": 1000 * best / steps,
        "images_per_s": batch * steps / best,
        "trace_lower_s": t1 - t0,
        "compile_s": t2 - t1,
        "peak_bytes": peak,
        "peak_mib_per_image": (peak - 2 * param_bytes) / batch / 2**20 if not math.isnan(peak) else math.nan,
        "temp_mib_per_image": mem.get("temp_size_in_bytes", math.nan) / batch / 2**20,
        "memory_analysis": mem,
        "counted_gflop_per_image": counted["flops"] / 1e9,  # as executed (remat recomputes)
        "conv_mb_per_image": counted["bytes"] / 1e6,
        "loss_first": loss,
        "loss_last": float(loss_now),
        "finite": bool(np.isfinite(float(loss_now))),
        **_common.device_summary(),
    }


# ------------------------------------------------------------------------- torch


def run_torch(spec, *, batch, steps, repeats, smoke) -> dict:
    import numpy as np
    import torch
    import torch.nn.functional as F
    import torch_naisnet as tn

    device = "cuda" if torch.cuda.is_available() else "cpu"
    precision = spec["precision"]
    torch.backends.cudnn.allow_tf32 = precision != "highest"  # PyTorch's default: True
    torch.backends.cuda.matmul.allow_tf32 = precision != "highest"  # PyTorch's default: False
    torch.backends.cudnn.benchmark = True  # pick conv algorithms by timing, as XLA's autotuner does
    torch.manual_seed(0)
    sizes = dict(stage_sizes=(1, 1), filters=(4, 8), steps=2) if smoke else {}
    model = tn.NaisNetConv(**sizes, first_step=bool(spec.get("first_step"))).to(
        device, memory_format=torch.channels_last
    )
    tn.project_state_kernels(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=2e-4)
    rng = np.random.default_rng(0)
    x = torch.tensor(
        (rng.integers(0, 256, (batch, 3, 32, 32)) / 255.0 - 0.5) / 0.25, dtype=torch.float32, device=device
    ).contiguous(memory_format=torch.channels_last)
    y = torch.tensor(rng.integers(0, 10, batch), device=device)
    forward, project, projection_mode = model, tn.project_state_kernels, "eager"
    graphs = spec["mode"] == "reduce-overhead"
    if spec["mode"] in ("compile", "reduce-overhead"):
        forward = torch.compile(model, mode="reduce-overhead" if graphs else None)
        try:  # the projection is idempotent: one extra call changes nothing
            compiled_projection = torch.compile(tn.project_state_kernels)
            compiled_projection(model)
            project, projection_mode = compiled_projection, "compiled"
        except Exception as e:  # keep the model's row; say the projection ran eagerly
            projection_mode = f"eager (torch.compile failed: {str(e).splitlines()[0][:200]})"
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16")

    def step():
        if graphs:  # a new iteration: the graphs may overwrite the previous step's outputs
            torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = F.cross_entropy(forward(x), y)
        loss.backward()
        opt.step()
        project(model)
        return loss

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    loss_first = float(step())  # compiles (torch.compile) and warms cuDNN's algorithm choice
    sync()
    compile_s = time.perf_counter() - t0
    step()
    sync()
    if device == "cuda" and not graphs:  # the graphs' memory pool was allocated while capturing
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        for _ in range(steps):
            loss = step()
        sync()
        times.append(time.perf_counter() - t)
    best = min(times)
    peak = float(torch.cuda.max_memory_allocated()) if device == "cuda" else math.nan
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "kind": "torch",
        "mode": spec["mode"],
        "precision": precision,
        "batch": batch,
        "ms_per_step": 1000 * best / steps,
        "images_per_s": batch * steps / best,
        "compile_s": compile_s,
        "peak_bytes": peak,
        "peak_mib_per_image": (peak - 3 * param_bytes) / batch / 2**20,
        "loss_first": loss_first,
        "loss_last": float(loss),
        "finite": bool(math.isfinite(float(loss))),
        "device_kind": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "platform": device,
        "torch": torch.__version__,
        "projection": projection_mode,
        # graphs the CUDA-graph mode did not capture (their kernels were launched one by one)
        "cudagraph_skips": _cudagraph_skips() if graphs else None,
        "allow_tf32": {"cudnn": torch.backends.cudnn.allow_tf32, "matmul": torch.backends.cuda.matmul.allow_tf32},
        **_common.host_summary(),
    }


def _cudagraph_skips():
    try:
        from torch._dynamo.utils import counters

        return int(counters["inductor"]["cudagraph_skips"])
    except Exception:  # pragma: no cover - the counter's name differs between versions
        return None


# ---------------------------------------------------------------------- summary


def summarise(rows: list[dict]) -> tuple[str, str, dict]:
    ok = [r for r in rows if "error" not in r]
    jax_rows = [r for r in ok if r["kind"] == "jax"]
    kind = next((r["device_kind"] for r in ok if r.get("platform") in ("gpu", "cuda")), None)
    peaks = _common.card_peaks(kind) if kind else None
    # the floor of a model: the step as counted without recomputation (plain or compute-dtype-only rows)
    floors = {}
    for r in jax_rows:
        if set(r.get("kwargs", {})) <= {"dtype", "scan_unroll"}:
            floors.setdefault(r["model"], r["counted_gflop_per_image"])
    floor = floors.get(N10)
    torch_compile = next(
        (r["images_per_s"] for r in ok if r.get("mode") == "compile" and r["precision"] == "tf32"), None
    )
    for r in ok:
        is_bf16 = r.get("precision") == "bf16" or r.get("kwargs", {}).get("dtype") == "bfloat16"
        flops = floors.get(r.get("model", N10)) or r.get("counted_gflop_per_image")
        if peaks and flops:
            rate = flops * 1e9 * r["images_per_s"]
            r["tflops_achieved"] = rate / 1e12
            r["floor_pct_fp32"] = 100 * rate / peaks["fp32"]
            r["floor_pct_tensor"] = 100 * rate / (peaks["bf16"] if is_bf16 else peaks["tf32"])
        if torch_compile:
            r["x_torch_compile"] = r["images_per_s"] / torch_compile
    columns = [
        ("name", "variant", ""),
        ("images_per_s", "images/s", ".0f"),
        ("ms_per_step", "ms/step", ".2f"),
        ("x_torch_compile", "x compile", ".2f"),
        ("tflops_achieved", "TFLOP/s", ".1f"),
        ("floor_pct_fp32", "% fp32 peak", ".0f"),
        ("floor_pct_tensor", "% tensor peak", ".1f"),
        ("peak_mib_per_image", "peak MiB/img", ".2f"),
        ("temp_mib_per_image", "XLA temp MiB/img", ".2f"),
        ("compile_s", "compile s", ".1f"),
    ]
    text, md = _common.table(rows, columns)
    best = max(
        (
            r
            for r in jax_rows
            if r["model"] == N10 and r.get("precision") != "bf16" and r.get("kwargs", {}).get("dtype") != "bfloat16"
        ),
        key=lambda r: r["images_per_s"],
        default=None,
    )
    verdict = {}
    if best and torch_compile:
        ratio = best["images_per_s"] / torch_compile
        verdict = {
            "best_float32_variant": best["name"],
            "ratio_to_torch_compile": ratio,
            "target": 3.0,
            "pass": ratio >= 3.0,
        }
        line = (
            f"target: best float32 NAIS-Net10 ({best['name']}) at {ratio:.2f} x torch.compile "
            f"(>= 3.0): {'PASS' if ratio >= 3.0 else 'FAIL'}"
        )
        text += "\n" + line
        md += "\n\n" + line
        graphs = next((r for r in ok if r.get("mode") == "reduce-overhead" and r["precision"] == "tf32"), None)
        if graphs:
            line = (
                f"for reference: {best['images_per_s'] / graphs['images_per_s']:.2f} x torch.compile replaying "
                f"CUDA graphs (mode='reduce-overhead', {graphs['images_per_s']:.0f} images/s)"
            )
            verdict["ratio_to_torch_compile_cudagraphs"] = best["images_per_s"] / graphs["images_per_s"]
            text += "\n" + line
            md += "\n\n" + line
    host = next((r.get("host_cpu") for r in ok if r.get("host_cpu")), None)
    if host:
        text += f"\nhost: {host}"
        md += f"\n\nhost: {host}"
    head = f"device: {kind or 'unknown'}; batch {ok[0]['batch'] if ok else '?'}"
    if floor:
        head += f"; floor (counted on the plain NAIS-Net10 step): {floor:.2f} GFLOP per image"
    if peaks:
        head += (
            f"; peaks used: fp32 {peaks['fp32'] / 1e12:.0f}, tf32 {peaks['tf32'] / 1e12:.0f}, "
            f"bf16 {peaks['bf16'] / 1e12:.0f} TFLOP/s"
        )
    return head + "\n" + text, head + "\n\n" + md, {"peaks": peaks, "floor_gflop_per_image": floor, **verdict}


def _base(name: str) -> str:
    """The variant a row name runs: ``NAME@2`` (a second process of ``NAME``, ``--order=abba``) is ``NAME``."""
    return name.split("@", 1)[0]


def abba(names: list[str]) -> list[str]:
    """``[A, B]`` -> ``[A, B, B@2, A@2]``: every variant once, then again in reverse order, so that
    each pair's two processes share the call's first and last places."""
    return names + [f"{n}@2" for n in reversed(names)]


def order_means(rows: list[dict]) -> tuple[list[dict], str]:
    """Each variant's ms a step in its first and second process (``--order=abba``) and their mean."""
    by = {}
    for r in rows:
        slot = "ms_second" if r["name"] != _base(r["name"]) else "ms_first"
        by.setdefault(_base(r["name"]), {"ms_first": None, "ms_second": None})
        if "error" not in r:
            by[_base(r["name"])][slot] = r["ms_per_step"]
    means = []
    for n, v in by.items():
        done = [t for t in v.values() if t is not None]
        means.append({"variant": n, **v, "ms_mean": sum(done) / len(done) if done else None})
    lines = ["variant | ms a step, first process | second (order reversed) | mean", "---|---|---|---"]

    def cell(t):
        return "-" if t is None else f"{t:.2f}"

    for m in means:
        lines.append(f"{m['variant']} | {cell(m['ms_first'])} | {cell(m['ms_second'])} | {cell(m['ms_mean'])}")
    return means, "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", default="all", choices=sorted(PRESETS))
    parser.add_argument("--variants", default=None, help="comma-separated names (overrides --preset)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed chunk")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300, help="seconds per variant (torch.compile: 2x)")
    parser.add_argument("--smoke", action="store_true", help="tiny models, batch 4: a CPU check")
    parser.add_argument(
        "--budget", type=float, default=540, help="seconds for the whole run (a rerun resumes); 0: no limit"
    )
    parser.add_argument("--fresh", action="store_true", help="rerun variants already done")
    parser.add_argument(
        "--order",
        default="listed",
        choices=("listed", "abba"),
        help="abba: run the variants, then again in reverse order (rows NAME@2), and print each one's "
        "mean over its two processes (on an H100 the first process of a call has run ~0.36 ms "
        "a step slower than the same code later)",
    )
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch, args.steps, args.repeats = min(args.batch, 4), min(args.steps, 2), 1
    _common.importable()
    os.makedirs(args.out, exist_ok=True)
    if args.one:
        spec = VARIANTS[_base(args.one)]
        run = run_torch if spec.get("kind") == "torch" else run_jax
        row = run(spec, batch=args.batch, steps=args.steps, repeats=args.repeats, smoke=args.smoke)
        _common.write_row(args.out, args.one, row)
        return
    names = args.variants.split(",") if args.variants else PRESETS[args.preset]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; valid: {', '.join(VARIANTS)}")
    torch_rows = [n for n in names if VARIANTS[n].get("kind") == "torch"]
    if torch_rows and importlib.util.find_spec("torch") is None:  # not among the package's dependencies
        print(f"PyTorch is not installed here: {', '.join(torch_rows)} skipped (pip install torch to time them).")
        names = [n for n in names if n not in torch_rows]
    if args.order == "abba":
        names = abba(names)
    child = [f"--batch={args.batch}", f"--steps={args.steps}", f"--repeats={args.repeats}"]
    child += ["--smoke"] if args.smoke else []
    rows = _common.run_variants(
        os.path.abspath(__file__),
        names,
        args.out,
        budget=args.budget or None,
        child_args=child,
        fresh=args.fresh,
        env_for=lambda n: {"XLA_FLAGS": VARIANTS[_base(n)]["xla_flags"]} if VARIANTS[_base(n)].get("xla_flags") else {},
        timeout_for=lambda n: args.timeout * (2 if VARIANTS[_base(n)].get("mode") == "compile" else 1),
    )
    text, md, summary = summarise(rows)
    if args.order == "abba":
        means, table = order_means(rows)
        summary["abba_means"] = means
        text += "\n\n" + table
        md += "\n\n" + table
    _common.write_results(args.out, "train_step", {"rows": rows, "summary": summary}, md)
    ok = [r for r in rows if "error" not in r]
    compiled_torch = next(
        (r["images_per_s"] for r in ok if r.get("mode") == "compile" and r["precision"] == "tf32"), None
    )
    if ok:
        _common.bar_chart(
            os.path.join(args.out, "train_step.png"),
            [r["name"] for r in ok],
            [r["images_per_s"] for r in ok],
            xlabel=f"images/s (batch {args.batch})",
            title="Training step",
            reference=3 * compiled_torch if compiled_torch else None,
            reference_label="3 x torch.compile (target)",
        )
    print()
    print(text)


if __name__ == "__main__":
    main()
