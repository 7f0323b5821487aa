"""The default config trains: unchanged but for the dataset, it fits scikit-learn's digits in
seconds (the Fashion-MNIST figure in its docstring is a CPU run of the same config)."""

from __future__ import annotations

import time

from naisnet_jax import metric_writers as mw
from naisnet_jax import train
from naisnet_jax.configs import default


def test_the_default_config_trains_digits_in_seconds(tmp_path):
    config = default.get_config()
    config.dataset = "digits"  # 1438 train / 359 test 8x8 images; everything else as shipped
    config.progress = False
    t0 = time.perf_counter()
    result = train.train_and_evaluate(config, str(tmp_path))
    wall = time.perf_counter() - t0
    records = mw.read_jsonl(tmp_path / train.METRICS_FILE)
    assert [r["epoch"] for r in records] == list(range(1, config.num_epochs + 1))
    assert result["test_accuracy"] >= 0.93, result["test_accuracy"]
    assert result["train_loss"] <= 0.1 < records[0]["train_loss"]
    assert all(r["rho_max"] < 1 for r in records)
    # "seconds": the 19 epochs after the first (which compiles) take a few seconds on two
    # cores; the bound leaves room for a loaded CI machine.
    training = sum(r["epoch_seconds"] for r in records[1:])
    assert training < 60, (training, wall)
