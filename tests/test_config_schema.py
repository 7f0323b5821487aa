"""The config's one declaration (:mod:`naisnet_jax.configs.schema`): the default config, the
validation, the resume fields and the stored-config reading all come from it, and no code reads a
config field with a default of its own (``config.get(name, default)``)."""

from __future__ import annotations

import pathlib
import re

import ml_collections
import pytest

from naisnet_jax import engine, train
from naisnet_jax.configs import default, schema

REPO = pathlib.Path(__file__).resolve().parents[1]

# A value of the wrong kind for every declared type.
BAD_BY_TYPE = {int: "many", float: "small", bool: 2, str: 3, tuple: "abc", dict: 3}


def test_every_default_field_is_declared_and_every_declared_field_is_in_the_default():
    config = default.get_config()
    assert sorted(config.keys()) == sorted(f.name for f in schema.FIELDS)
    for f in schema.FIELDS:
        expected = ml_collections.ConfigDict if f.type is dict else f.type
        assert config.get_type(f.name) is expected, f.name
        value = config[f.name]
        assert (value.to_dict() if f.type is dict else value) == f.default, f.name
        assert f.help and "\n" not in f.help, f.name
    schema.validate(config)  # the defaults pass their own rules


@pytest.mark.parametrize("field", [f.name for f in schema.FIELDS])
def test_a_bad_value_of_every_field_is_refused_in_one_line_naming_it(field):
    config = default.get_config()
    with config.ignore_type():
        config[field] = BAD_BY_TYPE[schema.BY_NAME[field].type]
    with pytest.raises(ValueError) as info:
        train.validate_config(config)
    message = str(info.value)
    assert message.startswith(f"config.{field}=") and "\n" not in message, message


def test_a_field_a_command_sets_by_its_own_flag_is_named_by_that_flag():
    config = default.get_config()
    config.num_epochs, config.h = 0, 0.5
    with pytest.raises(ValueError, match=r"^--epochs=0 must be a positive integer\.$"):
        schema.validate(config, labels={"num_epochs": "--epochs", "h": "--h"})
    config.num_epochs, config.h = 1, 2.0
    with pytest.raises(ValueError, match=r"^--h=2\.0 is outside \(0, 1\]"):
        schema.validate(config, labels={"num_epochs": "--epochs", "h": "--h"})
    with pytest.raises(ValueError, match=r"^config\.h=2\.0 "):
        schema.validate(config, labels={"num_epochs": "--epochs"})


@pytest.mark.parametrize("field", [f.name for f in schema.FIELDS if not f.optional])
def test_none_in_a_field_that_needs_a_value_is_refused(field):
    config = default.get_config()
    with config.ignore_type():
        config[field] = None
    with pytest.raises(ValueError, match=rf"^config\.{field}=None ") as info:
        train.validate_config(config)
    assert "\n" not in str(info.value)


def test_a_partial_config_is_completed_and_an_unknown_field_refused():
    config = ml_collections.ConfigDict({"model": "naisnet_fc_tiny", "dataset": "digits", "h": 0.5})
    config.lock()
    assert train.validate_config(config) is config
    assert list(config.keys()) == sorted(f.name for f in schema.FIELDS)  # ConfigDict sorts its keys
    assert config.h == 0.5 and config.eps == schema.BY_NAME["eps"].default and config.limit_train is None
    config = default.get_config()
    config.learning_rat = 0.1
    with pytest.raises(ValueError, match=r"^config\.learning_rat: no such config field; did you mean 'learning_rate'"):
        train.validate_config(config)


def test_a_stored_config_of_an_older_version_reads_with_the_declared_defaults():
    stored = {"model": "naisnet_fc_tiny", "dataset": "digits", "gone": 1}  # fields added later, one removed
    full = schema.complete(stored)
    assert list(full) == [f.name for f in schema.FIELDS]
    assert full["model"] == "naisnet_fc_tiny" and full["standardize"] is True and full["validation"] is None


def test_resume_and_model_fields_come_from_the_declaration():
    assert engine.RESUME_FIELDS == (*schema.RESUME_FIELDS, "seeds")
    assert {"model", "model_kwargs", "dataset", "validation", "standardize"} <= set(schema.RESUME_FIELDS)
    assert "batch_size" not in schema.RESUME_FIELDS and "batch_size" in engine.NOTICE_FIELDS  # said, not refused
    assert set(schema.MODEL_FIELDS) == {"eps", "eta", "h", "adaptive_tol", "max_steps"}


def test_no_code_reads_a_config_field_with_its_own_default():
    """``config.get(`` (and ``cfg.get(``, ``meta.config.get(``) appears only in the config's own
    module: a validated config holds every declared field."""
    pattern = re.compile(r"\b(config|cfg|conf)\.get\(")
    own = REPO / "src" / "naisnet_jax" / "configs" / "schema.py"
    found = []
    for folder in ("src", "experiments", "verify", "benchmarks"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path == own:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_a_single_run_resumes_only_with_the_same_declared_resume_fields(tmp_path):
    import types

    import numpy as np

    from naisnet_jax import checkpoint as ckpt

    config = default.get_config()
    config.model, config.dataset = "naisnet_fc_tiny", "digits"
    ds = types.SimpleNamespace(num_classes=3, train_images=np.zeros((4, 8, 8, 1), np.uint8))
    meta = ckpt.CheckpointMetadata.from_config(
        config, ds, np.array([0.2]), np.array([0.3]), model_kwargs=train.model_kwargs(config)
    ).to_json()
    meta.update(format_version=ckpt.FORMAT_VERSION)
    run = engine.RunDirectory(str(tmp_path), engine.resume_view(config, train.model_kwargs(config), [config.seed]))
    run.refuse(meta)
    older = dict(meta, config={k: v for k, v in meta["config"].items() if k not in ("standardize", "validation")})
    run.refuse(older)  # fields an older version did not store: their defaults
    config.standardize = False
    run = engine.RunDirectory(str(tmp_path), engine.resume_view(config, train.model_kwargs(config), [config.seed]))
    with pytest.raises(ValueError, match=r"differs from this one \(standardize: checkpoint True, now False\)") as info:
        run.refuse(older)
    assert "\n" not in str(info.value)
