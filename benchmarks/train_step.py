"""Benchmark: the training step of the CIFAR-shaped nets, side by side in one run.

Images/s, peak memory per image and compile time of one training step (forward,
backward, SGD with momentum and weight decay, Algorithm 2 projection: exactly
``naisnet_jax.train.train_step``) at batch 128 on 32x32x3 inputs, for NAIS-Net10,
NAIS-Net1 and the CIFAR ResNet in float32 and with bfloat16 compute; variants of
NAIS-Net10 (``scan_unroll``, the stacked custom VJP, rematerialisation, XLA flag
sets); and the same NAIS-Net10 in PyTorch eager and ``torch.compile``
(``benchmarks/torch_naisnet.py``; the target's yardstick is ``torch.compile``'s default
mode, and a reference row replays its CUDA graphs, ``mode="reduce-overhead"``). Each
variant runs in its own process (fresh allocator statistics, its own ``XLA_FLAGS``).
Timed: ``--steps`` steps in one jitted ``lax.scan`` on a fixed random batch, best of
``--repeats``.

The floor: FLOPs of forward + backward per image, counted on the jaxpr of the
plain NAIS-Net10 step (convolutions and matrix products; ``lax.scan`` bodies times
their length), against the card's peak float32 (CUDA cores), TF32 and bfloat16
tensor-core rates; ``floor %`` is the floor's time over the measured time.

Precision: JAX's default on GPU computes float32 convolutions with TF32; the PyTorch
rows set ``torch.backends.cudnn.allow_tf32 = True`` (its default) and
``torch.backends.cuda.matmul.allow_tf32 = True`` (its default is False) to match.
The ``*_highest`` rows turn TF32 off on both sides.

    python benchmarks/train_step.py --out=runs/bench/train_step             # all variants
    python benchmarks/train_step.py --out=... --preset=quick                 # 9 of them
    python benchmarks/train_step.py --out=/tmp/smoke --smoke                 # tiny, on CPU

Rerunning with the same ``--out`` resumes: finished variants are read back.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

CMDBUF_WHILE = (
    "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUDNN,CUSTOM_CALL,"
    "CONDITIONAL,WHILE --xla_gpu_graph_min_graph_size=1"
)
N10 = "naisnet_cifar10"


def fused10(**spec) -> dict:
    """A variant of NAIS-Net10 on the fast path (``block_vjp="fused", scan_unroll=10``) with ``spec``."""
    return dict(model=N10, kwargs=dict(block_vjp="fused", scan_unroll=10), **spec)


# name -> spec. kind "jax": model name, model kwargs, precision, XLA flags;
# kind "torch": mode (eager | compile | reduce-overhead) and precision (tf32 | highest | bf16).
VARIANTS = {
    "nais10": dict(model=N10),
    "nais10_unroll2": dict(model=N10, kwargs=dict(scan_unroll=2)),
    "nais10_unroll5": dict(model=N10, kwargs=dict(scan_unroll=5)),
    "nais10_unroll10": dict(model=N10, kwargs=dict(scan_unroll=10)),
    "nais10_stacked": dict(model=N10, kwargs=dict(block_vjp="stacked")),
    "nais10_stacked_unroll10": dict(model=N10, kwargs=dict(block_vjp="stacked", scan_unroll=10)),
    "nais10_stacked_recompute": dict(model=N10, kwargs=dict(block_vjp="stacked_recompute")),
    "nais10_remat_block": dict(model=N10, kwargs=dict(remat="block")),
    "nais10_remat_step": dict(model=N10, kwargs=dict(remat="step")),
    "nais10_highest": dict(model=N10, precision="highest"),
    "nais10_xla_cmdbuf_while": dict(model=N10, xla_flags=CMDBUF_WHILE),
    "nais10_xla_cmdbuf_off": dict(model=N10, xla_flags="--xla_gpu_enable_command_buffer="),
    "nais10_xla_autotune0": dict(model=N10, xla_flags="--xla_gpu_autotune_level=0"),
    "nais10_xla_runtime_fusion": dict(model=N10, xla_flags="--xla_gpu_use_runtime_fusion=true"),
    "nais10_xla_double_buffer": dict(
        model=N10, xla_flags="--xla_gpu_enable_while_loop_unrolling=WHILE_LOOP_UNROLLING_DOUBLE_BUFFER"
    ),
    "nais10_unroll10_cmdbuf_while": dict(model=N10, kwargs=dict(scan_unroll=10), xla_flags=CMDBUF_WHILE),
    "nais10_xla_cmdbuf_unroll_loops": dict(  # WHILE commands lowered to unrolled CUDA graphs (newer XLA)
        model=N10, xla_flags=CMDBUF_WHILE + " --xla_gpu_command_buffer_unroll_loops=true"
    ),
    "nais10_fused": dict(model=N10, kwargs=dict(block_vjp="fused")),
    "nais10_fused_unroll10": fused10(),
    "nais10_fused_unroll10_triton": fused10(engine="triton"),
    # the wgmma blocks on hopper_block's three bfloat16 products (about 16 significant bits; the
    # default before session 29), not hopper_tf32's TF32 products with the windows as views
    "nais10_fused_unroll10_bf16x3": fused10(wgmma_tf32=False),
    # the 64-channel blocks on the stacked VJP (cuDNN), as before session 30, not on hopper_tf32's
    # kernels with their kernel gradients by XLA (fused_block.WGMMA_WIDE)
    "nais10_fused_unroll10_c64_xla": fused10(wgmma_wide=False),
    # the 64-channel blocks' kernel gradients (XLA's, cuDNN) on the second stream
    "nais10_fused_unroll10_c64_wgrad_side": fused10(wide_wgrad_side=True),
    # the weight gradient on wgmma too (prototype, benchmarks/wgmma_wgrad.py; Hopper only)
    "nais10_fused_unroll10_wgmma_wgrad": fused10(wgrad="wgmma"),
    # the 64-channel blocks on wgmma too (prototype, benchmarks/wgmma_block64.py; Hopper only)
    "nais10_fused_unroll10_wgmma_c64": fused10(c64="wgmma"),
    # the 64-channel blocks as one Triton kernel a step (prototype, benchmarks/step_kernels64.py)
    "nais10_fused_unroll10_c64_steps": fused10(c64="steps"),
    # XLA's scheduler for the second stream's work: more async computations in flight, and its
    # analytical cost model. No gain in session 26 (H200): 25.88 and 25.83 ms, where the same code
    # without them ran 25.85 in another call; both as the step's compiler options, 25.95 against
    # 25.85 side by side
    "nais10_fused_unroll10_async32": fused10(
        xla_flags="--xla_gpu_experimental_parallel_async_compute_limit=32",
    ),
    "nais10_fused_unroll10_lhs_analytical": fused10(
        xla_flags="--xla_gpu_enable_analytical_latency_estimator=true",
    ),
    # no XLA command buffers (CUDA graphs): each kernel launched on its own. Session 26's profile:
    # the main stream waited ~6 us before each of the 64-channel stage's cuDNN convolutions,
    # launched between command buffers, mostly with the launch already issued
    "nais10_fused_unroll10_cmdbuf_off": fused10(xla_flags="--xla_gpu_enable_command_buffer="),
    # the 64-channel blocks' stacked weight gradients on the main stream (the drives' stay on the
    # second): in session 26's trace cuDNN's kernel for them takes 226 KB of shared memory a
    # program on 126 programs, the whole of each SM's, so the main stream's kernels cannot run
    # beside it anyway, and the main stream waited 0.72 ms for them at the end of the step
    "nais10_fused_unroll10_stacked_wgrad_main": fused10(stacked_wgrad="main"),
    # the stacked VJP's stacks of x_k and s_k written in place, not concatenated (prototype,
    # benchmarks/stacks_in_place.py)
    "nais10_fused_unroll10_stacks_in_place": fused10(stacks="in_place"),
    "nais10_fused_unroll10_stacks_in_place_fwd": fused10(stacks="in_place_forward"),  # the x_k's only
    "nais10_fused_unroll10_stacks_in_place_bwd": fused10(stacks="in_place_backward"),  # the s_k's only
    # the weight-gradient kernels masking every window, as before session 26 (not the edge tiles' only)
    "nais10_fused_unroll10_wgrad_masks": fused10(wgrad_masks="all"),
    "nais10_fused_unroll10_wgmma_all": fused10(wgrad="wgmma", c64="wgmma"),
    "nais10_fused_unroll10_relu_z": fused10(relu_sign=False),
    # the wgmma forward saves ReLU's sign in int8, not bfloat16 (half the bytes again; the default
    # since session 28), and the old bfloat16
    "nais10_fused_unroll10_mask_i8": fused10(mask_dtype="int8"),
    "nais10_fused_unroll10_mask_bf16": fused10(mask_dtype="bfloat16"),
    # the weight-gradient kernels' partial sums added up as a float32 matrix-vector product
    # (ones @ parts, cuBLAS), not XLA's column reduction
    "nais10_fused_unroll10_parts_gemv": fused10(parts_sum="gemv"),
    # with XLA's cuDNN convolution fusions (train.CONV_FUSION)
    "nais10_fused_unroll10_conv_fusion": fused10(conv_fusion=True),
    # every block's K steps from x_0 = 0, as before session 24 (not from x_1 = h act(drive))
    "nais10_fused_unroll10_from_zero": fused10(first_step=False),
    # the drive convolutions' kernel gradients by the fused weight-gradient kernel, as in sessions
    # 24 to 29 (not cuDNN's on the second stream: fused_block.DRIVE_WGRAD_KERNEL)
    "nais10_fused_unroll10_drive_wgrad_kernel": fused10(drive_wgrad="kernel"),
    # the weight-gradient kernel's chunks and stages from benchmarks/wgrad_tiling.py --best=FILE
    # (read from the environment's WGRAD_BEST=FILE)
    "nais10_fused_unroll10_wgrad_best": fused10(wgrad_tiling="WGRAD_BEST"),
    # the drive's gradient as XLA's sum over the saved s_k beside the per-step weight-gradient kernel
    # on the second stream, as before session 25 (not summed by the weight-gradient kernel)
    "nais10_fused_unroll10_wgrad_per_step": fused10(wgrad_sums_steps=False),
    "nais10_fused_unroll10_one_stream": fused10(side_stream=False),
    # cuDNN's convolutions captured into XLA's command buffers (CUDA graphs) with the fusions around them
    "nais10_fused_unroll10_conv_cmdbuf": fused10(
        xla_flags="--xla_gpu_enable_command_buffer=+CONVOLUTION",
    ),
    # XLA's command buffers scheduled as a DAG of their buffers' dependencies (independent kernels
    # run concurrently), not in the latency-hiding scheduler's order (LHS, the default); with and
    # without cuDNN's convolutions captured
    "nais10_fused_unroll10_cmdbuf_concurrent": fused10(
        xla_flags="--xla_gpu_command_buffer_scheduling_mode=CONCURRENT",
    ),
    "nais10_fused_unroll10_conv_cmdbuf_concurrent": fused10(
        xla_flags="--xla_gpu_enable_command_buffer=+CONVOLUTION --xla_gpu_command_buffer_scheduling_mode=CONCURRENT",
    ),
    "nais10_fused_unroll10_nhwc": fused10(xla_flags="--xla_gpu_force_conv_nhwc"),
    "nais10_bf16": dict(model=N10, kwargs=dict(dtype="bfloat16")),
    "nais10_bf16_stacked_unroll10": dict(model=N10, kwargs=dict(dtype="bfloat16", block_vjp="stacked", scan_unroll=10)),
    "nais1": dict(model="naisnet_cifar1"),
    "nais1_fused": dict(model="naisnet_cifar1", kwargs=dict(block_vjp="fused")),
    "nais1_bf16": dict(model="naisnet_cifar1", kwargs=dict(dtype="bfloat16")),
    "resnet": dict(model="resnet_cifar"),
    "resnet_bf16": dict(model="resnet_cifar", kwargs=dict(dtype="bfloat16")),
    "torch_eager": dict(kind="torch", mode="eager", precision="tf32"),
    "torch_compile": dict(kind="torch", mode="compile", precision="tf32"),
    # the same shortcut as our fast paths: each block from x_1 = h relu(drive), K - 1 steps
    "torch_compile_first_step": dict(kind="torch", mode="compile", precision="tf32", first_step=True),
    # for reference: torch.compile replaying CUDA graphs (mode="reduce-overhead"), no launch cost
    "torch_compile_cudagraphs": dict(kind="torch", mode="reduce-overhead", precision="tf32"),
    "torch_eager_bf16": dict(kind="torch", mode="eager", precision="bf16"),
    "torch_compile_bf16": dict(kind="torch", mode="compile", precision="bf16"),
    "torch_eager_highest": dict(kind="torch", mode="eager", precision="highest"),
}
PRESETS = {
    "all": list(VARIANTS),
    "fused": ["nais10_stacked_unroll10", "nais10_fused_unroll10", "torch_compile", "torch_compile_cudagraphs"],
    # the table: the three nets in float32 and bfloat16 beside PyTorch eager and compiled
    "issue": [
        "nais10_fused_unroll10",
        "nais10_bf16_stacked_unroll10",
        "nais1_fused",
        "nais1_bf16",
        "resnet",
        "resnet_bf16",
        "torch_eager",
        "torch_compile",
        "torch_compile_bf16",
        "torch_compile_cudagraphs",
    ],
    "quick": [
        "nais10",
        "nais10_unroll10",
        "nais10_stacked",
        "nais10_stacked_unroll10",
        "nais10_bf16",
        "nais1",
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


def _model_and_state(spec, smoke):
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


def _batch(batch, seed=0):
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
    config = config.copy_and_resolve_references()
    config.model_kwargs.block_vjp = "stacked"
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

    return jax.jit(chunk, donate_argnums=(0,), compiler_options=train.step_compiler_options())


def apply_spec(spec) -> None:
    """The spec's switches that patch the package before its model is built: the fused conv
    blocks' engine, the prototype kernels, the weight gradients' second stream."""
    if spec.get("engine"):  # the fused conv blocks' GPU kernels: "wgmma" or "triton" (default: by card)
        from naisnet_jax import fused_block, models

        models.unroll_tied_conv = functools.partial(fused_block.unroll_tied_conv, engine=spec["engine"])
    if spec.get("wgrad") == "wgmma":  # the prototype weight-gradient kernel of benchmarks/wgmma_wgrad.py
        import wgmma_wgrad

        wgmma_wgrad.patch_fused_block()
    if spec.get("c64") == "wgmma":  # the prototype 64-channel block kernels of benchmarks/wgmma_block64.py
        import wgmma_block64

        wgmma_block64.patch_models()
    if spec.get("c64") == "steps":  # the 64-channel blocks as one Triton kernel a step
        import step_kernels64

        step_kernels64.patch_models()
    if spec.get("wgmma_tf32") is False:  # the wgmma blocks in bfloat16 x 3 (hopper_block), not TF32
        from naisnet_jax import fused_block

        fused_block.WGMMA_TF32 = False
    if spec.get("wgmma_wide") is False:  # the 64-channel blocks on the stacked VJP, not the TF32 wgmma kernels
        from naisnet_jax import fused_block

        fused_block.WGMMA_WIDE = False
    if spec.get("wide_wgrad_side"):  # the 64-channel blocks' kernel gradients on the second stream
        from naisnet_jax import fused_block

        fused_block.WIDE_WGRAD_SIDE = True
    if spec.get("relu_sign") is False:  # the wgmma forward saves ReLU's z_k in float32, not its sign
        from naisnet_jax import hopper_block

        hopper_block.SAVE_RELU_SIGN = False
    if spec.get("mask_dtype"):  # the dtype the wgmma forward saves ReLU's sign in
        import jax.numpy as jnp

        from naisnet_jax import hopper_block

        hopper_block.MASK_DTYPE = jnp.dtype(spec["mask_dtype"])
    if spec.get("stacked_wgrad") == "main":  # block_vjp's calls that leave the stream to it: main
        from naisnet_jax import block_vjp

        side = block_vjp.on_side_stream
        block_vjp.on_side_stream = lambda f, enabled=None: side(f, False if enabled is None else enabled)
    if spec.get("stacks", "").startswith("in_place"):  # the stacked VJP's stacks written in place
        import stacks_in_place

        which = spec["stacks"]
        stacks_in_place.patch(forward=which != "in_place_backward", backward=which != "in_place_forward")
    if spec.get("wgrad_masks") == "all":  # every tile of the weight-gradient kernels masked
        from naisnet_jax import fused_block

        fused_block._edge_split = lambda layout, offsets, rows, first, count: (count, count)
    if spec.get("conv_fusion"):  # the step compiled with XLA's cuDNN convolution fusions
        from naisnet_jax import train

        train.GPU_STEP_OPTIONS = train.CONV_FUSION
    if spec.get("first_step") is False:  # tied blocks run K steps from x_0 = 0, not K - 1 from x_1
        from naisnet_jax import models

        models._from_first_step = lambda tied_run, drive, h, activation, steps: functools.partial(tied_run, steps=steps)
    if spec.get("drive_wgrad"):  # drive kernel gradients by XLA (cuDNN) or the fused kernel
        from naisnet_jax import fused_block

        fused_block.DRIVE_WGRAD_KERNEL = spec["drive_wgrad"] == "kernel"
    if spec.get("wgrad_tiling"):  # the weight-gradient kernel's knobs from wgrad_tiling.py's JSON
        import json

        import wgrad_tiling

        path = os.environ.get(spec["wgrad_tiling"])
        if not path:
            raise ValueError(
                f"this variant reads the weight-gradient setting from ${spec['wgrad_tiling']}: set it to the "
                "file that benchmarks/wgrad_tiling.py --best=FILE wrote"
            )
        with open(path) as f:
            wgrad_tiling.apply(json.load(f))
    if spec.get("parts_sum") == "gemv":  # the partial sums as ones @ parts at float32 precision
        import jax
        import jax.numpy as jnp

        from naisnet_jax import fused_block

        library = fused_block._kernel_of_parts

        def kernel_of_parts(parts, kernel_shape):  # the sum as a product, the rest the library's
            flat = parts.reshape(parts.shape[0], -1)
            total = jnp.dot(jnp.ones((flat.shape[0],), flat.dtype), flat, precision=jax.lax.Precision.HIGHEST)
            return library(total.reshape((1,) + parts.shape[1:]), kernel_shape)

        fused_block._kernel_of_parts = kernel_of_parts
    if spec.get("wgrad_sums_steps") is False:  # the drive's gradient by XLA, the kernel per step
        from naisnet_jax import fused_block

        fused_block.WGRAD_SUMS_STEPS = False
    if spec.get("side_stream") is False:  # every weight gradient on the main stream
        from naisnet_jax import block_vjp

        block_vjp.SIDE_STREAM = False


def run_jax(spec, *, batch, steps, repeats, smoke) -> dict:
    import jax
    import numpy as np

    if spec.get("precision"):
        jax.config.update("jax_default_matmul_precision", spec["precision"])
    apply_spec(spec)
    config, model, state = _model_and_state(spec, smoke)
    x, y = _batch(batch)
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
        "mean over its two processes (on an H100 in session 28 the first process of a call ran ~0.36 ms "
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
