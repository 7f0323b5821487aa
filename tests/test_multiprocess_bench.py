"""``benchmarks/multiprocess.py``: one process of n devices against n processes (the timing itself
runs on a GPU host; ``--smoke`` runs its whole protocol on CPU devices in about a minute, kept out of
the default run)."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))

import multiprocess  # noqa: E402


def test_differences_name_step_zero_and_the_largest():
    d = multiprocess.differences([2.0, 1.5, 1.0], [2.0, 1.25, 1.125])
    assert d == {"step0": 0.0, "largest": 0.25, "at_step": 1}


def test_differences_refuse_curves_of_other_lengths():
    with pytest.raises(ValueError):
        multiprocess.differences([1.0, 2.0], [1.0])


@pytest.mark.slow
def test_smoke_run_compares_the_processes_and_the_one_process_with_itself(tmp_path):
    multiprocess.main([f"--out={tmp_path}", "--smoke"])
    with open(tmp_path / "multiprocess.json") as f:
        result = json.load(f)
    one, many, control = result["one_process"], result["processes"], result["control"]
    assert (one["processes"], one["devices"], many["processes"], many["devices"]) == (1, 4, 2, 4)
    assert all(r["script"] == result["script"] for r in (one, many, control))
    assert "images_per_s" not in control and len(control["losses"]) == len(one["losses"]) == 4
    for precision in ("float32", "default"):
        # CPU collectives in another order: float32 rounding, no more; XLA's CPU code repeats itself exactly.
        assert result["loss_differences"]["processes"][precision]["largest"] < 1e-5
        assert result["loss_differences"]["control"][precision]["largest"] == 0.0
    assert result["throughput_ratio"] == pytest.approx(many["images_per_s"] / one["images_per_s"])
    assert sorted(os.listdir(tmp_path)) == [
        "multiprocess.json",
        "multiprocess.md",
        "worker_1_control.json",
        "worker_1_one.json",
        "worker_2_processes.json",
    ]
