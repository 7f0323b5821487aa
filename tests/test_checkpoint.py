"""Orbax checkpoints with metadata and digest: round trips, and every kind of damage refused.

A damaged checkpoint must raise ``CheckpointError`` naming its directory, never return arrays
that differ from what was saved, never raise some other exception, and never make training
start again from scratch.
"""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import re
import shutil
import types

import jax
import numpy as np
import optax
import pytest

from naisnet_jax import checkpoint as ckpt
from naisnet_jax import engine, train

pytestmark = pytest.mark.filterwarnings(
    # Orbax leaves asyncio tasks behind when a read fails; harmless, and out of our hands.
    "ignore::pytest.PytestUnraisableExceptionWarning"
)


def metadata(**fields):
    """A valid CheckpointMetadata (model "m": any name; only building the model needs a real one)."""
    base = dict(
        model="m",
        num_classes=10,
        input_shape=(8, 8, 1),
        dataset="digits",
        channel_mean=(0.1,),
        channel_std=(0.9,),
        eps=0.01,
        h=1.0,
        epoch=3,
    )
    return ckpt.CheckpointMetadata(**{**base, **fields})


def sample_tree(seed=0):
    """A tree shaped like training's: int32 step, float32 params, empty batch_stats, optax state."""
    rng = np.random.default_rng(seed)
    params = {
        "block": {
            "R": rng.normal(size=(6, 6)).astype(np.float32),
            "input": {"kernel": rng.normal(size=(64, 6)).astype(np.float32), "bias": np.zeros(6, np.float32)},
        },
        "classifier": {"kernel": rng.normal(size=(6, 10)).astype(np.float32)},
    }
    opt_state = optax.sgd(0.1, momentum=0.9).init(params)
    opt_state = jax.tree.map(lambda x: x + 1.5, opt_state)  # not all zeros
    return {"step": np.asarray(7, np.int32), "params": params, "batch_stats": {}, "opt_state": opt_state}


def assert_trees_equal(a, b, *, structure=True):
    a_leaves, a_def = jax.tree_util.tree_flatten(a)
    b_leaves, b_def = jax.tree_util.tree_flatten(b)
    if structure:
        assert a_def == b_def
    assert len(a_leaves) == len(b_leaves)
    for x, y in zip(a_leaves, b_leaves):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


def write_checkpoint(directory, tree=None, step=7, **fields):
    mngr = ckpt.manager(str(directory))
    ckpt.save(mngr, step, sample_tree() if tree is None else tree, metadata(**fields))
    mngr.close()
    return pathlib.Path(directory)


def files_under(directory):
    return sorted(p for p in pathlib.Path(directory).rglob("*") if p.is_file())


