"""Training: a pure ``train_step``, evaluation, and ``train_and_evaluate``.

The optimiser is ``optax.chain(add_decayed_weights, sgd(momentum), stability_projection)``:
every update is followed by Algorithms 1 and 2, so the parameters a step
returns always satisfy the stability constraints. The step is a pure function
of ``(state, batch)``; an epoch runs as ``lax.scan`` over batch indices inside
``jit`` (in chunks, so a progress bar can advance), with the whole dataset on
the accelerator.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from naisnet_jax import checkpoint as ckpt
from naisnet_jax import data as data_lib
from naisnet_jax import engine, metric_writers, models
from naisnet_jax.configs import schema
from naisnet_jax.engine import CHECKPOINT_DIR as CHECKPOINT_DIR
from naisnet_jax.engine import METRICS_FILE as METRICS_FILE
from naisnet_jax.engine import TrainingDiverged as TrainingDiverged
from naisnet_jax.engine import WorkdirInUse as WorkdirInUse
from naisnet_jax.parallel import DATA_AXIS as DATA_AXIS
from naisnet_jax.parallel import batch_norm_axis as batch_norm_axis
from naisnet_jax.parallel import check_batch_divides as check_batch_divides
from naisnet_jax.parallel import make_mesh as make_mesh
from naisnet_jax.parallel import replicate as replicate
from naisnet_jax.parallel import shard_batch, shard_map
from naisnet_jax.projection import count_projected_blocks, project_params, stability_projection
from naisnet_jax.stability import max_radius_bound


class TrainState(train_state.TrainState):
    batch_stats: Any = None


# --------------------------------------------------------------------------- config


def validate_config(config, labels: Mapping[str, str] | None = None):
    """Refuse invalid configs before anything is loaded or compiled, naming the field (or its
    ``labels`` entry: the flag that set it); the fields a config lacks are added at their declared
    defaults (:func:`naisnet_jax.configs.schema.validate`). Returns ``config``."""
    return schema.validate(config, labels=labels)


#: Backends on which ``config.fast_path="auto"`` asks the registry for the fused block path
#: (:data:`naisnet_jax.models.GPU_FAST_PATH`).
FAST_PATH_BACKENDS = ("gpu",)


def model_spec(config) -> tuple[str, dict]:
    """``(name, keyword arguments)`` of ``config``'s network: ``config.model_kwargs`` plus the
    declared model fields (:data:`naisnet_jax.configs.schema.MODEL_FIELDS`) the model takes, and on
    a GPU the fast path unless ``config.fast_path = "plain"``
    (:func:`naisnet_jax.models.model_spec`). The one place a config becomes a model: the trainers
    build it from this, and a checkpoint stores it. Refuses ``model_kwargs`` that repeat a
    top-level field or that the model does not take, naming them."""
    kwargs = dict(config.model_kwargs)
    shadowed = sorted(set(kwargs) & set(schema.MODEL_FIELDS))
    if shadowed:  # one source of truth: the projection and the checkpoint use config's
        raise ValueError(
            f"config.model_kwargs sets {shadowed}; set config.{shadowed[0]} instead (the projection "
            f"and the checkpoint metadata read the top-level fields)."
        )
    accepted = models.accepted_fields(config.model)
    kwargs.update({k: config[k] for k in schema.MODEL_FIELDS if k in accepted and config[k] is not None})
    fast = schema.check_field("fast_path", config.fast_path, config) == "auto"
    fast = fast and jax.default_backend() in FAST_PATH_BACKENDS
    return models.model_spec(config.model, kwargs, fast_path=fast, where="config.model_kwargs")


def model_kwargs(config) -> dict:
    """Keyword arguments for ``models.get_model``: :func:`model_spec`'s."""
    return model_spec(config)[1]


def build_model(config, num_classes: int, *, batch_axis: str | None = None):
    """``config``'s network; ``batch_axis``: the mapped axis its BatchNorm layers (if any) take
    their training statistics across (:class:`naisnet_jax.models.BatchAxis`)."""
    kwargs = model_kwargs(config)
    if batch_axis is not None and "batch_axis" in models.accepted_fields(config.model):
        kwargs["batch_axis"] = batch_axis
    return models.get_model(config.model, num_classes=num_classes, **kwargs)


