"""The sweep engine: seed i of a vmapped sweep is training seed i alone, resume, per-seed
divergence, export, audit and the per-layer loss.

Every sweep here is a tiny model (a handful of units, a few steps or layers) on 256 digits, 4
SGD steps per epoch in two chunks of 2 (so the per-chunk keys of the single run matter; a
remainder chunk is checked by the step-keys test), with augmentation on for the NAIS-Net so that
the per-step augmentation keys matter too.
"""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import re
import sys

import jax
import ml_collections
import numpy as np
import pytest

from naisnet_jax import checkpoint as ckpt
from naisnet_jax import seeds as seeds_lib
from naisnet_jax import sweep, train

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SEEDS = (0, 1, 2)
NO_DATA = None  # set in the fixture: AuditOptions(data="none") (parameter-level audit only)


def get_config(model="naisnet_mnist", **overrides):
    """digits_tiny, shrunk: 256 train / 100 test digits, batch 64 (4 steps an epoch)."""
    config = importlib.import_module("naisnet_jax.configs.digits_tiny").get_config()
    config.model = model
    config.limit_train = 256
    config.limit_test = 100
    config.batch_size = 64
    config.eval_batch_size = 64
    config.steps_per_chunk = 2  # one compiled chunk in the single runs
    config.num_epochs = 2
    config.checkpoint_every_epochs = 1
    config.progress = False
    if model.startswith("naisnet"):
        config.model_kwargs = ml_collections.ConfigDict({"features": 8, "steps": 3})
        config.augment = True
    else:
        config.model_kwargs = ml_collections.ConfigDict({"features": 6, "depth": 3})
    for key, value in overrides.items():
        config[key] = value
    return config


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def assert_trees_equal(a, b):
    assert jax.tree.structure(jax.device_get(a)) == jax.tree.structure(jax.device_get(b))
    for x, y in zip(leaves(a), leaves(b)):
        np.testing.assert_array_equal(x, y)


def seed_slice(tree, i):
    return jax.tree.map(lambda x: x[i], tree)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def single_runs(config, root, seeds=(SEEDS[0], SEEDS[2])):
    """``train_and_evaluate`` per seed (the middle seed only in the slow test: each run compiles)."""
    out = {}
    for seed in seeds:
        c = config.copy_and_resolve_references()
        c.seed = seed
        out[seed] = train.train_and_evaluate(c, os.path.join(root, f"single_{seed}"))
    return out


@pytest.fixture(scope="module")
def nais(tmp_path_factory):
    """A 3-seed sweep of the tiny FC NAIS-Net, interrupted after epoch 1 and resumed by a
    fresh call (then exported and audited), and the single runs of seeds 0 and 2."""
    from naisnet_jax.verify import AuditOptions

    root = str(tmp_path_factory.mktemp("nais"))
    workdir = os.path.join(root, "sweep")
    config = get_config()
    programs = sweep.ProgramCache()  # the resumed sweep reuses the first call's compiled epoch
    first = sweep.train_sweep(config, workdir, seeds=SEEDS, stop_after_epochs=1, verbose=False, programs=programs)
    result = sweep.train_sweep(
        get_config(), workdir, seeds=SEEDS, audit_options=AuditOptions(data="none"), programs=programs
    )
    assert len(programs) == 1
    return config, workdir, result, single_runs(config, root), first


# ------------------------------------------------------------------ seed i is the single run


def check_seed_is_single_run(result, i, single_result):
    """Bit for bit on this CPU: the vmapped step computes each seed's lane with the same
    kernels and summation order as the single run (checked for float32 parameters, the
    momentum and the step counter), so no tolerance is needed."""
    single = single_result["state"]
    mine = result.seed_state(i)
    assert_trees_equal(mine.params, single.params)
    assert_trees_equal(mine.opt_state, single.opt_state)
    assert int(mine.step) == int(single.step) == 8
    run = result.runs[i]
    assert run.test_accuracy == pytest.approx(single_result["test_accuracy"], abs=0)
    assert run.test_loss == pytest.approx(single_result["test_loss"], rel=1e-6)
    # the single run averages chunk means weighted by chunk length: equal up to round-off
    assert run.train_loss == pytest.approx(single_result["train_loss"], rel=1e-6)
    assert run.train_accuracy == pytest.approx(single_result["train_accuracy"], rel=1e-6)
    assert run.rho_max == pytest.approx(single_result["rho_max"], rel=1e-12)