def flip_bytes(path, span=16):
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    for i in range(max(0, mid - span // 2), min(len(data), mid + span // 2)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def assert_refused(directory, *, match=None):
    """``checkpoint.load`` raises CheckpointError naming ``directory`` (resolved)."""
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.load(str(directory))
    message = str(info.value)
    assert os.path.abspath(str(directory)) in message
    if match is not None:
        assert match in message, message
    return message


@pytest.fixture
def no_pickle(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("pickle used while reading a checkpoint")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)


# ----------------------------------------------------------------- round trips


def refused_or_intact(copy, tree) -> int:
    """Load a damaged copy: 1 if refused with an error naming it, 0 if it returned
    exactly the saved arrays (the damage hit a file that read never needs)."""
    try:
        state, _ = ckpt.load(str(copy))
    except ckpt.CheckpointError as e:
        assert str(copy) in str(e)
        return 1
    assert_trees_equal(state, tree, structure=False)
    return 0


def test_save_load_round_trip_with_metadata(tmp_path, no_pickle):
    tree = sample_tree()
    write_checkpoint(tmp_path, tree, step=7, config={"eps": 0.01, "boundaries": [1, 2]})
    state, meta = ckpt.load(str(tmp_path))
    assert_trees_equal(state, tree, structure=False)  # NamedTuples come back as plain containers
    assert state["batch_stats"] == {}
    assert meta["format"] == ckpt.FORMAT and meta["format_version"] == ckpt.FORMAT_VERSION
    assert meta["step"] == 7 and meta["epoch"] == 3 and meta["model"] == "m"
    assert meta["config"] == {"eps": 0.01, "boundaries": [1, 2]}
    assert meta["digest"] == ckpt.tree_digest(tree)
    # The digest ignores container types: the plain-container tree digests like the original.
    assert ckpt.tree_digest(state) == ckpt.tree_digest(tree)


def test_restore_with_a_target_keeps_the_structure(tmp_path, no_pickle):
    tree = sample_tree()
    mngr = ckpt.manager(str(write_checkpoint(tmp_path, tree)))
    target = jax.tree.map(np.zeros_like, tree)
    state, meta = ckpt.restore(mngr, target=target)
    mngr.close()
    assert_trees_equal(state, tree)  # NamedTuples of the optax state included
    assert meta["epoch"] == 3


def mixed_tree():
    """A training tree with a numpy scalar and a Python int beside the arrays."""
    return {**sample_tree(), "scale": np.float32(2.5), "count": 3}


def orbax_standard_manager(directory):
    """A manager as Orbax makes one by default for our two items: its standard handler for
    ``state``, and Orbax's global type handlers."""
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(str(directory), item_names=("state", "metadata"))


def test_orbax_global_type_handlers_are_untouched(tmp_path):
    """Saving and restoring through this module leaves Orbax's process-wide registry as Orbax
    made it: the settled writers live only in the managers' own registries."""
    import orbax.checkpoint as ocp

    handlers = ocp.type_handlers
    write_checkpoint(tmp_path, mixed_tree())
    ckpt.load(str(tmp_path))
    assert type(handlers.get_type_handler(np.ndarray)) is handlers.NumpyHandler
    for ty in (int, float, bytes, np.number):
        assert type(handlers.get_type_handler(ty)) is handlers.ScalarHandler
    own = ckpt.type_handler_registry()
    assert own is not ckpt.type_handler_registry()  # a new registry each time, owned by its manager
    assert isinstance(own.get(np.ndarray), handlers.NumpyHandler)
    assert own.get(np.ndarray).typestr() == "np.ndarray" and own.get(np.float32).typestr() == "scalar"
    assert own.get(jax.Array) is handlers.get_type_handler(jax.Array)  # Orbax's own, for other types


def test_a_checkpoint_of_orbax_standard_handler_loads(tmp_path, no_pickle):
    """A checkpoint written as this module wrote them with Orbax's standard handler and global
    registry (``StandardSave``) loads, digest checked."""
    import orbax.checkpoint as ocp

    tree = jax.device_get(mixed_tree())  # numpy, as save() hands it to Orbax
    meta = metadata().replace(step=7, digest=ckpt.tree_digest(tree)).to_json()
    meta.update(format=ckpt.FORMAT, format_version=ckpt.FORMAT_VERSION)
    mngr = orbax_standard_manager(tmp_path)
    mngr.save(7, args=ocp.args.Composite(state=ocp.args.StandardSave(tree), metadata=ocp.args.JsonSave(meta)))
    mngr.wait_until_finished()
    mngr.close()
    state, loaded = ckpt.load(str(tmp_path))
    assert_trees_equal(state, tree, structure=False)
    assert loaded == meta


def test_a_checkpoint_of_this_module_loads_with_orbax_standard_handler(tmp_path):
    """The other way: Orbax's standard handler over its global registry reads what
    :func:`checkpoint.save` writes, and both write the same tree metadata (value types
    included: a numpy scalar is a 0-d ``np.ndarray``, a Python int a ``scalar``)."""
    import orbax.checkpoint as ocp

    tree = mixed_tree()
    write_checkpoint(tmp_path / "ours", tree)
    mngr = orbax_standard_manager(tmp_path / "ours")
    restored = mngr.restore(
        7, args=ocp.args.Composite(state=ocp.args.StandardRestore(), metadata=ocp.args.JsonRestore())
    )
    mngr.close()
    assert_trees_equal(restored["state"], tree, structure=False)
    assert restored["metadata"]["digest"] == ckpt.tree_digest(tree)

    mngr = orbax_standard_manager(tmp_path / "standard")
    mngr.save(7, args=ocp.args.Composite(state=ocp.args.StandardSave(jax.device_get(tree))))  # as save() does
    mngr.wait_until_finished()
    mngr.close()
    layouts = [json.loads((tmp_path / d / "7" / "state" / "_METADATA").read_text()) for d in ("ours", "standard")]
    assert layouts[0] == layouts[1]


def test_load_a_step_directory_and_pick_steps(tmp_path):
    mngr = ckpt.manager(str(tmp_path), max_to_keep=2)
    for step in (1, 2, 3):
        ckpt.save(mngr, step, sample_tree(seed=step), metadata(epoch=step))
    mngr.close()
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [2, 3]  # max_to_keep
    assert ckpt.latest_step(str(tmp_path)) == 3
    assert ckpt.latest_step(str(tmp_path / "missing")) is None
    state, meta = ckpt.load(str(tmp_path / "2"))
    assert meta["epoch"] == 2
    assert_trees_equal(state, sample_tree(seed=2), structure=False)
    assert ckpt.load(str(tmp_path), step=2)[1]["epoch"] == 2
    assert ckpt.load(str(tmp_path))[1]["epoch"] == 3
    with pytest.raises(
        ckpt.CheckpointError, match=rf"^{re.escape(str(tmp_path))} has no step 1; its steps: \[2, 3\]\.$"
    ):
        ckpt.load(str(tmp_path), step=1)  # deleted by max_to_keep
    for bad in (-1, "x", 2.5):
        with pytest.raises(ValueError, match=rf"^step={bad!r} must be a non-negative integer"):
            ckpt.load(str(tmp_path), step=bad)


def test_metadata_that_is_not_json_is_refused_before_writing(tmp_path):
    mngr = ckpt.manager(str(tmp_path))
    with pytest.raises(ckpt.CheckpointError, match="not JSON"):
        ckpt.save(mngr, 1, sample_tree(), metadata(config={"bad": object()}))
    with pytest.raises(TypeError, match="CheckpointMetadata"):  # a hand-made dict has no owner
        ckpt.save(mngr, 1, sample_tree(), {"epoch": 1, "model": "m"})
    assert mngr.all_steps() == [] and not any(tmp_path.iterdir())
    mngr.close()


# ----------------------------------------------------------------- the metadata schema


def test_metadata_round_trips_and_stores_eps_and_h_once(tmp_path):
    meta = metadata(model_kwargs={"features": 8, "stage_sizes": (1, 2)}, config={"a": [1, 2]}, relaxed=True)
    again = ckpt.CheckpointMetadata.from_json(json.loads(json.dumps(meta.to_json())))
    assert again == meta
    assert meta.to_json()["metadata_version"] == ckpt.METADATA_VERSION
    write_checkpoint(tmp_path, model_kwargs={"features": 8}, eps=0.02, h=0.5)
    _, raw = ckpt.load(str(tmp_path))
    assert "eps" not in raw["model_kwargs"] and "h" not in raw["model_kwargs"]
    stored = ckpt.CheckpointMetadata.from_json(raw)
    assert (stored.eps, stored.h, stored.step, stored.digest) == (0.02, 0.5, 7, raw["digest"])


def test_metadata_from_config_builds_the_trained_model():
    from naisnet_jax.configs import default

    config = default.get_config()
    config.model, config.dataset = "naisnet_fc_tiny", "digits"
    config.eps, config.h = 0.05, 0.5
    config.model_kwargs.features = 5
    ds = types.SimpleNamespace(num_classes=3, train_images=np.zeros((4, 8, 8, 1), np.uint8))
    kwargs = train.model_kwargs(config)
    meta = ckpt.CheckpointMetadata.from_config(config, ds, np.array([0.2]), np.array([0.3]), model_kwargs=kwargs)
    assert meta.model_kwargs == {
        "features": 5,
        **({"max_steps": config.max_steps} if "max_steps" in meta.model_kwargs else {}),
    }
    model = meta.build_model()
    assert (model.eps, model.h, model.features, model.num_classes) == (0.05, 0.5, 5, 3)
    assert meta.input_shape == (8, 8, 1) and meta.channel_std == (0.3,)


def test_training_and_the_checkpoint_share_one_model_spec():
    """The trainers build the network from ``train.model_spec(config)`` and the checkpoint's
    metadata rebuilds the same one: the two specs are equal, adaptive fields included."""
    from naisnet_jax.configs import default

    config = default.get_config()
    config.model, config.dataset = "naisnet_conv_tiny", "digits"
    config.eps, config.h, config.adaptive_tol, config.max_steps = 0.05, 0.5, 1e-3, 7
    config.model_kwargs.steps = 3
    ds = types.SimpleNamespace(num_classes=3, train_images=np.zeros((4, 8, 8, 1), np.uint8))
    kwargs = train.model_kwargs(config)
    meta = ckpt.CheckpointMetadata.from_config(config, ds, np.array([0.2]), np.array([0.3]), model_kwargs=kwargs)
    name, kwargs = train.model_spec(config)
    assert meta.model_spec() == (name, kwargs)
    assert kwargs["adaptive_tol"] == 1e-3 and kwargs["max_steps"] == 7 and kwargs["h"] == 0.5
    assert set(meta.model_kwargs) == {"steps", "adaptive_tol", "max_steps"}  # eps, eta, h stored once
    config.model_kwargs.h = 0.25
    with pytest.raises(ValueError, match=r"sets \['h'\]; set config.h instead"):
        train.model_spec(config)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("eps", 1e-8, "float32 floor"),
        ("eps", 0.7, r"outside \(0, 0.5\)"),
        ("h", 1.5, "h=1.5"),
        ("num_classes", 0, "num_classes"),
        ("input_shape", (8, -1), "input_shape"),
        ("channel_std", (0.0,), "channel_std"),
        ("channel_mean", (0.1, 0.2), "channel_mean"),
        ("model_kwargs", {"eps": 0.01}, r"no \['eps'\]"),
        ("epoch", -1, "epoch"),
        ("model", "", "model"),
    ],
)
def test_metadata_refuses_bad_fields_naming_them(field, value, match):
    with pytest.raises(ckpt.CheckpointError, match=match):
        metadata(**{field: value})


