"""Benchmark: where the time of one NAIS-Net training step goes, kernel by kernel.

Runs a variant of ``train_step.py`` (the same model, batch and jitted chunk of steps)
under ``jax.profiler.trace`` with a Perfetto trace, reads the trace's device events
back and prints, per training step: the time in each group of kernels (the fused
block kernels, cuDNN/cuBLAS convolutions and matrix products, XLA's own fusions,
copies) and the kernels that take the most time, with their count per step. The sum of
their times is the step's device time: on one stream the kernels run one after another,
and the gap to the wall-clock step is host and launch overhead; on a GPU the weight
gradients run on a second stream (``naisnet_jax.kernels.on_side_stream``), so where they overlap
the main stream the device time exceeds the wall.

    python benchmarks/profile_step.py --out=runs/bench/profile --variant=nais10_fused_unroll10
    python benchmarks/profile_step.py --out=/tmp/smoke --smoke      # CPU, tiny: the trace's CPU ops

The kernels are also counted by duration (under 2, 4, 8, 16, 50 us and longer), with the names
that take the most time in launches under 4 us: a step of ~2,000 kernels spends ~2 ms in ~1,000
such launches (an H100 profile), each costing more than its work. The host's side is summarised too:
each host thread's busy time and the host events that take the longest. Where the trace ties
the main stream's kernels to their launch calls (CUDA correlation ids), each gap before a kernel
is attributed either to the host, if it made the call only after the stream had run dry, or to
the device (a wait on the other stream or an event). Under the profiler the host is slower than
without it: on an H100 the gaps it blamed on the host did not lengthen the unprofiled step.
``--keep-trace`` copies the Perfetto trace next to the results. ``--fusions`` also dumps XLA's
optimised program and names the step's largest XLA fusions (loops, reductions, transposes,
copies: not the library's kernels or cuDNN's), each with its output shape, the JAX operation it
came from and the first lines of its fused computation (``fusions_<variant>.md``).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

# kernel name -> group, first match wins
GROUPS = [
    ("fused block kernel (Pallas)", r"forward_kernel|backward_kernel|weight_grad_kernel|mosaic_gpu_kernel"),
    ("convolution (cuDNN on GPU)", r"cudnn|xmma|implicit_?gemm|fprop|dgrad|wgrad|conv|sm\d+_.*(nhwc|nchw)"),
    ("matrix product (cuBLAS/Triton GEMM)", r"gemm|cutlass|cublas|triton_(softmax|gemm)|__triton_gemm"),
    ("copy / transpose", r"memcpy|memset|copy|transpose"),
    ("reduction fusion", r"reduce|reduction"),
    ("other XLA fusion", r"fusion|loop_|input_|wrapped_|triton"),
]


def group_of(name: str) -> str:
    low = name.lower()
    for label, pattern in GROUPS:
        if re.search(pattern, low):
            return label
    return "other"


def read_trace(log_dir: str) -> dict:
    paths = sorted(glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True))
    if not paths:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {log_dir}")
    with gzip.open(paths[-1], "rt") as f:
        return json.load(f)


def _names(trace: dict) -> tuple[list[dict], dict, dict]:
    """The trace's events, its process names by pid and its thread names by ``(pid, tid)``."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    pnames, tnames = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            pnames[e["pid"]] = e.get("args", {}).get("name", "")
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            tnames[(e["pid"], e.get("tid"))] = e.get("args", {}).get("name", "")
    return events, pnames, tnames


