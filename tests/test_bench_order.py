"""``benchmarks/train_step.py --order=abba``: each variant runs in two processes, the second pass in
reverse order, and the table gives each one's two timings and their mean (a call's first process
can run slower than the same code later: ~0.36 ms a step on an H100)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))

import train_step  # noqa: E402


def test_abba_runs_every_variant_twice_in_mirrored_order():
    assert train_step.abba(["a", "b", "c"]) == ["a", "b", "c", "c@2", "b@2", "a@2"]
    assert train_step.abba(["a"]) == ["a", "a@2"]
    assert train_step._base("nais10_fused_unroll10@2") == "nais10_fused_unroll10"
    assert train_step._base("nais10") == "nais10"


def test_order_means_pairs_the_two_processes_and_skips_failures():
    rows = [
        {"name": "a", "ms_per_step": 27.15},
        {"name": "b", "ms_per_step": 26.78},
        {"name": "b@2", "ms_per_step": 27.13},
        {"name": "a@2", "ms_per_step": 26.78},
        {"name": "c", "ms_per_step": 30.0},
        {"name": "c@2", "error": "timeout 300 s"},
        {"name": "d", "error": "exit code 1"},
        {"name": "d@2", "ms_per_step": 31.0},
    ]
    means, table = train_step.order_means(rows)
    by = {m["variant"]: m for m in means}
    assert by["a"]["ms_first"] == 27.15 and by["a"]["ms_second"] == 26.78
    assert by["a"]["ms_mean"] == pytest.approx(26.965)
    assert by["b"]["ms_mean"] == pytest.approx(26.955)
    assert by["c"]["ms_second"] is None and by["c"]["ms_mean"] == 30.0
    assert by["d"]["ms_first"] is None and by["d"]["ms_second"] == 31.0 and by["d"]["ms_mean"] == 31.0
    assert "a | 27.15 | 26.78 | 26.96" in table and "c | 30.00 | - | 30.00" in table
    assert "d | - | 31.00 | 31.00" in table


def test_a_second_process_runs_the_same_variant():
    """``--one=NAME@2`` runs NAME's spec (the row keeps the suffix)."""
    spec = train_step.VARIANTS[train_step._base("nais10_fused_unroll10@2")]
    assert spec is train_step.VARIANTS["nais10_fused_unroll10"]


def test_the_fused_step_is_counted_as_its_stacked_form():
    """The FLOP count of a ``block_vjp="fused"`` variant (kernels the jaxpr counter cannot see
    into) is the stacked form's count: the same products, fused or not. The smoke models build on a CPU."""
    x, y = train_step.fixed_batch(4)
    counts = {}
    for name in ("nais10_fused_unroll10", "nais10_fused_unroll10_triton", "nais10_stacked_unroll10"):
        config, _, state = train_step.model_and_state(train_step.VARIANTS[name], smoke=True)
        counted = train_step._countable(config, state)
        assert (counted is state) == (name == "nais10_stacked_unroll10")
        counts[name] = train_step.step_flops(counted, x, y)
    assert counts["nais10_stacked_unroll10"]["flops"] > 0
    assert counts["nais10_fused_unroll10"] == counts["nais10_stacked_unroll10"]
    assert counts["nais10_fused_unroll10_triton"] == counts["nais10_stacked_unroll10"]


def test_the_precision_check_measures_both_paths_against_float64_autodiff():
    """``hopper_checks.py``'s precision rows on the smoke model (a CPU: the fast path is the
    stacked VJP here, exact float32): both forms, every precision and path, each error finite and
    at float32's level; the fast path's rows above TF32 meet the target, and the check would fail
    a gradient off by 1e-3 (what TF32 products give)."""
    import hopper_checks

    rows = hopper_checks.precision_rows(batch=4, smoke=True)
    assert [(r["form"], r["precision"], r["path"]) for r in rows] == [
        (form, p, path)
        for form in hopper_checks.PRECISION_FORMS
        for p in ("float32", "highest", "default")
        for path in ("autodiff", "fast path")
    ]
    for r in rows:
        assert 0.0 < r["global_rel"] <= r["worst_leaf_rel"] * (1 + 1e-9)  # a mean of the leaves' ratios
        assert r["global_rel"] < 1e-5, r  # float32 against float64 on a 2-block net (a CPU has no TF32)
        if r["path"] == "fast path" and r["precision"] != "default":
            assert r["met"] is True, r
            assert (
                1e-3 > hopper_checks.PRECISION_RATIO * r["global_rel"] / r["x_autodiff"] + hopper_checks.PRECISION_FLOOR
            )
        else:
            assert r["met"] is None


def test_first_epoch_runs_the_trainer_cold_then_from_the_cache(tmp_path):
    """``benchmarks/first_epoch.py --smoke``: two trainer processes on one cache directory; each
    row's difference is its first epoch less the median of its later ones, and the second run,
    reading the first's compiled programs, starts its training faster."""
    import json
    import statistics

    import first_epoch

    first_epoch.main([f"--out={tmp_path}", "--smoke"])
    with open(tmp_path / "first_epoch.json") as f:
        result = json.load(f)
    cold, cached = result["rows"]
    assert (cold["run"], cached["run"]) == ("cold", "cached")
    for row in (cold, cached):
        assert len(row["epoch_seconds"]) == 3
        assert row["over_steady_s"] == pytest.approx(
            row["epoch_seconds"][0] - statistics.median(row["epoch_seconds"][1:])
        )
        assert row["first_chunk_steps"] == 4
    assert cached["first_chunk_s"] < cold["first_chunk_s"]
    verdict = result["verdict"]  # the target is a cold start's: a first run, its cache empty
    assert (verdict["run"], verdict["over_steady_s"]) == ("cold", cold["over_steady_s"])
    assert verdict["pass"] == (cold["over_steady_s"] <= first_epoch.TARGET_OVER_STEADY)
    assert verdict["cached_over_steady_s"] == cached["over_steady_s"]
    assert os.listdir(tmp_path / "cache")  # the programs the second run read
    with pytest.raises(SystemExit, match="--epochs=1: expected at least 2"):
        first_epoch.main([f"--out={tmp_path}", "--epochs=1"])