def test_version_1_metadata_is_read_and_must_agree_with_itself():
    v1 = {
        "model": "naisnet_fc_tiny",
        "model_kwargs": {"features": 4, "eps": 0.05, "h": 0.5},
        "num_classes": 3,
        "input_shape": [8, 8, 1],
        "dataset": "digits",
        "channel_mean": [0.0],
        "channel_std": [1.0],
        "eps": 0.05,
        "eta": 0.5,
        "h": 0.5,
        "relaxed": False,
        "config": {},
        "epoch": 1,
        "format": "naisnet-jax",
        "format_version": 1,
        "step": 2,
        "digest": "ab",
    }
    meta = ckpt.CheckpointMetadata.from_json(v1)
    assert meta.model_kwargs == {"features": 4} and meta.h == 0.5 and meta.step == 2
    with pytest.raises(ckpt.CheckpointError, match="h=1.0 disagrees with model_kwargs h=0.5"):
        ckpt.CheckpointMetadata.from_json(dict(v1, h=1.0))
    with pytest.raises(ckpt.CheckpointError, match=r"lacks \['eps'\]"):
        ckpt.CheckpointMetadata.from_json({k: v for k, v in v1.items() if k != "eps"})


# ----------------------------------------------------------------- damaged checkpoints


def test_flipped_bytes_in_array_data_are_refused(tmp_path, no_pickle):
    """(a) Each data file under ``<step>/state/``: corrupt it, then the load either fails with
    CheckpointError or (for a file the reader never opens) returns exactly the saved arrays."""
    tree = sample_tree()
    source = write_checkpoint(tmp_path / "source", tree)
    data_files = [p for p in files_under(source / "7" / "state") if p.parent.name == "d"]
    assert data_files, "no array data files found under <step>/state/**/d/"
    refused = 0
    for i, path in enumerate(data_files):
        copy = tmp_path / f"copy{i}"
        shutil.copytree(source, copy)
        flip_bytes(copy / path.relative_to(source))
        refused += refused_or_intact(copy, tree)
    assert refused >= 1