def device_events(trace: dict) -> tuple[list[dict], dict]:
    """Complete events on the device's kernel tracks (not its per-op summary tracks)."""
    events, pnames, tnames = _names(trace)
    gpu_pids = {p for p, n in pnames.items() if re.search(r"/device:(GPU|TPU)", n)}
    # on a CPU (the smoke run) XLA's work runs on the host's "tf_XLA..." threads
    on_host = not gpu_pids
    pids = gpu_pids or {p for p, n in pnames.items() if "/host:CPU" in n}
    tracks = collections.Counter()
    picked = []
    for e in events:
        if e.get("ph") != "X" or e["pid"] not in pids:
            continue
        track = tnames.get((e["pid"], e.get("tid")), str(e.get("tid")))
        if on_host and (not track.startswith("tf_XLA") or re.match(r"ThunkExecutor|while|call", e.get("name", ""))):
            continue  # the host's wrappers around the ops
        tracks[track] += 1
        e["_track"] = track
        # XLA's "XLA Ops" / "XLA Modules" / "Steps" tracks summarise the stream tracks
        if re.search(r"xla ops|xla modules|steps|framework|source", track.lower()):
            continue
        picked.append(e)
    info = {"processes": sorted(pnames.values()), "device_tracks": dict(tracks)}
    return picked, info


def scope_of(event: dict) -> str:
    """``stage<i> forward|backward`` from the op's name scope (XLA's ``name`` arg), where given."""
    name = event.get("args", {}).get("name", "")
    if not name:
        return "no scope (inside a command buffer)"
    m = re.search(r"(stage\d+)_block\d+", name)
    where = m.group(1) if m else "outside the blocks"
    return f"{where} {'backward' if 'transpose(' in name else 'forward'}"


def summarise(events: list[dict], steps: int, top: int = 25) -> dict:
    by_name = collections.defaultdict(lambda: [0, 0.0])
    example = {}  # kernel name -> the args of its longest launch (XLA's op names, where given)
    by_group = collections.defaultdict(lambda: [0, 0.0])
    by_scope = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        name = e.get("name", "?")
        dur = float(e.get("dur", 0.0))  # microseconds
        by_name[name][0] += 1
        by_name[name][1] += dur
        if dur >= example.get(name, (-1.0, None))[0]:
            example[name] = (dur, e.get("args", {}))
        g = by_group[group_of(name)]
        g[0] += 1
        g[1] += dur
        sc = by_scope[(scope_of(e), group_of(name))]
        sc[0] += 1
        sc[1] += dur
    total = sum(v[1] for v in by_group.values())
    groups = [
        {"group": k, "per_step": v[0] / steps, "ms_per_step": v[1] / steps / 1e3, "share": v[1] / max(total, 1e-9)}
        for k, v in sorted(by_group.items(), key=lambda kv: -kv[1][1])
    ]
    kernels = [
        {
            "kernel": k,
            "group": group_of(k),
            "per_step": v[0] / steps,
            "ms_per_step": v[1] / steps / 1e3,
            "mean_us": v[1] / v[0],
            "share": v[1] / max(total, 1e-9),
            "longest_args": example[k][1],
        }
        for k, v in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    ]
    scopes = [
        {"scope": k[0], "group": k[1], "per_step": v[0] / steps, "ms_per_step": v[1] / steps / 1e3}
        for k, v in sorted(by_scope.items())
    ]
    return {
        "device_ms_per_step": total / steps / 1e3,
        "launches_per_step": len(events) / steps,
        "groups": groups,
        "scopes": scopes,
        "kernels": kernels,
        **durations(events, steps),
    }


#: Upper edges (us) of the kernel-duration classes :func:`durations` counts.
DURATION_EDGES = (2.0, 4.0, 8.0, 16.0, 50.0, float("inf"))
#: Kernels shorter than this (us) are "small" in :func:`durations`' list.
SMALL_US = 4.0


