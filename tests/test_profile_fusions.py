"""``benchmarks/profile_step.py --fusions``: the trace's XLA fusions matched to XLA's program.

The profiler's trace names a fusion ``loop_add_fusion_3`` where XLA's optimised program names it
``loop_add_fusion.3``; the table must find each one's instruction, its output shape, the JAX op
it came from and its fused computation, and rank them by time a step."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))

import profile_step  # noqa: E402

PROGRAM = """HloModule jit_chunk

%fused_computation.7 (param_0: f32[2,3]) -> f32[4,3] {
  %param_0 = f32[2,3]{1,0} parameter(0)
  %c = f32[] constant(0)
  ROOT %pad.1 = f32[4,3]{1,0} pad(%param_0, %c), padding=1_1x0_0, metadata={op_name="x"}
}

%fused_computation.9 (param_0: f32[8]) -> f32[] {
  %param_0 = f32[8]{0} parameter(0)
  ROOT %r = f32[] reduce(%param_0), dimensions={0}
}

ENTRY %main {
  %loop_pad_fusion.3 = f32[4,3]{1,0} fusion(%p), kind=kLoop, calls=%fused_computation.7, OP_PAD
  ROOT %input_reduce_fusion = f32[] fusion(%q), kind=kInput, calls=%fused_computation.9, OP_SUM
}
""".replace("OP_PAD", 'metadata={op_name="jit(chunk)/while/body/eval_jaxpr/stage0_block1/pad"}').replace(
    "OP_SUM", 'metadata={op_name="jit(chunk)/sum"}'
)


def test_fusion_table_ranks_and_names_the_fusions(tmp_path):
    (tmp_path / "module_1.jit_chunk.sm_9.0a_gpu_after_optimizations.txt").write_text(PROGRAM)
    (tmp_path / "module_1.jit_chunk.sm_9.0a_gpu_before_optimizations.txt").write_text("HloModule x\n")
    events = [
        {"name": "loop_pad_fusion_3", "dur": 6.0},
        {"name": "loop_pad_fusion_3", "dur": 6.0},
        {"name": "input_reduce_fusion", "dur": 30.0},
        {"name": "sm90_xmma_fprop_implicit_gemm", "dur": 99.0},  # cuDNN's: not an XLA fusion
    ]
    table = profile_step.fusion_table(events, steps=2, dump_dir=str(tmp_path))
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) == 2
    assert rows[0] == "| `input_reduce_fusion` | 0.015 | 0.5 | 30.0 | `f32[]` | `jit(chunk)/sum` |"
    assert rows[1] == "| `loop_pad_fusion_3` | 0.006 | 1 | 6.0 | `f32[4,3]{1,0}` | `stage0_block1/pad` |"
    assert "ROOT %pad.1 = f32[4,3]{1,0} pad(%param_0, %c), padding=1_1x0_0" in table
    assert 'metadata={op_name="x"}' not in table
    assert "ROOT %r = f32[] reduce(%param_0), dimensions={0}" in table


def test_fusion_table_without_a_program_still_ranks(tmp_path):
    table = profile_step.fusion_table([{"name": "loop_add_fusion", "dur": 4.0}], steps=1, dump_dir=str(tmp_path))
    assert "| `loop_add_fusion` | 0.004 | 1 | 4.0 | `?` | `?` |" in table


def test_kernels_counted_by_duration_and_the_small_ones_named():
    """``durations``: each launch in exactly one class (2 us sits in "2 to 4"), counts and ms a
    step over the step count, and the small kernels (under 4 us) ranked by their time."""
    events = (
        [{"name": "tiny_transpose", "dur": 1.5}] * 6
        + [{"name": "pad", "dur": 2.0}] * 2
        + [{"name": "pad", "dur": 3.9}] * 2
        + [{"name": "conv", "dur": 9.0}] * 4
        + [{"name": "block", "dur": 120.0}] * 2
    )
    got = profile_step.durations(events, steps=2)
    rows = {r["durations"]: r for r in got["durations"]}
    assert list(rows) == ["0 to 2 us", "2 to 4 us", "4 to 8 us", "8 to 16 us", "16 to 50 us", ">= 50 us"]
    assert rows["0 to 2 us"]["per_step"] == 3 and abs(rows["0 to 2 us"]["ms_per_step"] - 0.0045) < 1e-12
    assert rows["2 to 4 us"]["per_step"] == 2 and abs(rows["2 to 4 us"]["ms_per_step"] - 0.0059) < 1e-12
    assert rows["4 to 8 us"]["per_step"] == 0 and rows["8 to 16 us"]["per_step"] == 2
    assert rows[">= 50 us"]["per_step"] == 1 and abs(rows[">= 50 us"]["ms_per_step"] - 0.12) < 1e-12
    assert sum(r["per_step"] for r in got["durations"]) == len(events) / 2
    assert [r["kernel"] for r in got["small_kernels"]] == ["pad", "tiny_transpose"]  # 11.8 us against 9.0
    assert got["small_kernels"][0]["per_step"] == 2
    summary = profile_step.summarise(events, steps=2)
    assert summary["durations"] == got["durations"]