def test_wrong_digest_is_refused(tmp_path):
    # Arrays intact, but they do not match the digest written with them (as when array bytes
    # change in a way the storage layer cannot see).
    source = write_checkpoint(tmp_path)
    meta_file = source / "7" / "metadata" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["digest"] = "0" * 64
    meta_file.write_text(json.dumps(meta))
    assert_refused(source, match="digest")


@pytest.mark.parametrize("relative", ["7/state/_METADATA", "7/state/manifest.ocdbt", "7/metadata/metadata"])
def test_deleted_essential_file_is_refused(tmp_path, relative):
    """(b) Deleting a file every read needs."""
    source = write_checkpoint(tmp_path)
    (source / relative).unlink()
    assert_refused(source)


def test_every_deleted_or_truncated_file_is_refused_or_harmless(tmp_path):
    """(b) Any single file deleted or truncated: refused, or the exact saved arrays."""
    tree = sample_tree()
    source = write_checkpoint(tmp_path / "source", tree)
    refused = 0
    for i, path in enumerate(files_under(source / "7")):
        for mode in ("delete", "truncate"):
            copy = tmp_path / f"{mode}{i}"
            shutil.copytree(source, copy)
            target = copy / path.relative_to(source)
            if mode == "delete":
                target.unlink()
            else:
                target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
            refused += refused_or_intact(copy, tree)
    assert refused >= 4


