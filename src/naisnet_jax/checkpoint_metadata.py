"""What a naisnet-jax checkpoint holds: :class:`CheckpointMetadata`, the one validated schema that
training writes beside the arrays and the verifier reads (:mod:`naisnet_jax.checkpoint` stores
it), and :class:`CheckpointError`, what every refused checkpoint raises."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from naisnet_jax.checks import check_bool, check_int, check_number


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, or not a naisnet-jax checkpoint."""


METADATA_VERSION = 2
_STORED_ONCE = ("eps", "eta", "h")  # top-level fields, never repeated in model_kwargs


def _json_ready(value):
    """A JSON-able copy (tuples become lists; ConfigDicts and mappings become dicts)."""
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    if isinstance(value, Mapping):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


@dataclasses.dataclass(frozen=True)
class CheckpointMetadata:
    """What a naisnet-jax checkpoint holds: the one schema training writes and the verifier reads.

    ``model`` / ``model_kwargs`` / ``num_classes`` rebuild the network
    (:meth:`build_model`); ``eps``, ``eta`` and ``h`` are stored once, here,
    and passed to the model where it takes them (``model_kwargs`` may not
    repeat them); ``input_shape``, ``dataset``, ``channel_mean`` and
    ``channel_std`` say what the network reads and how inputs are normalised;
    ``relaxed`` is Algorithm 1's bound; ``config`` the training config as a
    dict; ``epoch`` the last finished epoch; ``extra`` JSON data of other
    owners (the sweep engine's resume view, an exported seed's divergence). ``step`` and ``digest`` are set
    by :func:`save`. Every field is validated on construction
    (:class:`CheckpointError` names the field); :meth:`to_json` /
    :meth:`from_json` round-trip, and :meth:`from_json` also reads the
    version-1 metadata of earlier checkpoints (eps and h repeated in
    ``model_kwargs``, refused when the two disagree).
    """

    model: str
    num_classes: int
    input_shape: tuple[int, ...]
    dataset: str
    channel_mean: tuple[float, ...]
    channel_std: tuple[float, ...]
    eps: float
    h: float
    eta: float = 0.5
    relaxed: bool = False
    model_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    epoch: int | None = None
    step: int | None = None
    digest: str | None = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        try:
            self._check_and_normalise()
        except ValueError as e:
            raise CheckpointError(f"checkpoint metadata: {e}") from None
        object.__setattr__(self, "model_kwargs", _json_ready(self.model_kwargs))
        object.__setattr__(self, "config", _json_ready(self.config))
        object.__setattr__(self, "extra", _json_ready(self.extra))
        try:
            json.dumps(self.to_json(), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"checkpoint metadata is not JSON: {e}") from None

    def _check_and_normalise(self):
        """Check every field with the package's shared checks (``ValueError`` naming it) and
        store tuples, floats and plain dicts."""
        from naisnet_jax.cell import check_step_size
        from naisnet_jax.parametrize import check_eps
        from naisnet_jax.projection import check_eta

        for field in ("model", "dataset"):
            if not isinstance(getattr(self, field), str) or not getattr(self, field):
                raise ValueError(f"{field}={getattr(self, field)!r} must be a non-empty string.")
        check_int("num_classes", self.num_classes)
        try:
            shape = tuple(self.input_shape)
        except TypeError:
            shape = ()
        if not shape:
            raise ValueError(f"input_shape={self.input_shape!r} must be a non-empty sequence of positive integers.")
        for i, d in enumerate(shape):
            check_int(f"input_shape[{i}]", d)
        object.__setattr__(self, "input_shape", tuple(int(d) for d in shape))
        channels = self.input_shape[-1]
        for field, lo in (("channel_mean", -math.inf), ("channel_std", 0.0)):
            try:
                values = tuple(getattr(self, field))
            except TypeError:
                values = None
            if values is None or len(values) != channels:
                raise ValueError(f"{field}={getattr(self, field)!r} must be {channels} numbers, one per input channel.")
            for i, v in enumerate(values):
                check_number(f"{field}[{i}]", v, lo, math.inf, lo_open=True, hi_open=True)
            object.__setattr__(self, field, tuple(float(v) for v in values))
        check_eps(self.eps)
        check_eta(self.eta, self.eps)
        check_step_size(self.h)
        for field in ("eps", "h", "eta"):
            object.__setattr__(self, field, float(getattr(self, field)))
        check_bool("relaxed", self.relaxed)
        for field in ("model_kwargs", "config", "extra"):  # ConfigDicts become plain dicts
            if hasattr(getattr(self, field), "to_dict"):
                object.__setattr__(self, field, getattr(self, field).to_dict())
        if not isinstance(self.model_kwargs, Mapping) or not all(isinstance(k, str) for k in self.model_kwargs):
            raise ValueError(f"model_kwargs={self.model_kwargs!r} must be a mapping of keyword arguments.")
        repeated = sorted(set(self.model_kwargs) & set(_STORED_ONCE))
        if repeated:
            raise ValueError(
                f"model_kwargs={self.model_kwargs!r} must hold no {repeated} (stored once, as top-level fields)."
            )
        for field in ("config", "extra"):
            if not isinstance(getattr(self, field), Mapping):
                raise ValueError(f"{field}={getattr(self, field)!r} must be a mapping.")
        for field in ("epoch", "step"):
            if getattr(self, field) is not None:
                check_int(field, getattr(self, field), 0)
        if self.digest is not None and not isinstance(self.digest, str):
            raise ValueError(f"digest={self.digest!r} must be a hex string or None.")

    # ------------------------------------------------------------ constructors

    @classmethod
    def from_config(
        cls, config, dataset, mean, std, *, model_kwargs: Mapping[str, Any], epoch: int | None = None
    ) -> CheckpointMetadata:
        """The metadata of a run of ``config`` on ``dataset`` (an object with ``num_classes``
        and ``train_images``) normalised with per-channel ``mean`` and ``std``, whose network
        takes ``model_kwargs`` (the trainer's :func:`naisnet_jax.train.model_spec`).

        ``model_kwargs`` are stored less ``eps``, ``eta`` and ``h``, which (with ``relaxed``) are
        stored once, as top-level fields. The one entry point for the trainer and the sweep engine.
        """
        kwargs = {k: v for k, v in _json_ready(model_kwargs).items() if k not in _STORED_ONCE}
        return cls(
            model=config.model,
            model_kwargs=kwargs,
            num_classes=int(dataset.num_classes),
            input_shape=tuple(int(d) for d in dataset.train_images.shape[1:]),
            dataset=config.dataset,
            channel_mean=tuple(float(v) for v in np.ravel(mean)),
            channel_std=tuple(float(v) for v in np.ravel(std)),
            eps=config.eps,
            eta=config.eta,
            h=config.h,
            relaxed=bool(config.relaxed),
            config=config,
            epoch=epoch,
        )

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CheckpointMetadata:
        """Validated metadata from its JSON dict (as :func:`restore` returns it).

        Reads both versions: 2 (this one) and 1 (``model_kwargs`` repeating
        ``eps`` / ``eta`` / ``h``, which must then agree with the top-level fields).
        Keys written by :func:`save` around the metadata (``format``...) are ignored.
        """
        if not isinstance(data, Mapping):
            raise CheckpointError(f"checkpoint metadata must be a JSON object; got {type(data).__name__}.")
        version = data.get("metadata_version", 1)
        if version not in (1, METADATA_VERSION):
            raise CheckpointError(f"checkpoint metadata_version={version!r}; this code reads 1 and {METADATA_VERSION}.")
        fields = {f.name for f in dataclasses.fields(cls)}
        required = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        missing = [k for k in required if k not in data]
        if missing:
            raise CheckpointError(f"the checkpoint's metadata lacks {missing}; it was not written by naisnet-jax.")
        values = {k: data[k] for k in fields if k in data}
        kwargs = dict(values.get("model_kwargs") or {})
        for field in _STORED_ONCE:  # version 1 repeated these in model_kwargs
            if field in kwargs:
                top = values.get(field, kwargs[field])
                if not isinstance(kwargs[field], (int, float)) or not math.isclose(
                    float(kwargs[field]), float(top), rel_tol=1e-12, abs_tol=0
                ):
                    raise CheckpointError(
                        f"the metadata's {field}={top!r} disagrees with model_kwargs {field}={kwargs[field]!r}; "
                        f"the checkpoint does not say which one the network ran with."
                    )
                values.setdefault(field, kwargs.pop(field))
                kwargs.pop(field, None)
        values["model_kwargs"] = kwargs
        try:
            return cls(**values)
        except TypeError as e:
            raise CheckpointError(f"checkpoint metadata: {e}") from None

    def to_json(self) -> dict[str, Any]:
        """The JSON dict written next to the arrays (``metadata_version`` 2)."""
        out = {f.name: _json_ready(getattr(self, f.name)) for f in dataclasses.fields(self)}
        out["metadata_version"] = METADATA_VERSION
        return out

    def replace(self, **changes) -> CheckpointMetadata:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ model

    def model_spec(self) -> tuple[str, dict[str, Any]]:
        """``(model, keyword arguments)`` that rebuild the network: ``model_kwargs`` plus
        ``eps`` / ``eta`` / ``h`` where the model takes them."""
        from naisnet_jax import models

        kwargs = dict(self.model_kwargs)
        if self.model in models.MODELS:
            accepted = models.accepted_fields(self.model)
            kwargs.update({k: getattr(self, k) for k in _STORED_ONCE if k in accepted})
        kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()}
        return self.model, kwargs

    def build_model(self):
        """The Flax module this checkpoint's arrays belong to (:class:`CheckpointError` if
        this version cannot build it)."""
        from naisnet_jax import models

        name, kwargs = self.model_spec()
        try:
            return models.get_model(name, num_classes=self.num_classes, **kwargs)
        except (TypeError, ValueError) as e:
            raise CheckpointError(
                f"the checkpoint's metadata does not describe a model this version can build "
                f"(model={name!r}, {kwargs}): {e}"
            ) from e