# --------------------------------------------------------------------------- steps


def learning_rate_schedule(config, steps_per_epoch: int) -> optax.Schedule:
    """Piecewise constant: ``learning_rate``, divided by 10 (``lr_decay_factor``) at
    each epoch of ``lr_boundaries_epochs``; the first ``lr_warmup_steps`` steps (if any) run at
    ``learning_rate * lr_warmup_factor`` (a constant warm-up, as He et al. trained ResNet-110:
    0.01 for about 400 steps, then 0.1)."""
    decayed = optax.piecewise_constant_schedule(
        config.learning_rate,
        {int(e) * steps_per_epoch: config.lr_decay_factor for e in config.lr_boundaries_epochs},
    )
    warmup, factor = int(config.lr_warmup_steps), config.lr_warmup_factor
    if warmup == 0:
        return decayed
    return lambda count: jnp.where(count < warmup, factor, 1.0) * decayed(count)


def make_optimizer(config, steps_per_epoch: int) -> optax.GradientTransformation:
    parts = []
    if config.weight_decay > 0:
        parts.append(optax.add_decayed_weights(config.weight_decay))
    parts.append(optax.sgd(learning_rate_schedule(config, steps_per_epoch), momentum=config.momentum or None))
    # last; the ResNet baselines train through it too, with nothing to project
    parts.append(stability_projection(eps=config.eps, eta=config.eta, relaxed=config.relaxed, expect_blocks=False))
    return optax.chain(*parts)


def cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def train_step(
    state: TrainState, batch, *, axis_name: str | None = None, sync_batch_norm: bool = True
) -> tuple[TrainState, dict]:
    """One SGD step followed by the stability projection. Pure.

    ``axis_name``: inside ``jax.shard_map`` over a batch split on that mesh axis, BatchNorm
    averages its statistics over the axis (a model built with ``batch_axis=axis_name``:
    :func:`build_model`) and the gradients and metrics are averaged over it
    (equal shards: the global batch's mean loss), so every device applies the same update
    (:func:`data_parallel_step`). With ``sync_batch_norm=False`` each device normalises by its
    own rows' statistics instead (as TensorFlow's and PyTorch's data-parallel BatchNorm do by
    default), which saves a small all-reduce per BatchNorm layer in the forward pass (each
    waiting for the layer before) and its gradient's in the backward pass; the running averages
    are then averaged over the axis, so the state stays the same on every device."""
    x, y = batch

    def loss_fn(params):
        variables = {"params": params}
        if state.batch_stats is not None:
            variables["batch_stats"] = state.batch_stats
            logits, updates = state.apply_fn(variables, x, train=True, mutable=["batch_stats"])
        else:
            logits, updates = state.apply_fn(variables, x, train=True), {}
        loss = jnp.mean(cross_entropy(logits, y))
        return loss, (logits, updates)

    (loss, (logits, updates)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    if axis_name is not None:
        grads = jax.lax.pmean(grads, axis_name)
    state = state.apply_gradients(grads=grads)
    if state.batch_stats is not None:
        batch_stats = updates["batch_stats"]
        if axis_name is not None and not sync_batch_norm:
            batch_stats = jax.lax.pmean(batch_stats, axis_name)
        state = state.replace(batch_stats=batch_stats)
    metrics = {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == y)}
    if axis_name is not None:
        metrics = jax.lax.pmean(metrics, axis_name)
    return state, metrics


def data_parallel_step(
    state: TrainState, batch, mesh: Mesh, *, sync_batch_norm: bool = True
) -> tuple[TrainState, dict]:
    """:func:`train_step` with the batch split over ``mesh``'s ``"data"`` axis (call inside
    ``jit``; ``state`` replicated).

    Each device runs the whole step on its own rows (``jax.shard_map``): forward and backward
    stay local, BatchNorm normalises by the global batch's statistics as one device would, the
    gradients are averaged once, and every device applies the same update and projection.
    Left to the SPMD partitioner, the same step all-reduced the state kernel's gradient at
    every one of a block's K backward steps (a loop-carried sum of per-device parts) and
    gathered the whole batch's stacked states for the stacked VJP; here the only collectives
    are the BatchNorm statistics and one all-reduce of the gradients per step.
    ``sync_batch_norm=False``: BatchNorm by each device's own rows (:func:`train_step`)."""
    replicated, split = PartitionSpec(), PartitionSpec(DATA_AXIS)
    step = shard_map(
        functools.partial(train_step, axis_name=DATA_AXIS, sync_batch_norm=sync_batch_norm),
        mesh=mesh,
        in_specs=(replicated, split),
        out_specs=(replicated, replicated),
    )
    return step(state, shard_batch(batch, mesh))