@pytest.mark.parametrize(
    "content, match",
    [
        (b"\x00\xffnot json at all{{", "metadata"),
        (b"", "metadata"),
        (json.dumps({"format": "someone-else", "digest": "x"}).encode(), "not a naisnet-jax checkpoint"),
        (json.dumps([1, 2, 3]).encode(), "not a naisnet-jax checkpoint"),
        (json.dumps({"format": ckpt.FORMAT, "format_version": 99}).encode(), "format_version"),
    ],
    ids=["garbage", "empty", "foreign-format", "json-list", "future-version"],
)
def test_bad_metadata_is_refused(tmp_path, content, match):
    """(c) The metadata JSON replaced with garbage, or a valid JSON that is not ours."""
    source = write_checkpoint(tmp_path)
    (source / "7" / "metadata" / "metadata").write_bytes(content)
    assert_refused(source, match=match)


def test_foreign_orbax_checkpoint_is_refused(tmp_path):
    import orbax.checkpoint as ocp

    mngr = ocp.CheckpointManager(str(tmp_path))
    mngr.save(1, args=ocp.args.StandardSave(sample_tree()["params"]))
    mngr.wait_until_finished()
    mngr.close()
    assert_refused(tmp_path, match="metadata")


def test_directory_of_random_garbage_is_refused(tmp_path):
    """(d) Random files, including a step-like numeric folder full of them."""
    rng = np.random.default_rng(0)
    for name in ("a.bin", "_CHECKPOINT_METADATA", "5/state/_METADATA", "5/metadata/metadata", "5/junk"):
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.bytes(200))
    assert_refused(tmp_path)


def test_empty_and_missing_directories_are_refused(tmp_path):
    """(e) An empty directory, and one that does not exist."""
    assert_refused(tmp_path)
    assert_refused(tmp_path / "does-not-exist")
    assert not (tmp_path / "does-not-exist").exists()  # loading creates nothing


def test_a_step_with_uncommitted_partial_save_is_ignored(tmp_path):
    # A save interrupted mid-write leaves Orbax's temporary folder; it is not a step.
    tree = sample_tree()
    source = write_checkpoint(tmp_path, tree)
    partial = tmp_path / "9.orbax-checkpoint-tmp-1234567890"
    shutil.copytree(source / "7", partial)
    for path in files_under(partial / "state"):
        path.write_bytes(b"")
    state, meta = ckpt.load(str(tmp_path))
    assert meta["step"] == 7
    assert_trees_equal(state, tree, structure=False)


def test_failed_restore_leaves_the_target_untouched(tmp_path):
    source = write_checkpoint(tmp_path)
    for path in files_under(source / "7" / "state"):
        if path.parent.name == "d":
            flip_bytes(path)
    target = jax.tree.map(np.zeros_like, sample_tree())
    before = jax.tree.map(np.copy, target)
    mngr = ckpt.manager(str(source), create=False)
    with pytest.raises(ckpt.CheckpointError, match=str(source)):
        ckpt.restore(mngr, target=target)
    mngr.close()
    assert_trees_equal(target, before)


# ----------------------------------------------------------------- training refuses them too


@pytest.fixture(scope="module")
def trained_workdir(tmp_path_factory):
    """Two epochs of a tiny NAIS-Net on 128 digits: checkpoints at steps 2 and 4."""
    config = tiny_config()
    workdir = tmp_path_factory.mktemp("trained")
    train.train_and_evaluate(config, str(workdir))
    return workdir


