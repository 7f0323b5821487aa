"""experiments/signal.py on miniatures: the per-step records hold every block and step within
their ranges, the miniatures show the cause the full nets show, and the report merges them."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from experiments import signal


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("signal"))
    for variant in ("nais10", "nais10_transitions_lecun", "resnet"):
        signal.measure(variant, workdir=workdir, dataset="digits", steps=3, epochs=1, schedule="paper", smoke=True)
    return workdir


def test_records_hold_every_block_and_step(smoke):
    with open(os.path.join(smoke, "nais10.json")) as f:
        rec = json.load(f)
    assert rec["blocks"] == ["stage0_block0", "stage0_block1", "stage1_block0", "stage1_block1"]
    assert len(rec["steps"]) == 3 and rec["lr_boundaries_epochs"] == []  # one epoch: no drop fits
    for step in rec["steps"]:
        for field in ("out_std", "active_first", "active_last", "g_drive", "w_drive", "g_state", "projection_undoes"):
            assert len(step[field]) == 4, field
        assert all(0.0 <= a <= 1.0 for a in step["active_first"] + step["active_last"])
        assert all(0.0 <= p <= 1.0 + 1e-6 for p in step["projection_undoes"])  # a projection never overshoots
    assert np.isfinite(rec["steps"][0]["loss"]) and rec["history"][0]["epoch"] == 1
    # the step taken on D, relative to D: the change of its norm between two steps is at most that
    for a, b in zip(rec["steps"], rec["steps"][1:]):
        for w0, w1, rel in zip(a["w_drive"], b["w_drive"], a["step_drive"]):
            assert abs(w1 - w0) <= rel * w0 * (1 + 1e-5) + 1e-7
        assert len(a["drive_scale"]) == 4 and all(s > 0 for s in a["drive_scale"])
    assert rec["steps"][0]["drive_scale"] == pytest.approx([1.0] * 4)  # BatchNorm's scale starts at 1
    for field in ("train_eval_accuracy", "test_accuracy_batch_statistics", "test_accuracy_recomputed_statistics"):
        assert 0.0 <= rec[field] <= 1.0


def test_the_former_form_starts_without_signal_and_the_shipped_one_with_it(smoke):
    """The miniature shows the full nets' cause: LeCun drives with BatchNorm at the stage change
    only lose spread block by block; the shipped form keeps it."""
    first = {}
    for variant in ("nais10", "nais10_transitions_lecun"):
        with open(os.path.join(smoke, f"{variant}.json")) as f:
            first[variant] = json.load(f)["steps"][0]
    assert min(first["nais10"]["out_std"]) > 0.25
    assert first["nais10_transitions_lecun"]["out_std"][1] < 0.8 * first["nais10"]["out_std"][1]


def test_report_merges_the_records(smoke):
    rows = signal.report(smoke)
    assert [r["variant"] for r in rows] == ["nais10", "resnet", "nais10_transitions_lecun"]  # VARIANTS' order
    for name in ("results.md", "results.json", "signal.png"):
        assert os.path.getsize(os.path.join(smoke, name)) > 0
    with open(os.path.join(smoke, "results.md")) as f:
        assert "averages recomputed" in f.read()
    with pytest.raises(ValueError, match="no variant results"):
        signal.report(os.path.join(smoke, "empty"))


def test_trajectory_samples_the_records_steps(smoke):
    """The report's trajectory is the record's own values at the sampled steps (the last step too),
    the loss averaged over the ten steps that end there, and no drive scale for a ResNet."""
    for variant in ("nais10", "resnet"):
        with open(os.path.join(smoke, f"{variant}.json")) as f:
            rec = json.load(f)
        t = signal.trajectory(rec)
        steps = rec["steps"]
        assert t["step"] == [0, 1, 2]  # three measured steps: 0, 1, 2 sampled, 2 is the last
        for j, i in enumerate(t["step"]):
            assert t["w_drive_first_block"][j] == steps[i]["w_drive"][0]
            assert t["g_drive_first_block"][j] == steps[i]["g_drive"][0]
            assert t["step_drive_first_block"][j] == steps[i]["step_drive"][0]
            assert t["step_drive_last_block"][j] == steps[i]["step_drive"][-1]
            assert t["loss_10"][j] == pytest.approx(np.mean([s["loss"] for s in steps[: i + 1]]))
            assert t["accuracy_10"][j] == pytest.approx(np.mean([s["accuracy"] for s in steps[: i + 1]]))
        scales = t["drive_scale_first_block"]
        assert scales == ([None] * 3 if variant == "resnet" else [s["drive_scale"][0] for s in steps])
    older = {**rec, "steps": [{k: v for k, v in s.items() if k != "step_drive"} for s in rec["steps"]]}
    assert signal.trajectory(older) is None  # a record made before the relative step was measured
    signal.report(smoke)
    with open(os.path.join(smoke, "results.md")) as f:
        assert "## The first block's drive kernel, step by step" in f.read()


def test_a_warm_up_adds_its_last_step_and_the_tenth_after_it_to_the_trajectory(smoke):
    """Under a warm-up of w steps the trajectory samples steps w - 1 and w + 9 as well, each with
    the batch accuracy averaged over the ten steps that end there (a plain loop over the record)."""
    with open(os.path.join(smoke, "nais10.json")) as f:
        rec = json.load(f)
    one = rec["steps"][0]
    steps = [{**one, "step": i, "loss": 2.0 - 0.001 * i, "accuracy": (i % 7) / 10} for i in range(468)]
    t = signal.trajectory({**rec, "steps": steps, "lr_warmup_steps": 400})
    assert t["step"] == [0, 1, 2, 5, 10, 20, 50, 100, 200, 399, 409, 467]
    for j, i in enumerate(t["step"]):
        window = [steps[k]["accuracy"] for k in range(max(0, i - 9), i + 1)]
        assert t["accuracy_10"][j] == pytest.approx(sum(window) / len(window))
    assert signal.trajectory({**rec, "steps": steps})["step"] == [0, 1, 2, 5, 10, 20, 50, 100, 200, 467]


def test_the_records_and_the_report_name_the_seed(smoke):
    with open(os.path.join(smoke, "nais10.json")) as f:
        assert json.load(f)["seed"] == 0
    signal.report(smoke)
    with open(os.path.join(smoke, "results.json")) as f:
        assert json.load(f)["header"]["seeds"] == ["0"]