def state_variables(state):
    """The variables ``state.apply_fn`` takes: ``{"params": ...}``, with ``"batch_stats"`` if the model has them."""
    variables = {"params": state.params}
    if state.batch_stats is not None:
        variables["batch_stats"] = state.batch_stats
    return variables


def eval_step(state: TrainState, batch, mask) -> dict:
    """Sums over the real (``mask``) examples of a batch: loss, correct, depth."""
    x, y = batch
    logits, aux = state.apply_fn(state_variables(state), x, train=False, return_aux=True)
    m = mask.astype(jnp.float32)
    out = {
        "loss_sum": jnp.sum(cross_entropy(logits, y) * m),
        "correct": jnp.sum((jnp.argmax(logits, -1) == y) * m),
        "count": jnp.sum(m),
    }
    depth = aux.get("depth")
    if depth is not None:
        total_depth = jnp.sum(depth, axis=0).astype(jnp.float32)  # per pattern, over blocks
        out["depth_sum"] = jnp.sum(total_depth * m)
        out["depth_min"] = jnp.min(jnp.where(mask, total_depth, jnp.inf))
        out["depth_max"] = jnp.max(jnp.where(mask, total_depth, -jnp.inf))
    return out


def augmentation(config) -> bool | str:
    """The ``augment`` of :func:`naisnet_jax.data.get_batch` for ``config``: ``False``, ``True``
    (pad, crop and flip, the CIFAR recipe) or, with ``config.augment_flip=False``, ``"crop"``
    (pad and crop only: a mirrored digit is another digit or none)."""
    if not config.augment:
        return False
    return True if config.augment_flip else "crop"


def step_keys(epoch_key: jax.Array, first_step, count: int) -> jax.Array:
    """The augmentation keys of an epoch's steps ``first_step .. first_step + count - 1``,
    ``(count, 2)``: step ``i``'s key is ``fold_in(epoch_key, i)``, whatever the steps are run in
    (a chunk of any size, or the whole epoch at once)."""
    steps = jnp.asarray(first_step, jnp.int32) + jnp.arange(count, dtype=jnp.int32)
    return jax.vmap(lambda i: jax.random.fold_in(epoch_key, i))(steps)


def make_train_chunk(
    mean, std, augment: bool | str, mesh: Mesh | None = None, *, sync_batch_norm: bool = True
) -> Callable:
    """``(state, data, idx_rows, key, num_steps=None, first_step=0) -> (state, metrics)``: train
    steps in one jitted loop, ``metrics`` their mean loss and accuracy.

    Step ``i`` trains on the rows ``idx_rows[i]`` with the augmentation key of the epoch's step
    ``first_step + i`` (:func:`step_keys` of the epoch's key ``key``), so the chunk size does not
    change the random stream. ``num_steps`` (an int32 scalar, at most ``len(idx_rows)``) runs
    only the first ``num_steps`` of them: an epoch's shorter last chunk, padded to the others'
    length, then runs in the same compiled program instead of compiling a second one. With a
    ``mesh`` of several devices, each batch is split over them
    (:func:`data_parallel_step`, BatchNorm by the whole batch or, ``sync_batch_norm=False``, by
    each device's rows) and the state comes back replicated (pass it in replicated:
    ``replicate``).
    """

    def step(state, batch):
        if mesh is None or mesh.devices.size == 1:  # one device: the plain step, bit for bit
            return train_step(state, shard_batch(batch, mesh))
        return data_parallel_step(state, batch, mesh, sync_batch_norm=sync_batch_norm)

    def train_chunk(state, data, idx_rows, key, num_steps=None, first_step=0):
        keys = step_keys(key, first_step, idx_rows.shape[0])
        count = idx_rows.shape[0] if num_steps is None else num_steps

        def body(i, carry):
            state, sums = carry
            batch = data_lib.get_batch(data, idx_rows[i], mean=mean, std=std, key=keys[i], augment=augment)
            state, metrics = step(state, batch)
            return state, {k: sums[k] + metrics[k].astype(jnp.float32) for k in sums}

        sums = {"loss": jnp.zeros((), jnp.float32), "accuracy": jnp.zeros((), jnp.float32)}
        state, sums = jax.lax.fori_loop(0, count, body, (state, sums))
        return state, {k: v / count for k, v in sums.items()}

    if mesh is None:
        return jax.jit(train_chunk, donate_argnums=(0,))
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.jit(train_chunk, donate_argnums=(0,), out_shardings=(replicated, replicated))


