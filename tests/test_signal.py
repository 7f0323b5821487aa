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


def test_a_record_stands_only_for_the_settings_it_was_measured_with(smoke, tmp_path):
    """A record in the workdir is reused only for the same settings; another seed (or dataset,
    schedule, epochs, steps, warm-up) is refused naming both. A record made before the seed and
    the steps asked for were stored stands for seed 0 and any steps."""
    path = os.path.join(smoke, "nais10.json")
    same = dict(dataset="digits", schedule="paper", epochs=1, steps=3, warmup_steps=0, seed=0)
    signal.check_record(path, same)
    with pytest.raises(ValueError, match=r"seed 0 there, 1 asked.*another --workdir"):
        signal.check_record(path, {**same, "seed": 1})
    with pytest.raises(ValueError, match="steps 3 there, 5 asked"):
        signal.check_record(path, {**same, "steps": 5})
    with open(path) as f:
        rec = json.load(f)
    older = {k: v for k, v in rec.items() if k not in ("seed", "steps_asked")}
    legacy = tmp_path / "nais10.json"
    legacy.write_text(json.dumps(older))
    signal.check_record(str(legacy), {**same, "steps": 100})  # the steps asked for are not known
    with pytest.raises(ValueError, match="seed 0 there, 2 asked"):
        signal.check_record(str(legacy), {**same, "seed": 2})


def test_another_seed_is_another_start(smoke, tmp_path):
    rec = signal.measure(
        "resnet", workdir=str(tmp_path), dataset="digits", steps=3, epochs=1, schedule="paper", smoke=True, seed=1
    )
    with open(os.path.join(smoke, "resnet.json")) as f:
        seed0 = json.load(f)
    assert rec["seed"] == 1 and rec["steps_asked"] == 3
    assert rec["steps"][0]["loss"] != seed0["steps"][0]["loss"]


def test_the_command_refuses_a_record_of_other_settings_in_one_line(smoke, tmp_path):
    import shutil
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    workdir = tmp_path / "w"
    workdir.mkdir()
    shutil.copy(os.path.join(smoke, "nais10.json"), workdir / "nais10.json")
    done = subprocess.run(
        [sys.executable, "-m", "experiments.signal", "--smoke", "--schedule=paper", "--steps=3", "--epochs=1"]
        + ["--variants=nais10", "--seed=1", f"--workdir={workdir}"],
        cwd=repo,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(repo, "src"), repo])},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.startswith("error: ") and "seed 0 there, 1 asked" in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and sorted(os.listdir(workdir)) == ["nais10.json"]