def test_seed_i_of_the_sweep_is_the_single_run_of_seed_i(nais):
    _, _, result, singles, _ = nais
    assert result.seeds == SEEDS and result.finished and result.epoch == 2
    for i in (0, 2):
        check_seed_is_single_run(result, i, singles[SEEDS[i]])
    # the seeds really differ
    assert not np.array_equal(leaves(result.seed_state(0).params)[0], leaves(result.seed_state(1).params)[0])


@pytest.mark.slow
def test_the_middle_seed_is_its_single_run_too(nais, tmp_path):
    config, _, result, _, _ = nais
    check_seed_is_single_run(result, 1, single_runs(config, str(tmp_path), seeds=(SEEDS[1],))[SEEDS[1]])


@pytest.fixture(scope="module")
def bn_sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("bn")
    config = get_config("resnet_sh_bn")
    return config, root, sweep.train_sweep(config, str(root / "sweep"), seeds=SEEDS, audit=False, verbose=False)


@pytest.mark.parametrize("index", [1, pytest.param(0, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_a_bn_resnet_seed_is_its_single_run(bn_sweep, index):
    """BatchNorm statistics are per seed as well: parameters and running statistics are equal
    bit for bit to the single run's (the default suite checks seed 1 only, to save compiles)."""
    config, root, result = bn_sweep
    c = config.copy_and_resolve_references()
    c.seed = SEEDS[index]
    single = train.train_and_evaluate(c, str(root / f"single_{index}"))
    assert_trees_equal(result.seed_state(index).params, single["state"].params)
    assert_trees_equal(result.seed_state(index).batch_stats, single["state"].batch_stats)
    assert result.runs[index].test_accuracy == single["test_accuracy"]
    assert result.runs[index].rho_max is None and result.runs[index].per_step_loss.shape == (3,)


@pytest.mark.parametrize("at_once", [1, 2])
def test_seeds_run_a_few_at_a_time_compute_what_side_by_side_does(nais, tmp_path, at_once):
    """``config.seeds_at_once``: one seed at a time (``lax.map``, no vmap) or 2 and then the last
    alone (``batch_size=2`` over 3 seeds: a scanned group and a remainder) train every seed to the
    same state, bit for bit on this CPU, as all 3 side by side."""
    _, _, result, singles, _ = nais
    config = get_config(seeds_at_once=at_once)
    other = sweep.train_sweep(config, str(tmp_path / "sweep"), seeds=SEEDS, audit=False, verbose=False)
    for i in (0, 2):  # the single runs, one train_and_evaluate per seed: the independent reference
        check_seed_is_single_run(other, i, singles[SEEDS[i]])
    assert_trees_equal(other.state.params, result.state.params)
    assert_trees_equal(other.state.opt_state, result.state.opt_state)
    for a, b in zip(other.runs, result.runs):
        assert (a.test_accuracy, a.test_loss, a.train_loss) == (b.test_accuracy, b.test_loss, b.train_loss)


def test_step_keys_come_from_the_step_alone():
    """Step i's augmentation key is fold_in(epoch_key, i) (a plain loop), so chunks of any size
    and the whole epoch at once give the same keys."""
    key = jax.random.PRNGKey(7)
    expected = np.stack([np.asarray(jax.random.fold_in(key, i)) for i in range(7)])
    np.testing.assert_array_equal(np.asarray(train.step_keys(key, 0, 7)), expected)
    for size in (1, 3, 5):
        chunks = [np.asarray(train.step_keys(key, start, min(size, 7 - start))) for start in range(0, 7, size)]
        np.testing.assert_array_equal(np.concatenate(chunks), expected)


# ------------------------------------------------------------------ records, export, audit


def test_metrics_hold_one_record_per_epoch_and_seed(nais):
    _, workdir, result, _, _ = nais
    records = read_jsonl(os.path.join(workdir, train.METRICS_FILE))
    assert [(r["epoch"], r["seed"]) for r in records] == [(e, s) for e in (1, 2) for s in SEEDS]
    fields = {
        "epoch",
        "seed",
        "step",
        "learning_rate",
        "train_loss",
        "train_accuracy",
        "test_loss",
        "test_accuracy",
        "generalisation_gap",
        "rho_max",
        "epoch_seconds",
        "diverged_epoch",
    }
    for r in records:
        # the record a single run writes (its model stops early per pattern: the depth too), plus seed and divergence
        assert set(r) == fields | {"depth_mean", "depth_min", "depth_max"} and r["diverged_epoch"] is None
        assert r["generalisation_gap"] == pytest.approx(r["train_accuracy"] - r["test_accuracy"])
    assert list(result.history) == records


def test_every_seed_is_exported_as_an_auditable_single_run(nais):
    config, workdir, result, singles, _ = nais
    for i, seed in enumerate(SEEDS):
        run = result.runs[i]
        assert run.checkpoint_dir == os.path.join(workdir, f"seed_{seed}", train.CHECKPOINT_DIR)
        state, meta = ckpt.load(run.checkpoint_dir)
        assert meta["config"]["seed"] == seed and meta["epoch"] == 2 and meta["step"] == 8
        assert meta["model"] == config.model and "sweep" not in meta
        if seed in singles:
            assert_trees_equal(state["params"], singles[seed]["state"].params)
        # the seed's own metrics file, as a single run writes it (without the seed field)
        records = read_jsonl(os.path.join(workdir, f"seed_{seed}", train.METRICS_FILE))
        assert [r["epoch"] for r in records] == [1, 2] and "seed" not in records[0]
        # the verifier ran on it and certified it (the projection keeps every block stable)
        assert run.certified is True and sweep.certificate_certified(run.certificate)
        with open(os.path.join(workdir, f"seed_{seed}", sweep.CERTIFICATE_FILE)) as f:
            assert json.load(f)["certified"] is True
    assert result.all_certified is True and result.num_diverged == 0


def test_per_step_loss_of_a_seed_is_the_single_runs(nais):
    """Seed 2's per-layer loss (vmapped over seeds) against ``train.per_step_loss`` of its single
    run (one seed only: each reference call compiles)."""
    _, _, result, singles, _ = nais
    s = singles[SEEDS[2]]
    expected = train.per_step_loss(s["state"], s["test_data"], s["mean"], s["std"], batch_size=64)
    assert all(r.per_step_loss.shape == (3,) for r in result.runs)
    np.testing.assert_allclose(result.runs[2].per_step_loss, expected, rtol=1e-6)
    assert not np.allclose(result.runs[0].per_step_loss, expected, rtol=1e-6)
    # the same on the training set, which a sweep measures too (figure 3 on both splits)
    on_train = train.per_step_loss(s["state"], result.train_data, s["mean"], s["std"], batch_size=64)
    assert all(r.per_step_train_loss.shape == (3,) for r in result.runs)
    np.testing.assert_allclose(result.runs[2].per_step_train_loss, on_train, rtol=1e-6)
    assert not np.allclose(on_train, expected, rtol=1e-3)


def test_stats_are_over_seeds(nais):
    _, _, result, _, _ = nais
    acc = [r.test_accuracy for r in result.runs]
    mean, std, n = result.stats("test_accuracy")
    assert n == 3 and mean == pytest.approx(np.mean(acc)) and std == pytest.approx(np.std(acc))


# ------------------------------------------------------------------ resume


def test_an_interrupted_sweep_resumes(nais):
    """The fixture's sweep was interrupted after epoch 1; the first call exported nothing, the
    second resumed from the sweep checkpoint and kept one record per epoch and seed (that its
    parameters are the uninterrupted single runs' is checked above; the divergence test below
    runs an uninterrupted sweep and gets the same seeds 0 and 2)."""
    _, workdir, result, _, first = nais
    assert first.epoch == 1 and not first.finished and first.runs[0].checkpoint_dir is None
    assert first.runs[0].certified is None and first.all_certified is None
    assert [r["epoch"] for r in first.history] == [1, 1, 1]
    steps = sorted(int(d) for d in os.listdir(os.path.join(workdir, sweep.SWEEP_CHECKPOINT_DIR)) if d.isdigit())
    # one sweep checkpoint per epoch (checkpoint_every_epochs=1), keyed as a single run's: by the step reached
    assert steps == [result.runs[0].step // 2, result.runs[0].step]
    for a, b in zip(first.history, result.history[:3]):
        assert {k: v for k, v in a.items() if k != "epoch_seconds"} == {
            k: v for k, v in b.items() if k != "epoch_seconds"
        }


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(seeds=(0, 1, 5)), "seeds"),
        (dict(model="resnet_sh"), "model"),
        (dict(limit_train=128), "limit_train"),
        (dict(model_kwargs=ml_collections.ConfigDict({"features": 4, "steps": 3})), "model_kwargs"),
    ],
)
def test_resuming_another_sweep_says_what_differs(nais, monkeypatch, change, field):
    _, workdir, _, _, _ = nais
    monkeypatch.setattr(sweep, "prepare", lambda *a, **k: pytest.fail("loaded data before refusing"))
    seeds = change.pop("seeds", SEEDS)
    config = get_config(change.pop("model", "naisnet_mnist"), **change)
    if config.model != "naisnet_mnist":
        config.augment = False
    with pytest.raises(ValueError, match=f"{field}: checkpoint"):
        sweep.train_sweep(config, workdir, seeds=seeds)


def test_resuming_with_other_speed_options_is_not_refused(nais, monkeypatch):
    """Speed options (same parameters, same maths) may change between runs of a sweep: the
    check passes and the sweep goes on to load its data."""
    _, workdir, _, _, _ = nais

    class Passed(Exception):
        pass

    def setup(*args, **kwargs):
        raise Passed

    monkeypatch.setattr(sweep, "prepare", setup)
    config = get_config()
    config.model_kwargs.scan_unroll = 2
    config.model_kwargs.block_vjp = "stacked"
    with pytest.raises(Passed):
        sweep.train_sweep(config, workdir, seeds=SEEDS)


# ------------------------------------------------------------------ divergence


def test_a_diverged_seed_is_frozen_and_the_others_train_on(nais, tmp_path, monkeypatch):
    """Seed 1 starts with classifier biases of +-3e38 for classes 0 and 1: every example of
    class 1 has an infinite float32 cross-entropy, so its first epoch is not finite. It is
    marked diverged at epoch 1, frozen at its (finite) initial state, still exported, counted,
    and left out of the means; seeds 0 and 2 are bit for bit those of the clean sweep."""
    _, _, clean, _, _ = nais
    create = train.create_train_state

    def poisoned(config, *args, **kwargs):
        state = create(config, *args, **kwargs)
        if config.seed == 1:
            params = jax.tree_util.tree_map_with_path(
                lambda p, x: (
                    x.at[0].set(3e38).at[1].set(-3e38)
                    if "classifier" in jax.tree_util.keystr(p) and "bias" in jax.tree_util.keystr(p)
                    else x
                ),
                state.params,
            )
            state = state.replace(params=params)
        return state

    monkeypatch.setattr(train, "create_train_state", poisoned)
    config = get_config()
    result = sweep.train_sweep(config, str(tmp_path), seeds=SEEDS, audit=False, per_step_loss=False, verbose=False)
    monkeypatch.undo()
    bad = result.runs[1]
    assert bad.diverged and bad.diverged_epoch == 1 and bad.train_loss is None
    assert result.num_diverged == 1
    initial = poisoned(seeds_lib.seed_config(config, 1), train.build_model(config, 10), (8, 8, 1), 4)
    assert_trees_equal(result.seed_state(1).params, initial.params)
    assert int(result.seed_state(1).step) == 0
    for i in (0, 2):
        assert not result.runs[i].diverged
        assert_trees_equal(result.seed_state(i).params, clean.seed_state(i).params)
    records = [r for r in result.history if r["seed"] == 1]
    assert [r["diverged_epoch"] for r in records] == [1, 1]
    assert all(r["train_loss"] is None and r["generalisation_gap"] is None for r in records)
    mean, _, n = result.stats("test_accuracy")
    assert n == 2 and mean == pytest.approx(np.mean([result.runs[0].test_accuracy, result.runs[2].test_accuracy]))
    state, meta = ckpt.load(bad.checkpoint_dir)
    assert meta["extra"]["diverged_epoch"] == 1 and all(
        np.all(np.isfinite(x)) for x in jax.tree.leaves(state["params"])
    )


# ------------------------------------------------------------------ bad input, timing


@pytest.mark.parametrize("seeds", [(), (1, 1), (-1,), (0.5,), (True,)])
def test_bad_seeds_are_refused(seeds):
    with pytest.raises(ValueError, match="seeds"):
        sweep.check_seeds(seeds)


def test_default_seeds_follow_config_seed_and_num_seeds():
    config = get_config(seed=5, num_seeds=3)
    assert sweep.default_seeds(config) == (5, 6, 7)
    config.num_seeds = 0
    with pytest.raises(ValueError, match="num_seeds=0"):
        sweep.default_seeds(config)


def test_program_cache_is_owned_by_its_caller():
    """A :class:`naisnet_jax.seeds.ProgramCache` hands back the same programs for a configuration
    that differs only in its seeds and bookkeeping, builds new ones for another learning rate,
    keeps its last ``kept`` configurations, and nothing outlives it: a second cache builds its own."""
    from types import SimpleNamespace

    images = SimpleNamespace(shape=(256, 8, 8, 1))
    ds = SimpleNamespace(num_classes=10, train_images=images, test_images=SimpleNamespace(shape=(100, 8, 8, 1)))
    args = (ds, 4, np.zeros(1), np.ones(1))
    cache = seeds_lib.ProgramCache(kept=2)
    first = cache.get(get_config(), *args)
    assert cache.get(get_config(seed=7, num_epochs=5), *args) is first
    other = cache.get(get_config(learning_rate=0.5), *args)
    assert other is not first and len(cache) == 2
    cache.get(get_config(learning_rate=0.25), *args)  # the oldest entry (first) goes
    assert len(cache) == 2 and cache.get(get_config(), *args) is not first
    assert seeds_lib.ProgramCache().get(get_config(), *args) is not first
    with pytest.raises(ValueError, match="kept=0"):
        seeds_lib.ProgramCache(kept=0)


def test_the_sweep_says_each_seed_it_exports_and_audits(tmp_path, capsys):
    """After the last epoch each seed gets a line: what was done, how long it took, the verdict
    and where its checkpoint is (the audit is otherwise a silent pause after training)."""
    from naisnet_jax.verify import AuditOptions

    config = get_config(num_epochs=1)
    result = sweep.train_sweep(
        config, str(tmp_path), seeds=SEEDS, audit_options=AuditOptions(data="none"), per_step_loss=False
    )
    lines = [line for line in capsys.readouterr().out.splitlines() if " exported" in line]
    assert len(lines) == len(SEEDS)
    for seed, run, line in zip(SEEDS, result.runs, lines):
        verdict = "certified" if run.certified else "not certified"
        where = re.escape(run.checkpoint_dir)
        assert re.fullmatch(
            rf"\[{config.model}\] seed {seed} exported and audited in \d+\.\ds: {verdict} \({where}\)", line
        )


def test_a_sweep_names_config_fields_by_the_flags_that_set_them(nais, tmp_path, capsys):
    _, workdir, _, _, _ = nais
    flags = {"num_epochs": "--epochs", "num_seeds": "--seeds"}
    with pytest.raises(ValueError, match="--epochs=0"):
        sweep.train_sweep(get_config(num_epochs=0), str(tmp_path / "bad"), labels=flags)
    assert not (tmp_path / "bad").exists()
    capsys.readouterr()
    sweep.train_sweep(get_config(), workdir, seeds=SEEDS, audit=False, labels=flags)
    out = capsys.readouterr().out
    assert "holds a complete run of 2 epochs (--epochs=2): nothing left to train; raise --epochs to train on." in out