def chunk_rows(idx, start: int, steps_per_chunk: int) -> tuple[np.ndarray, int]:
    """The batches ``idx[start : start + steps_per_chunk]`` of an epoch padded to
    ``steps_per_chunk`` rows (with its first row), and how many are real: every chunk of a run,
    the last included, has one shape and so one compiled program."""
    rows = np.asarray(idx[start : start + steps_per_chunk])
    count = rows.shape[0]
    if count < steps_per_chunk:
        rows = np.concatenate([rows, np.repeat(rows[:1], steps_per_chunk - count, axis=0)])
    return rows, count


def make_evaluate(mean, std, batch_size: int, mesh: Mesh | None = None) -> Callable:
    """``(state, data) -> metrics`` over every example of ``data`` exactly once
    (with ``mesh``: each batch split over its devices)."""

    @jax.jit
    def evaluate(state, data):
        idx, mask = data_lib.eval_batches(data.images.shape[0], batch_size)

        def body(_, inputs):
            i, m = inputs
            batch, m = shard_batch((data_lib.get_batch(data, i, mean=mean, std=std), m), mesh)
            return None, eval_step(state, batch, m)

        _, sums = jax.lax.scan(body, None, (idx, mask))
        count = jnp.sum(sums["count"])
        out = {"loss": jnp.sum(sums["loss_sum"]) / count, "accuracy": jnp.sum(sums["correct"]) / count}
        if "depth_sum" in sums:
            out["depth_mean"] = jnp.sum(sums["depth_sum"]) / count
            out["depth_min"] = jnp.min(sums["depth_min"])
            out["depth_max"] = jnp.max(sums["depth_max"])
        return out

    return evaluate


def make_per_step_loss(mean, std, batch_size: int = 1000) -> Callable:
    """``(state, data) -> (K,)``: mean cross-entropy of ``x(i)`` through the classifier at
    every unroll step ``i`` (FC models: ``aux["step_logits"]``), over every example of
    ``data``. Traceable, so a sweep can ``jax.vmap`` it over seeds."""

    @jax.jit
    def run(state, data):
        idx, mask = data_lib.eval_batches(data.images.shape[0], batch_size)

        def body(_, inputs):
            i, m = inputs
            x, y = data_lib.get_batch(data, i, mean=mean, std=std)
            _, aux = state.apply_fn(state_variables(state), x, train=False, return_aux=True)
            ce = cross_entropy(aux["step_logits"], y[None])  # (K, B)
            return None, jnp.sum(ce * m[None], axis=1)

        _, sums = jax.lax.scan(body, None, (idx, mask))
        return jnp.sum(sums, axis=0) / jnp.sum(mask)

    return run


def per_step_loss(state: TrainState, data, mean, std, batch_size: int = 1000) -> np.ndarray:
    """Mean cross-entropy of ``x(i)`` through the classifier at every unroll step ``i``
    (FC models: ``aux["step_logits"]``), over every example of ``data``."""
    return np.asarray(make_per_step_loss(mean, std, batch_size)(state, data))


# --------------------------------------------------------------------------- loop


#: Compile the initial state's computation once per model and input shape, and run it for every
#: seed, on these backends. Eager ``init`` dispatches the forward pass op by op, compiling each new
#: shape: NAIS-Net10's took ~85 s on an H100, compiled once 21 s and then 0.01 s a seed (a sweep's
#: ten seeds: one compile). On a CPU eager init is the faster of the two (32 against 38 s).
COMPILED_INIT_BACKENDS = ("gpu",)


