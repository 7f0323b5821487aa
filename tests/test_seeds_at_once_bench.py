"""``benchmarks/seeds_at_once.py``: what ``--at-once`` accepts (the timing itself runs on a GPU;
``--smoke`` runs it on a CPU in about a minute, kept out of the default run)."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))

import seeds_at_once  # noqa: E402


def test_at_once_reads_all_and_whole_numbers():
    assert seeds_at_once.at_once("all") is None
    assert seeds_at_once.at_once("2") == 2


@pytest.mark.parametrize("bad", ["0", "-1", "two", "1.5", ""])
def test_at_once_refuses_anything_else_naming_it(bad):
    with pytest.raises(SystemExit, match=f"got {bad!r}"):
        seeds_at_once.at_once(bad)


@pytest.mark.slow
def test_smoke_run_tables_every_k_against_all_at_once(tmp_path):
    seeds_at_once.main([f"--out={tmp_path}", "--smoke", "--steps=2", "--at-once=all,1"])
    with open(tmp_path / "seeds_at_once.json") as f:
        rows = {r["name"]: r for r in json.load(f)["rows"]}
    assert rows["all"]["speed"] == 1.0 and rows["all"]["seeds_at_once"] is None
    assert rows["1"]["seeds_at_once"] == 1 and rows["1"]["speed"] > 0
    assert rows["1"]["seed_step_ms"] == pytest.approx(rows["1"]["step_ms"] / 4)