def durations(events: list[dict], steps: int, top: int = 15) -> dict:
    """The kernels by duration: how many a step and their ms a step in each class of
    :data:`DURATION_EDGES`, and the ``top`` names with the most time in kernels shorter than
    :data:`SMALL_US` (many small launches cost more than their work)."""
    classes = [[0, 0.0] for _ in DURATION_EDGES]
    small = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        dur = float(e.get("dur", 0.0))
        i = next(i for i, edge in enumerate(DURATION_EDGES) if dur < edge)
        classes[i][0] += 1
        classes[i][1] += dur
        if dur < SMALL_US:
            small[e.get("name", "?")][0] += 1
            small[e.get("name", "?")][1] += dur
    lows = (0.0,) + DURATION_EDGES[:-1]
    rows = [
        {
            "durations": f"{lo:g} to {hi:g} us" if hi != float("inf") else f">= {lo:g} us",
            "per_step": n / steps,
            "ms_per_step": t / steps / 1e3,
        }
        for lo, hi, (n, t) in zip(lows, DURATION_EDGES, classes)
    ]
    smallest = [
        {"kernel": k, "per_step": v[0] / steps, "ms_per_step": v[1] / steps / 1e3}
        for k, v in sorted(small.items(), key=lambda kv: -kv[1][1])[:top]
    ]
    return {"durations": rows, "small_kernels": smallest}


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(x, y) -> float:
    """Total length of the intersection of two sorted disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, b - a)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def streams(events: list[dict], steps: int, launches: dict | None = None, top: int = 12) -> dict:
    """The streams' timeline: each stream's busy time a step (the union of its kernels), the
    time both the main stream (the busiest) and another run, the main stream's idle time between
    its first and last kernel, and which kernels the main stream waited longest before (the
    gap before each launch, summed by kernel name: a wait on the other stream or the host).

    ``launches`` (the host's launch calls by CUDA correlation id, :func:`host_events`): for every
    gap before a kernel whose call it holds, whether the host made that call only after the
    stream had run dry (the gap is the host's) or before (the kernel waited on the device: the
    other stream, an event); ``late_launches`` is ``None`` where no gap matches a call."""
    by_track = collections.defaultdict(list)
    for e in events:
        t0 = float(e.get("ts", 0.0))
        row = (t0, t0 + float(e.get("dur", 0.0)), e.get("name", "?"), _correlation(e))
        by_track[e.get("_track", "?")].append(row)
    if not by_track:
        return {}
    busy = {t: _union([(a, b) for a, b, *_ in v]) for t, v in by_track.items()}
    main = max(busy, key=lambda t: _length(busy[t]))
    others = _union([iv for t, v in busy.items() if t != main for iv in v])
    span_a = min(a for v in busy.values() for a, _ in v)
    span_b = max(b for v in busy.values() for _, b in v)
    timeline = sorted(by_track[main], key=lambda r: r[:3])  # by start, end, name, as before
    waits = collections.defaultdict(lambda: [0, 0.0])
    late = {"matched": 0, "late": 0, "late_us": 0.0, "device_us": 0.0}
    end = timeline[0][1]
    for a, b, name, cid in timeline[1:]:
        if a > end:
            waits[name][0] += 1
            waits[name][1] += a - end
            if launches and cid in launches:
                late["matched"] += 1
                if launches[cid][0] >= end:  # the call began after the stream had run dry
                    late["late"] += 1
                    late["late_us"] += a - end
                else:
                    late["device_us"] += a - end
        end = max(end, b)
    main_busy = _length(busy[main])
    late_launches = None
    if late["matched"]:
        late_launches = {
            "gaps_matched_per_step": late["matched"] / steps,
            "host_late_per_step": late["late"] / steps,
            "host_late_ms_per_step": late["late_us"] / steps / 1e3,
            "device_wait_ms_per_step": late["device_us"] / steps / 1e3,
        }
    return {
        "late_launches": late_launches,
        "main_stream": main,
        "span_ms_per_step": (span_b - span_a) / steps / 1e3,
        "busy_ms_per_step": {t: _length(v) / steps / 1e3 for t, v in busy.items()},
        "main_idle_ms_per_step": ((span_b - span_a) - main_busy) / steps / 1e3,
        "overlap_ms_per_step": _intersect(busy[main], others) / steps / 1e3,
        "other_streams_ms_per_step": _length(others) / steps / 1e3,
        "main_waits": [
            {"kernel": k, "gaps_per_step": v[0] / steps, "ms_per_step": v[1] / steps / 1e3}
            for k, v in sorted(waits.items(), key=lambda kv: -kv[1][1])[:top]
        ],
    }


def _correlation(event: dict):
    """The CUDA correlation id an event carries in its args (a launch on the host, a kernel on the
    device), or ``None``."""
    for key, value in event.get("args", {}).items():
        if "correlation" in key.lower():
            try:
                return int(value)
            except (TypeError, ValueError):
                return None
    return None


def host_events(trace: dict, steps: int, top: int = 15) -> dict:
    """The host's side of the trace: per thread, its busy time a step; the host events that take
    the most time (count and ms a step; nested events each count, so times overlap); and the CUDA
    launch calls by their correlation ids (``launches``: id -> (start, end), microseconds)."""
    events, pnames, tnames = _names(trace)
    host = {p for p, n in pnames.items() if "/host:CPU" in n}
    by_name = collections.defaultdict(lambda: [0, 0.0])
    by_thread = collections.defaultdict(list)
    launches = {}
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in host:
            continue
        t0, dur = float(e.get("ts", 0.0)), float(e.get("dur", 0.0))
        name = e.get("name", "?")
        by_name[name][0] += 1
        by_name[name][1] += dur
        by_thread[tnames.get((e["pid"], e.get("tid")), str(e.get("tid")))].append((t0, t0 + dur))
        cid = _correlation(e)
        if cid is not None:
            launches[cid] = (t0, t0 + dur)
    threads = sorted(
        ({"thread": t, "busy_ms_per_step": _length(_union(v)) / steps / 1e3} for t, v in by_thread.items()),
        key=lambda r: -r["busy_ms_per_step"],
    )
    calls = [
        {"event": k, "per_step": v[0] / steps, "ms_per_step": v[1] / steps / 1e3, "mean_us": v[1] / v[0]}
        for k, v in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    ]
    return {"threads": threads[:top], "calls": calls, "launches": launches}


def fusion_table(events: list[dict], steps: int, dump_dir: str, top: int = 40, lines: int = 12) -> str:
    """Markdown: the ``top`` XLA fusions of ``events`` by time a step, each matched by name to its
    instruction in XLA's optimised program under ``dump_dir`` (the largest ``*after_optimizations``
    text there: the step's module): output shape, the JAX op it came from, and the first ``lines``
    instructions of its fused computation. The trace writes ``loop_add_fusion_3`` for the
    program's ``loop_add_fusion.3``."""
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if re.match(r"(loop|input|wrapped)_", e["name"]):
            v = by_name[e["name"]]
            v[0] += 1
            v[1] += e["dur"]
    dumps = glob.glob(os.path.join(dump_dir, "*after_optimizations.txt"))
    text = max((open(f).read() for f in dumps), key=len, default="")
    defs = {}
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (.*) fusion\(", line)
        if m:
            defs.setdefault(m.group(1), line.strip())
    out = [
        f"XLA's fusions by time a step ({len(by_name)} kinds; the top {top})",
        "",
        "| fusion | ms/step | per step | mean us | output | from |",
        "|---|---|---|---|---|---|",
    ]
    bodies = []
    for name, (count, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]:
        line = defs.get(re.sub(r"_(\d+)$", r".\1", name), defs.get(name, ""))
        shape = line.split(" = ", 1)[1].split(" fusion(")[0] if line else "?"
        op = re.search(r'op_name="([^"]*)"', line)
        op = re.sub(r"^jit\(chunk\)/while/body/eval_jaxpr/", "", op.group(1)) if op else "?"
        out.append(f"| `{name}` | {us / steps / 1e3:.3f} | {count / steps:g} | {us / count:.1f} | `{shape}` | `{op}` |")
        calls = re.search(r"calls=%?([\w.\-]+)", line)
        m = calls and re.search(r"\n%?" + re.escape(calls.group(1)) + r" [^\n]*\{\n(.*?)\n\}", text, re.S)
        if m:
            body = [re.sub(r", metadata=\{.*", "", b.strip()) for b in m.group(1).splitlines()[:lines]]
            bodies += ["", f"`{name}`:", "", "```", *body, "```"]
    return "\n".join(out + bodies) + "\n"


def profile(variant: str, *, batch: int, steps: int, smoke: bool, log_dir: str) -> dict:
    import jax
    import train_step as ts

    spec = ts.VARIANTS[variant]
    if spec.get("kind") == "torch":
        raise SystemExit(f"--variant={variant} is a PyTorch row; profile a JAX variant")
    if spec.get("precision"):
        jax.config.update("jax_default_matmul_precision", spec["precision"])
    _, _, state = ts.model_and_state(spec, smoke)
    x, y = ts.fixed_batch(batch)

    f = ts.training_chunk(steps)
    state, loss = f(state, x, y)  # compile
    jax.block_until_ready(loss)
    state, loss = f(state, x, y)  # warm
    jax.block_until_ready(loss)
    t = time.perf_counter()
    state, loss = f(state, x, y)
    jax.block_until_ready(loss)
    wall = time.perf_counter() - t
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        state, loss = f(state, x, y)
        jax.block_until_ready(loss)
    trace = read_trace(log_dir)
    events, info = device_events(trace)
    out = summarise(events, steps)
    host = host_events(trace, steps)
    out["streams"] = streams(events, steps, host.pop("launches"))
    out["host"] = host
    out.update(info)
    out.update(
        variant=variant,
        spec={k: v for k, v in spec.items() if k != "kind"},
        batch=batch,
        steps=steps,
        wall_ms_per_step=1000 * wall / steps,
        images_per_s=batch * steps / wall,
        **_common.device_summary(),
    )
    return out


def render(res: dict) -> tuple[str, str]:
    head = (
        f"{res['variant']} on {res.get('device_kind', '?')}: batch {res['batch']}, "
        f"wall {res['wall_ms_per_step']:.2f} ms a step ({res['images_per_s']:.0f} images/s), "
        f"device time {res['device_ms_per_step']:.2f} ms in "
        f"{res['launches_per_step']:.0f} kernels a step"
    )
    g_text, g_md = _common.table(
        res["groups"],
        [
            ("group", "group", ""),
            ("per_step", "kernels/step", ".0f"),
            ("ms_per_step", "ms/step", ".3f"),
            ("share", "share", ".1%"),
        ],
    )
    rows = [dict(r, kernel=r["kernel"][:70]) for r in res["kernels"]]
    k_text, k_md = _common.table(
        rows,
        [
            ("kernel", "kernel", ""),
            ("group", "group", ""),
            ("per_step", "count/step", ".0f"),
            ("mean_us", "mean us", ".1f"),
            ("ms_per_step", "ms/step", ".3f"),
            ("share", "share", ".1%"),
        ],
    )
    s_text, s_md = _common.table(
        res.get("scopes", []),
        [
            ("scope", "scope", ""),
            ("group", "group", ""),
            ("per_step", "kernels/step", ".0f"),
            ("ms_per_step", "ms/step", ".3f"),
        ],
    )
    d_text, d_md = _common.table(
        res.get("durations", []),
        [("durations", "kernels lasting", ""), ("per_step", "kernels/step", ".0f"), ("ms_per_step", "ms/step", ".3f")],
    )
    sm_text, sm_md = _common.table(
        [dict(r, kernel=r["kernel"][:70]) for r in res.get("small_kernels", [])],
        [
            ("kernel", f"kernel (launches under {SMALL_US:g} us)", ""),
            ("per_step", "count/step", ".0f"),
            ("ms_per_step", "ms/step", ".3f"),
        ],
    )
    st = res.get("streams") or {}
    t_text = t_md = ""
    if st:
        busy = ", ".join(f"{t} {v:.2f}" for t, v in sorted(st["busy_ms_per_step"].items(), key=lambda kv: -kv[1]))
        t_text = (
            f"streams, ms a step: span {st['span_ms_per_step']:.2f}; busy {busy}; main stream ({st['main_stream']}) "
            f"idle {st['main_idle_ms_per_step']:.2f}; other streams {st['other_streams_ms_per_step']:.2f}, "
            f"of which beside the main stream {st['overlap_ms_per_step']:.2f}"
        )
        w_text, w_md = _common.table(
            [dict(r, kernel=r["kernel"][:70]) for r in st["main_waits"]],
            [
                ("kernel", "main stream waited before", ""),
                ("gaps_per_step", "gaps/step", ".1f"),
                ("ms_per_step", "ms/step", ".3f"),
            ],
        )
        t_text, t_md = f"{t_text}\n\n{w_text}", f"{t_text}\n\n{w_md}"
        late = st.get("late_launches")
        if late:
            line = (
                f"gaps on the main stream whose launch the trace matches: {late['gaps_matched_per_step']:.0f} a step; "
                f"the host called the launch only after the stream ran dry in {late['host_late_per_step']:.0f} "
                f"({late['host_late_ms_per_step']:.2f} ms), the kernel waited on the device in the others "
                f"({late['device_wait_ms_per_step']:.2f} ms)"
            )
        else:
            line = "gaps on the main stream: no launch calls with correlation ids in the trace to tell host from device"
        t_text, t_md = f"{t_text}\n\n{line}", f"{t_md}\n\n{line}"
    host = res.get("host") or {}
    h_text = h_md = ""
    if host.get("calls"):
        th_text, th_md = _common.table(
            host["threads"], [("thread", "host thread", ""), ("busy_ms_per_step", "busy ms/step", ".3f")]
        )
        c_text, c_md = _common.table(
            [dict(r, event=r["event"][:70]) for r in host["calls"]],
            [
                ("event", "host event", ""),
                ("per_step", "count/step", ".0f"),
                ("mean_us", "mean us", ".1f"),
                ("ms_per_step", "ms/step", ".3f"),
            ],
        )
        h_text, h_md = f"{th_text}\n\n{c_text}", f"{th_md}\n\n{c_md}"
    text = "\n".join([head, "", g_text, "", s_text, "", k_text, "", d_text, "", sm_text, "", t_text, "", h_text])
    md = "\n".join([f"{head}\n", g_md, "", s_md, "", k_md, "", d_md, "", sm_md, "", t_md, "", h_md])
    return text, md


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--variant", default="nais10_fused_unroll10", help="a train_step.py variant (JAX)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="training steps in the traced chunk")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--keep-trace", action="store_true", help="copy the Perfetto trace next to the results")
    parser.add_argument("--fusions", action="store_true", help="dump XLA's program and name the largest XLA fusions")
    args = parser.parse_args(argv)
    dump_dir = os.path.join(args.out, "xla_dump")
    if args.fusions:  # before JAX starts its backend; only the step's module ("jit_chunk")
        flags = f"--xla_dump_to={dump_dir} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_chunk"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
    _common.importable()
    import train_step as ts

    if args.variant not in ts.VARIANTS:
        raise SystemExit(f"unknown --variant={args.variant!r}; valid: {', '.join(ts.VARIANTS)}")
    os.makedirs(args.out, exist_ok=True)
    batch = 8 if args.smoke else args.batch
    res = profile(
        args.variant, batch=batch, steps=args.steps, smoke=args.smoke, log_dir=os.path.join(args.out, "trace")
    )
    text, md = render(res)
    _common.write_results(args.out, f"profile_{args.variant}", res, md)
    if args.fusions:
        events, _ = device_events(read_trace(os.path.join(args.out, "trace")))
        table = fusion_table(events, args.steps, dump_dir)
        with open(os.path.join(args.out, f"fusions_{args.variant}.md"), "w") as f:
            f.write(table)
        shutil.rmtree(dump_dir, ignore_errors=True)  # hundreds of MB
        text += "\n\n" + table.split("\n\n`")[0]
    if args.keep_trace:  # next to the results: the profiler's own folder nests too deep for some copiers
        traces = sorted(glob.glob(os.path.join(args.out, "trace", "**", "perfetto_trace.json.gz"), recursive=True))
        if traces:
            shutil.copy(traces[-1], os.path.join(args.out, f"perfetto_{args.variant}.json.gz"))
    print(text)


if __name__ == "__main__":
    main()