def _initializer(model, input_shape: tuple, eps: float, eta: float, relaxed: bool) -> Callable:
    """``key -> (params projected onto the stable set, batch_stats or None)``."""

    def init(key):
        variables = model.init(key, jnp.zeros((1,) + input_shape, jnp.float32), train=False)
        params = project_params(variables["params"], eps=eps, eta=eta, relaxed=relaxed)
        return params, variables.get("batch_stats")

    return init


def _lowered_initializer(model, input_shape: tuple, eps: float, eta: float, relaxed: bool, platforms=None):
    """:func:`_initializer` lowered (for ``platforms``, default this backend) with its random draws
    as XLA's GPU threefry kernel (the same bits, a far smaller program: unrolled, threefry's rounds
    for every parameter made the program ~85k lines).

    JAX's ``jax_threefry_gpu_kernel_lowering`` option picks that form, and it is read by the
    threefry primitive's lowering rule while the program is lowered (a custom call in place of the
    rounds), not by XLA: no ``compiler_options`` of a compilation can ask for it. So it is set for
    this one lowering, in this thread (JAX's scoped form of the option), never process-wide."""
    from jax._src import config as jax_config  # the option's scoped form is not exported

    fn = jax.jit(_initializer(model, input_shape, eps, eta, relaxed))
    with jax_config.threefry_gpu_kernel_lowering(True):
        return fn.trace(jax.random.PRNGKey(0)).lower(lowering_platforms=platforms)


@functools.lru_cache(maxsize=8)
def _compiled_initializer(model, input_shape: tuple, eps: float, eta: float, relaxed: bool):
    """:func:`_initializer` compiled ahead of time, from :func:`_lowered_initializer`."""
    return _lowered_initializer(model, input_shape, eps, eta, relaxed).compile()


def initial_variables(config, model, input_shape) -> tuple[Any, Any]:
    """``(params, batch_stats)`` of a new run: ``model.init`` with ``config.seed``, the params
    projected (``config.eps``, ``eta``, ``relaxed``). Compiled once per model and input shape on
    :data:`COMPILED_INIT_BACKENDS` (values equal eager ``init``'s up to float rounding)."""
    args = (model, tuple(input_shape), config.eps, config.eta, config.relaxed)
    key = jax.random.PRNGKey(config.seed)
    traced = isinstance(key, jax.core.Tracer)  # under jit or eval_shape: trace it with the rest
    if jax.default_backend() in COMPILED_INIT_BACKENDS and not traced and _hashable(args):
        return _compiled_initializer(*args)(key)
    return _initializer(*args)(key)  # (an unhashable model, a field holding a list say: no cache)


def _hashable(value) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def create_train_state(config, model, input_shape, steps_per_epoch: int) -> TrainState:
    params, batch_stats = initial_variables(config, model, input_shape)
    return TrainState.create(
        apply_fn=model.apply,
        params=params,
        tx=make_optimizer(config, steps_per_epoch),
        batch_stats=batch_stats,
    )


def input_stats(config, train_images) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel ``(mean, std)`` of the input normalisation ``(x / 255 - mean) / std``: the
    training set's statistics, or ``(0, 1)`` (pixels in [0, 1]) with ``config.standardize=False``."""
    if config.standardize:
        return data_lib.channel_stats(train_images)
    channels = train_images.shape[-1]
    return np.zeros(channels), np.ones(channels)


