"""experiments/default_accuracy.py on its smoke setting: every seed trains, and the record names
its commit, its device and each seed's last epoch, with the summary recomputed here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_smoke_writes_a_record_with_its_provenance(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "src"), REPO])}
    out = tmp_path / "acc"
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.default_accuracy", "--smoke", f"--out={out}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads((out / "results.json").read_text())
    assert record["device"].startswith("cpu:") and record["script"] not in ("", "unknown")
    assert [r["seed"] for r in record["rows"]] == [0, 1]
    for row in record["rows"]:
        metrics = [json.loads(line) for line in (out / f"seed{row['seed']}" / "metrics.jsonl").read_text().splitlines()]
        assert row["test_accuracy"] == metrics[-1]["test_accuracy"]
        assert record["test_accuracy_per_epoch"][str(row["seed"])] == [m["test_accuracy"] for m in metrics]
    acc = np.array([r["test_accuracy"] for r in record["rows"]])
    assert record["summary"]["test_accuracy_mean"] == float(acc.mean())
    assert record["summary"]["test_accuracy_std"] == float(acc.std(ddof=1))
    table = (out / "results.md").read_text()
    assert f"script {record['script']}" in table and "| mean ± std |" in table
    assert (out / "test_accuracy.png").stat().st_size > 2_000