def tiny_config():
    from naisnet_jax.configs import default

    config = default.get_config()
    config.dataset, config.eval_batch_size = "digits", 128
    config.limit_train, config.limit_test = 128, 64
    config.batch_size, config.num_epochs, config.progress = 64, 2, False
    config.model_kwargs.features, config.model_kwargs.steps = 4, 2
    return config


def corrupt_state_data(step_dir):
    for path in files_under(step_dir / "state"):
        if path.parent.name == "d":
            flip_bytes(path)


def garble_metadata(step_dir):
    (step_dir / "metadata" / "metadata").write_bytes(b"\x89garbage")


def delete_state_metadata(step_dir):
    (step_dir / "state" / "_METADATA").unlink()


@pytest.mark.parametrize("damage", [corrupt_state_data, garble_metadata, delete_state_metadata])
def test_training_resumes_from_the_newest_intact_checkpoint(trained_workdir, tmp_path, damage, no_pickle, capsys):
    """The newest step damaged: training resumes from the intact step before it (one warning
    naming both), sets the damaged step aside (kept, out of Orbax's sight) and saves that step
    again; the metrics log is rewound to the step it resumed from."""
    workdir = tmp_path / "work"
    shutil.copytree(trained_workdir, workdir)
    checkpoints = workdir / train.CHECKPOINT_DIR
    assert sorted(p.name for p in checkpoints.iterdir()) == ["2", "4"]
    damage(checkpoints / "4")
    config = tiny_config()
    config.num_epochs = 3
    train.train_and_evaluate(config, str(workdir))
    out, err = capsys.readouterr()
    (warning,) = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert f"checkpoint step 4 in {checkpoints} is damaged (" in warning and "; using step 2" in warning
    assert "Resuming from" in out and "at epoch 2 (step 2)" in out
    assert sorted(p.name for p in checkpoints.iterdir()) == ["2", "4", "4.damaged", "6"]
    assert [r["epoch"] for r in engine.read_metrics(workdir / train.METRICS_FILE)] == [1, 2, 3]
    assert ckpt.load(str(checkpoints))[1]["epoch"] == 3


def test_training_refuses_a_directory_without_an_intact_checkpoint(trained_workdir, tmp_path, no_pickle):
    workdir = tmp_path / "work"
    shutil.copytree(trained_workdir, workdir)
    checkpoints = workdir / train.CHECKPOINT_DIR
    corrupt_state_data(checkpoints / "4")
    garble_metadata(checkpoints / "2")
    metrics_before = (workdir / train.METRICS_FILE).read_text()
    config = tiny_config()
    config.num_epochs = 3  # there is work left, so a silent restart would train
    with pytest.raises(ckpt.NoIntactCheckpoint) as info:
        train.train_and_evaluate(config, str(workdir))
    message = str(info.value)
    assert str(checkpoints) in message and "step 4: " in message and "step 2: " in message
    assert [d.step for d in info.value.damaged] == [4, 2]
    # Nothing was trained, rewritten, moved or deleted: no fresh start over damaged checkpoints.
    assert (workdir / train.METRICS_FILE).read_text() == metrics_before
    assert sorted(p.name for p in checkpoints.iterdir()) == ["2", "4"]


def test_damage_reasons_are_one_short_line():
    long = "OUT_OF_RANGE: Error reading x. See full TensorStore details: <bound method ...{'driver': 'zarr'}>\nmore"
    assert ckpt.short_reason(ValueError(long)) == "ValueError: OUT_OF_RANGE: Error reading x."
    cut = ckpt.short_reason(ValueError("y" * 1000))
    assert len(cut) == ckpt.REASON_CHARS and cut.endswith("...") and "\n" not in cut


def test_trained_checkpoint_loads_without_pickle(trained_workdir, no_pickle):
    state, meta = ckpt.load(str(trained_workdir / train.CHECKPOINT_DIR))
    assert meta["epoch"] == 2 and meta["step"] == 4 and meta["model"] == "naisnet_mnist"
    assert set(state) == {"step", "params", "batch_stats", "opt_state"}
    assert int(state["step"]) == 4