@dataclasses.dataclass
class DataParallelEpochs:
    """The epoch of one seed, its batches split over ``mesh``'s devices, in chunks of
    ``config.steps_per_chunk`` steps (:func:`make_train_chunk`): each chunk's scalars go to
    ``writer`` and advance the progress bar; a loss or parameters that stop being finite stop the
    run (:meth:`naisnet_jax.engine.RunDirectory.stop_diverged`). An
    :class:`naisnet_jax.engine.EpochProgram`."""

    config: Any
    run: engine.RunDirectory
    writer: Any
    mesh: Mesh
    steps_per_epoch: int
    train_data: Any
    test_data: Any
    train_chunk: Callable
    evaluate: Callable
    growth: engine.LossGrowth
    unit: str = "step"

    def progress_units(self, epochs: int) -> int:
        return epochs * self.steps_per_epoch

    def saved_tree(self, state) -> dict:
        return engine.checkpoint_tree(state)

    def summary(self, epoch: int, records: list[dict]) -> str:
        (r,) = records
        rho = "n/a" if r["rho_max"] is None else format(r["rho_max"], ".4f")
        return (
            f"epoch {epoch}: train loss {r['train_loss']:.4f} acc {r['train_accuracy']:.4f} | "
            f"test loss {r['test_loss']:.4f} acc {r['test_accuracy']:.4f} | rho_max {rho} | {r['epoch_seconds']:.1f}s"
        )

    def train_epoch(self, state, epoch: int, progress) -> tuple[TrainState, list[dict]]:
        config, mesh = self.config, self.mesh
        schedule = learning_rate_schedule(config, self.steps_per_epoch)
        t0 = time.time()
        perm_key, aug_key = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(config.seed + 1), epoch))
        n_train = self.train_data.num_examples
        idx = np.asarray(data_lib.epoch_batches(perm_key, n_train, config.batch_size))
        sums, seen = {"loss": 0.0, "accuracy": 0.0}, 0
        for start in range(0, self.steps_per_epoch, config.steps_per_chunk):
            rows, count = chunk_rows(idx, start, config.steps_per_chunk)
            t_chunk = time.perf_counter()
            state, m = self.train_chunk(
                state,
                self.train_data,
                replicate(rows, mesh),
                replicate(aug_key, mesh),
                replicate(np.int32(count), mesh),
                replicate(np.int32(start), mesh),
            )
            m = jax.device_get(m)
            t_chunk = time.perf_counter() - t_chunk
            if not all(np.isfinite(v) for v in m.values()):
                progress.close()
                self.run.stop_diverged(f"training loss became {m['loss']} at epoch {epoch} (step {int(state.step)})")
            warning = self.growth.watch(float(m["loss"]))
            if warning:
                self.run.say(warning, error=True)
            for k in sums:
                sums[k] += float(m[k]) * count
            seen += count
            progress.update(count)
            progress.set_postfix(epoch=epoch, loss=f"{float(m['loss']):.4f}")
            step = int(state.step)
            self.writer.write_scalars(
                step,
                {
                    "train/loss": float(m["loss"]),
                    "train/accuracy": float(m["accuracy"]),
                    "train/learning_rate": float(schedule(step - 1)),
                    "train/steps_per_second": count / max(t_chunk, 1e-9),
                },
            )
        test = jax.device_get(self.evaluate(state, self.test_data))
        step = int(state.step)
        record = engine.epoch_record(
            epoch=epoch,
            step=step,
            learning_rate=float(schedule(step - 1)),
            train={k: v / seen for k, v in sums.items()},
            test=test,
            rho_max=max_radius_bound(state.params, eps=config.eps, h=config.h),
            seconds=time.time() - t0,
        )
        params_finite = all(bool(np.all(np.isfinite(x))) for x in jax.tree.leaves(jax.device_get(state.params)))
        if not (params_finite and np.isfinite(float(test["loss"]))):
            progress.close()
            what = "the parameters are not finite" if not params_finite else f"the test loss is {test['loss']}"
            self.run.stop_diverged(f"after epoch {epoch} (step {step}) {what}")
        # the scalars before the record and the checkpoint: a crash between them leaves what a resume drops
        self.writer.write_scalars(step, {f"epoch/{k}": v for k, v in record.items() if k != "step" and v is not None})
        return state, [record]


def _scalars_writer(run: engine.RunDirectory, writer, workdir: str):
    """Where the scalars go: ``writer``, else ``workdir``'s own log; nowhere on a process other
    than the primary one, which writes them."""
    if not run.primary:
        return metric_writers.MultiWriter([])
    return metric_writers.default_writer(workdir) if writer is None else writer


def _resume(run: engine.RunDirectory, state: TrainState, config) -> tuple[TrainState, int]:
    """``(state, start_epoch)``: ``state`` from epoch 1, or the run's newest checkpoint restored
    into it, said in one line."""
    resumed = run.resume(engine.checkpoint_tree(state))
    if resumed is None:
        return state, 1
    state, start_epoch = engine.restore_into(state, resumed[0]), resumed[1] + 1
    if not run.complete(start_epoch, config.num_epochs):
        run.say(f"Resuming from {run.checkpoint_dir} at epoch {start_epoch} (step {int(state.step)}).")
    return state, start_epoch


