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
