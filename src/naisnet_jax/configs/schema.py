"""Every training config field, declared once: its type, default, rule and help.

:data:`FIELDS` is the one list. ``default.get_config()`` is built from it
(:func:`default_config`), :func:`validate` checks a config against it (every message one line
naming the field, the value and what was expected) and fills the fields a config lacks with their
defaults, :data:`RESUME_FIELDS` are the fields a resumed run must share with its checkpoint, and
the command line (``naisnet-train``) reads its types and help from it. Code elsewhere reads
``config.field``: a validated config holds every declared field.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
from collections.abc import Callable, Mapping
from typing import Any

from naisnet_jax.checks import check_bool, check_choice, check_int, check_number, check_positive

#: ``config.fast_path``: ``"auto"`` lets the trainer give a NAIS net trained on a GPU the fused
#: block path (:data:`naisnet_jax.models.GPU_FAST_PATH`) where the config sets no speed option of
#: its own; ``"plain"`` keeps the modules' defaults everywhere.
FAST_PATHS = ("auto", "plain")


@dataclasses.dataclass(frozen=True)
class Field:
    """One config field: ``check(name, value, config)`` raises ``ValueError`` naming ``name``;
    ``optional`` fields may be ``None``; ``resume`` fields must match a checkpoint's to resume it;
    a changed ``notice`` field is said in one line when a run resumes (it changes how training goes on);
    a ``bookkeeping`` field changes where a run reads or writes, how it reports or which (equivalent)
    program runs it, never what it computes;
    ``model`` fields are passed to the model where its class takes them (never through
    ``model_kwargs``: one value for the model, the projection and the checkpoint)."""

    name: str
    type: type
    default: Any
    check: Callable[[str, Any, Any], Any]
    help: str
    optional: bool = False
    resume: bool = False
    notice: bool = False
    model: bool = False
    bookkeeping: bool = False


# ------------------------------------------------------------------ rules


def _int(minimum: int = 1, maximum: int | None = None):
    return lambda name, value, config: check_int(name, value, minimum, maximum)


def _number(lo: float, hi: float, **open_ends):
    return lambda name, value, config: check_number(name, value, lo, hi, **open_ends)


def _bool(name, value, config):
    return check_bool(name, value)


def _positive(name, value, config):
    return check_positive(name, value)


def _string(name, value, config):
    if not isinstance(value, str):
        raise ValueError(f"{name}={value!r} must be a string.")
    return value


def _model(name, value, config):
    from naisnet_jax import models

    return check_choice(name, value, sorted(models.MODELS))


def _keywords(name, value, config):
    if not hasattr(value, "keys") or not all(isinstance(k, str) for k in value.keys()):
        raise ValueError(f"{name}={value!r} must be a mapping of keyword arguments.")
    return value


def _dataset(name, value, config):
    from naisnet_jax import data

    return check_choice(name, value, data.DATASET_NAMES)


def _fast_path(name, value, config):
    return check_choice(name, value, FAST_PATHS)


def _eps(name, value, config):
    from naisnet_jax.parametrize import check_eps

    return check_eps(value, name)


def _eta(name, value, config):
    from naisnet_jax.projection import check_eta

    return check_eta(value, config.eps, name)


def _h(name, value, config):
    from naisnet_jax.cell import check_step_size

    return check_step_size(value, name)


def _epochs(name, value, config):
    bounds = list(value) if isinstance(value, (list, tuple)) else value
    if (
        not isinstance(bounds, list)
        or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in bounds)
        or any(a >= b for a, b in zip(bounds, bounds[1:]))
    ):
        raise ValueError(f"{name}={bounds!r} must be a list of strictly increasing positive epoch numbers.")
    return value


# ------------------------------------------------------------------ the fields

FIELDS: tuple[Field, ...] = (
    # model
    Field("model", str, "naisnet_mnist", _model, "a name of naisnet_jax.models.MODELS", resume=True),
    Field(
        "model_kwargs",
        dict,
        {},
        _keywords,
        "extra keyword arguments of the model (the top-level eps, eta, h, adaptive_tol and max_steps "
        "reach it from the config's top level)",
        resume=True,
    ),
    Field("eps", float, 0.01, _eps, "A = -R^T R - eps I; Algorithm 1's delta = 1 - 2 eps", model=True),
    Field("eta", float, 0.5, _eta, "Algorithm 2: |delta_c| <= 1 - eta (only with learnable delta)", model=True),
    Field("relaxed", bool, False, _bool, "Algorithm 1 with delta = 2 (1 - eps)", resume=True),
    Field("h", float, 0.1, _h, "step size, (0, 1]; h * K = 3 bounds how far a state moves", model=True),
    Field(
        "adaptive_tol",
        float,
        None,
        _positive,
        "stop each pattern when ||x_k - x_{k-1}|| < tol",
        optional=True,
        model=True,
    ),
    Field("max_steps", int, 100, _int(), "bound on the adaptive unroll", model=True),
    Field(
        "fast_path",
        str,
        "auto",
        _fast_path,
        '"auto": on a GPU a NAIS net gets block_vjp="fused", scan_unroll=10 unless model_kwargs sets its '
        'own speed options (same maths); "plain": the modules\' defaults',
        bookkeeping=True,
    ),
    # data
    Field("dataset", str, "fashion_mnist_idx", _dataset, "a name of naisnet_jax.data.DATASET_NAMES", resume=True),
    Field(
        "data_dir",
        str,
        None,
        _string,
        "dataset-specific default (see naisnet_jax.data.load_dataset)",
        optional=True,
        bookkeeping=True,
    ),
    Field("limit_train", int, None, _int(), "use the first n training examples", optional=True, resume=True),
    Field("limit_test", int, None, _int(), "use the first n test examples", optional=True, resume=True),
    Field(
        "validation",
        int,
        None,
        _int(),
        "hold out the last n training examples as the evaluation split, in place of the test set",
        optional=True,
        resume=True,
    ),
    Field("augment", bool, False, _bool, "pad, crop and (augment_flip) mirror the training images", notice=True),
    Field(
        "augment_flip",
        bool,
        True,
        _bool,
        "with augment: also mirror left-right (False: pad and crop only)",
        notice=True,
    ),
    Field(
        "standardize",
        bool,
        True,
        _bool,
        "inputs (x/255 - mean) / std with the training set's channel statistics; False: x/255",
        resume=True,
    ),
    # optimisation (SGD with momentum 0.9, as the paper; its learning rate 0.1 diverges here)
    Field(
        "learning_rate",
        float,
        0.02,
        _number(0, math.inf, lo_open=True, hi_open=True),
        "SGD's learning rate",
        notice=True,
    ),
    Field("momentum", float, 0.9, _number(0, 1, hi_open=True), "SGD's momentum (0: none)", notice=True),
    Field("weight_decay", float, 0.0, _number(0, math.inf, hi_open=True), "decoupled weight decay", notice=True),
    Field(
        "lr_boundaries_epochs",
        tuple,
        (10, 15),
        _epochs,
        "multiply the learning rate by lr_decay_factor here",
        notice=True,
    ),
    Field(
        "lr_decay_factor",
        float,
        0.1,
        _number(0, 1, lo_open=True),
        "the learning rate's factor at each boundary",
        notice=True,
    ),
    Field(
        "lr_warmup_steps",
        int,
        0,
        _int(0),
        "train the first n steps at learning_rate * lr_warmup_factor (He et al.'s ResNet-110 warm-up)",
        notice=True,
    ),
    Field(
        "lr_warmup_factor",
        float,
        0.1,
        _number(0, 1, lo_open=True),
        "the learning rate's factor while warming up",
        notice=True,
    ),
    Field("batch_size", int, 128, _int(), "training batch (split over the devices)", notice=True),
    Field("eval_batch_size", int, 1000, _int(), "evaluation batch", bookkeeping=True),
    Field("num_epochs", int, 20, _int(), "epochs to train"),
    Field("seed", int, 0, _int(0, 2**32 - 1), "initial parameters PRNGKey(seed); batches PRNGKey(seed + 1)"),
    Field("num_seeds", int, 1, _int(), "naisnet_jax.sweep trains seeds seed, seed + 1, ..., side by side"),
    Field(
        "seeds_at_once",
        int,
        None,
        _int(),
        "a sweep runs each device's seeds this many at a time, the groups one after another (None: all at once)",
        optional=True,
        bookkeeping=True,
    ),
    # bookkeeping
    Field(
        "checkpoint_every_epochs",
        int,
        1,
        _int(),
        "save a checkpoint every n epochs (and after the last)",
        bookkeeping=True,
    ),
    Field("keep_checkpoints", int, 3, _int(), "checkpoints kept", bookkeeping=True),
    Field(
        "steps_per_chunk", int, 50, _int(), "train steps per jitted loop (progress bar granularity)", bookkeeping=True
    ),
    Field("progress", bool, True, _bool, "draw a progress bar on a terminal", bookkeeping=True),
    # devices
    Field(
        "num_devices",
        int,
        None,
        _int(),
        "batches are split over this many devices (None: all)",
        optional=True,
        bookkeeping=True,
    ),
    Field(
        "sync_batch_norm",
        bool,
        True,
        _bool,
        "with several devices: BatchNorm by the whole batch (True) or by each device's rows (False)",
    ),
)

BY_NAME: dict[str, Field] = {f.name: f for f in FIELDS}
#: What a resumed run (single or sweep) must share with the checkpoint it resumes.
RESUME_FIELDS: tuple[str, ...] = tuple(f.name for f in FIELDS if f.resume)
#: What a resumed run may change, and is told in one line that it did (the optimisation's settings).
NOTICE_FIELDS: tuple[str, ...] = tuple(f.name for f in FIELDS if f.notice)
#: What decides a run's results: every field but the bookkeeping ones (an experiment reuses a
#: stored result only for a config that agrees on all of them).
RESULT_FIELDS: tuple[str, ...] = tuple(f.name for f in FIELDS if not f.bookkeeping)
#: The top-level fields a model takes where its class has them.
MODEL_FIELDS: tuple[str, ...] = tuple(f.name for f in FIELDS if f.model)


# ------------------------------------------------------------------ configs


def _default_value(f: Field):
    import ml_collections

    if f.type is dict:
        return ml_collections.ConfigDict(dict(f.default))
    if f.default is None:
        return ml_collections.FieldReference(None, field_type=f.type)
    return f.default


def default_config():
    """A ``ml_collections.ConfigDict`` holding every declared field at its default."""
    import ml_collections

    config = ml_collections.ConfigDict()
    for f in FIELDS:
        config[f.name] = _default_value(f)
    return config


def unknown_field_message(name: str, known, prefix: str = "config.") -> str:
    """``"config.x: no such config field; did you mean 'y'?"`` (one line)."""
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; fields here: {', '.join(sorted(known))}."
    return f"{prefix}{name}: no such config field{hint}"


def validate(config, labels: Mapping[str, str] | None = None):
    """Check ``config`` (a ``ConfigDict``) against :data:`FIELDS`, after adding the fields it lacks
    at their defaults (a partial config file, an older run's config); returns it.

    Refuses, with one line naming the field and the value: a field that is not declared, a
    ``None`` in a field that needs a value, and a value its rule rejects. ``labels`` names a
    field as the user set it (``{"num_epochs": "--epochs"}`` for a command's own flag); the
    others are named ``config.<field>``."""
    for name in config.keys():
        if name not in BY_NAME:
            raise ValueError(unknown_field_message(name, BY_NAME))
    missing = [f for f in FIELDS if f.name not in config]
    if missing:
        with config.unlocked():
            for f in missing:
                config[f.name] = _default_value(f)
    for f in FIELDS:
        check_field(f.name, config[f.name], config, label=(labels or {}).get(f.name))
    return config


def check_field(name: str, value, config=None, *, label: str | None = None):
    """``value`` checked by field ``name``'s declared rule (``config``: the rest, for rules that
    read another field; ``label``: the name the error gives it, ``config.<name>`` by default);
    returns it."""
    f = BY_NAME[name]
    if value is None and f.optional:
        return value
    f.check(label or f"config.{name}", value, config)  # None where a value is needed: the rule names it
    return value


def complete(stored: Mapping[str, Any]) -> dict[str, Any]:
    """A stored config (a checkpoint's ``config`` dict) with every declared field: the fields it
    lacks (written by an older version) at their defaults; fields no longer declared are dropped."""
    return {f.name: stored[f.name] if f.name in stored else copy.deepcopy(f.default) for f in FIELDS}