def train_and_evaluate(config, workdir: str, *, writer=None, stop_after_epochs: int | None = None, labels=None) -> dict:
    """Train ``config`` in ``workdir``, resuming from its latest checkpoint.

    Appends one JSON record per epoch to ``workdir/metrics.jsonl`` and writes
    Orbax checkpoints under ``workdir/checkpoints``. Scalars (train loss per
    chunk, learning rate, steps per second, and every epoch's record) go to
    ``writer``, any object with ``write_scalars(step, scalars)`` (see
    :mod:`naisnet_jax.metric_writers`); by default ``workdir/scalars.jsonl``.
    A writer with ``truncate_after(step)`` (``JsonlWriter``) is rewound to the checkpoint's step
    on resume, so a resumed run's log equals an uninterrupted run's (on a fresh start, a log file
    already there is kept beside, renamed, as the metrics log is).
    Nothing is written before the config, data and model are known to be good.
    ``stop_after_epochs`` ends this call early (as an interruption would), for
    tests. ``labels`` (a mapping) names config fields by the flags that set them in what the run
    says (``{"num_epochs": "--epochs"}``; :func:`validate_config`).
    Returns the final record plus ``"state"`` (the final ``TrainState``).
    """
    validate_config(config, labels)
    if writer is not None:
        metric_writers.check_writer(writer)
    ds, steps_per_epoch = engine.load_training_data(config)
    mesh = make_mesh(config.num_devices)
    check_batch_divides(config, mesh)
    axis = batch_norm_axis(mesh, config.sync_batch_norm)
    model = build_model(config, ds.num_classes, batch_axis=axis)
    state = create_train_state(config, model, ds.train_images.shape[1:], steps_per_epoch)
    if count_projected_blocks(state.params) == 0 and config.model.startswith("naisnet"):
        raise ValueError(f"{config.model} has no NAIS block parameters to project; check naisnet_jax.models.")

    mean, std = input_stats(config, ds.train_images)
    train_data = replicate(data_lib.put_on_device(ds.train_images, ds.train_labels), mesh)
    test_data = replicate(data_lib.put_on_device(ds.test_images, ds.test_labels), mesh)
    augment = augmentation(config)

    os.makedirs(workdir, exist_ok=True)  # only now: a refused run writes nothing
    view = engine.resume_view(config, model_kwargs(config), [config.seed])
    with engine.RunDirectory(workdir, view, keep=config.keep_checkpoints, config=config, labels=labels) as run:
        own_writer = writer is None
        writer = _scalars_writer(run, writer, workdir)
        state, start_epoch = _resume(run, state, config)
        # the scalars of steps after the checkpoint (written before a crash), or all of them
        engine.rewind(writer, int(state.step) if start_epoch > 1 else -1)

        state = replicate(state, mesh)
        end_epoch = engine.last_epoch(config, start_epoch, stop_after_epochs)
        program = DataParallelEpochs(
            config=config,
            run=run,
            writer=writer,
            mesh=mesh,
            steps_per_epoch=steps_per_epoch,
            train_data=train_data,
            test_data=test_data,
            train_chunk=make_train_chunk(mean, std, augment, mesh, sync_batch_norm=config.sync_batch_norm),
            evaluate=make_evaluate(mean, std, config.eval_batch_size, mesh),
            growth=engine.LossGrowth(math.log(ds.num_classes)),
        )
        progress = engine.progress(
            program.progress_units(end_epoch - start_epoch + 1), bool(config.progress), quiet=not run.primary
        )
        state = engine.run_epochs(
            run,
            program,
            state,
            start_epoch=start_epoch,
            end_epoch=end_epoch,
            config=config,
            metadata=ckpt.CheckpointMetadata.from_config(config, ds, mean, std, model_kwargs=model_kwargs(config)),
            progress=progress,
        )
        last = run.records[-1] if run.records else {}
        if own_writer:
            writer.close()
        elif callable(getattr(writer, "flush", None)):
            writer.flush()
        return dict(last, state=state, mean=mean, std=std, test_data=test_data)
