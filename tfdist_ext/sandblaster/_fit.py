"""How ``model.fit`` runs Sandblaster L-BFGS (internal).

``tfdist_ext._integration`` routes ``fit`` of a model under a
``SandblasterStrategy`` here. The training data are read into memory once
and sent to every worker; Keras's own ``fit`` loop then runs unchanged
(progress bar, callbacks, validation, checkpoints) over a two-example
stand-in dataset it uses to build the model, with ``model.train_function``
set to one L-BFGS iteration per step. The step returns the full logs
(``loss`` and compiled metrics over the training set, and the iteration's
record), which Keras reports as the epoch's logs because their keys differ
from the model's metric names.
"""

import inspect
import types

import keras
import numpy as np
import tensorflow as tf

from tfdist_ext import _integration
from tfdist_ext._ps_strategy import check_compiled_for_workers
from tfdist_ext.optimizers._lbfgs import LBFGS
from tfdist_ext.sandblaster._lbfgs import LBFGSRun


def sandblaster_fit(model, strategy, keras_fit, args, kwargs):
    _refuse_custom_train_step(model)
    check_compiled_for_workers(model, "SandblasterStrategy")
    arguments = inspect.signature(keras_fit).bind(model, *args, **kwargs).arguments
    arguments.pop("self", None)
    optimizer = model.optimizer
    if isinstance(getattr(optimizer, "inner_optimizer", None), LBFGS):
        raise ValueError(
            "SandblasterStrategy: the 'mixed_float16' dtype policy wrapped the LBFGS "
            "optimizer in a LossScaleOptimizer; L-BFGS has no loss scaling (its line "
            "search needs the exact loss and gradient). Use the 'mixed_bfloat16' or "
            "'float32' policy for this model."
        )
    if not isinstance(optimizer, LBFGS):
        raise ValueError(
            "SandblasterStrategy: compile the model with "
            f"tfdist_ext.optimizers.LBFGS, not {type(optimizer).__name__}"
        )
    x, y, sample_weight = (arguments.pop(k, None) for k in ("x", "y", "sample_weight"))
    split = arguments.pop("validation_split", 0.0)
    if split and arguments.get("validation_data") is None:
        (x, y, sample_weight), arguments["validation_data"] = _integration.train_validation_split(
            (x, y, sample_weight), validation_split=split
        )
    data = training_set(x, y, sample_weight, arguments)
    _build_from_data(model, strategy, data)
    for key in ("batch_size", "shuffle", "class_weight"):
        arguments.pop(key, None)
    run = _continued_run(model, strategy, data, optimizer)
    step = _TrainStep(model, run)
    stand_in = tf.data.Dataset.from_tensors(tf.nest.map_structure(lambda a: a[:2], data)).repeat()
    arguments["steps_per_epoch"] = arguments.get("steps_per_epoch") or 1
    arguments["x"] = stand_in
    arguments["shuffle"] = False
    model.train_function = step
    try:
        history = keras_fit(model, **arguments)
    finally:
        model.train_function = None
    result = run.result()
    optimizer._set_result(result)
    history.result = result
    return history


def training_set(x, y, sample_weight, arguments):
    """The whole training set, one epoch as Keras's own data adapter yields it
    (a ``PyDataset`` read once, ``class_weight`` turned into sample weights).

    L-BFGS minimises the loss over the whole set: an input with no end (a
    repeated dataset, a Python generator) is refused, naming it.
    """
    if isinstance(x, tf.data.Dataset) and x.cardinality() == tf.data.INFINITE_CARDINALITY:
        raise ValueError(
            "SandblasterStrategy: fit's dataset repeats forever; L-BFGS minimises the loss "
            "over the whole, finite training set. Pass it without .repeat() (steps_per_epoch "
            "then counts L-BFGS iterations per epoch)."
        )
    if isinstance(x, types.GeneratorType):
        raise ValueError(
            "SandblasterStrategy: fit's input is a Python generator, which has no known "
            "end; L-BFGS minimises the loss over the whole training set. Pass arrays, a "
            "finite tf.data.Dataset or a keras.utils.PyDataset."
        )
    adapter = _integration.get_data_adapter(
        x,
        y,
        sample_weight,
        batch_size=arguments.get("batch_size") or 32,
        shuffle=False,
        class_weight=arguments.get("class_weight"),
    )
    adapter.on_epoch_begin()
    try:
        batches = list(adapter.get_numpy_iterator())
    finally:
        adapter.on_epoch_end()
    if not batches:
        raise ValueError("SandblasterStrategy: fit's training data are empty")
    data = tf.nest.map_structure(lambda *parts: np.concatenate(parts), *batches)
    x, y, sample_weight = _integration.unpack_x_y_sample_weight(data)
    return materialize(x, y, sample_weight, "fit")


def _build_from_data(model, strategy, data):
    """Creates the variables of a model Keras would build on its first batch.

    L-BFGS needs every parameter before the first iteration, and a subclassed
    model has none until it is called: call it once on two examples, under the
    strategy's scope so that its variables go to the ``ps`` tasks.
    """
    if model.trainable_variables:
        return
    x, _, _ = _integration.unpack_x_y_sample_weight(data)
    with strategy.scope():
        _integration.call_model(model, tf.nest.map_structure(lambda a: a[:2], x), training=False)
    if not model.trainable_variables:
        raise ValueError(
            f"SandblasterStrategy: model {model.name!r} has no trainable weights "
            "after a call on the training data; there is nothing for L-BFGS to fit"
        )


def _refuse_custom_train_step(model):
    owner = _integration.overridden_step(model, "train_step")
    if owner is not None:
        raise ValueError(
            f"SandblasterStrategy: {owner.__name__} overrides train_step, which L-BFGS "
            "cannot run: Sandblaster minimises the model's loss over the whole training "
            "set with L-BFGS iterations, not per-batch train steps, so your train_step "
            "would be skipped. Put the custom loss in a compute_loss override instead "
            "(Sandblaster evaluates it on the workers), or train this model with a "
            "strategy that runs train_step as written (e.g. "
            "tf.distribute.MirroredStrategy)."
        )


def _continued_run(model, strategy, data, optimizer):
    """The model's L-BFGS run: a later ``fit`` on the same arrays continues it."""
    evaluator = strategy._evaluator(
        ("fit", id(model)),
        model,
        model.trainable_variables,
        keras_objective(model),
        data,
        optimizer.memory,
    )
    run = getattr(model, "_sandblaster_run", None)
    if run is None or run.evaluator is not evaluator or run.options is not optimizer:
        run = LBFGSRun(optimizer, evaluator.vectors, evaluator)
        object.__setattr__(model, "_sandblaster_run", run)
    return run


def materialize(x, y, sample_weight, caller):
    """The training data as a tuple of array nests: ``(x, y)`` or ``(x, y, sample_weight)``."""
    if isinstance(x, tf.data.Dataset):
        if y is not None or sample_weight is not None:
            raise ValueError(f"{caller}: pass y and sample_weight inside the dataset")
        x, y, sample_weight = _integration.unpack_x_y_sample_weight(read_dataset(x, caller))
    if x is None:
        raise ValueError(f"{caller}: no training data (x is None)")
    parts = (x, y) if sample_weight is None else (x, y, sample_weight)
    if y is None:
        raise ValueError(f"{caller}: y is required (L-BFGS minimises a supervised loss)")
    parts = tf.nest.map_structure(np.asarray, parts)
    sizes = {len(a) for a in tf.nest.flatten(parts)}
    if len(sizes) != 1:
        raise ValueError(
            f"{caller}: x, y and sample_weight have different numbers of examples: {sorted(sizes)}"
        )
    return parts


def read_dataset(dataset, caller):
    """A finite dataset of batches, concatenated into one nest of arrays."""
    if dataset.cardinality() == tf.data.INFINITE_CARDINALITY:
        raise ValueError(
            f"{caller}: the dataset is infinite; L-BFGS needs the whole (finite) training set"
        )
    batches = list(dataset.as_numpy_iterator())
    if not batches:
        raise ValueError(f"{caller}: the dataset is empty")
    return tf.nest.map_structure(lambda *parts: np.concatenate(parts), *batches)


def keras_objective(model):
    """``loss_fn(params, batch) -> (loss, metric state)`` of a compiled Keras model.

    The model runs with ``training=False`` under a ``keras.StatelessScope``
    that maps its trainable variables to ``params``; the loss is Keras's
    compiled loss plus regularisation losses; the metric state is the
    compiled metrics' variables after one stateless update from their reset
    values (additive over slices).
    """
    trainable = list(model.trainable_variables)
    non_trainable = list(model.non_trainable_variables)

    def loss_fn(params, batch):
        x, y, sample_weight = _integration.unpack_x_y_sample_weight(tuple(batch))
        mapping = list(zip(trainable, params)) + [(v, v.value) for v in non_trainable]
        # The compiled loss updates its per-output trackers (from zero here).
        tracked = loss_metric_variables(model)
        mapping += [(v, tf.zeros(v.shape, v.dtype)) for v in tracked]
        with (
            _integration.one_trace_at_a_time(),
            keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope,
        ):
            y_pred = _integration.call_model(model, x, training=False)
            loss = _integration.compute_loss(model, x, y, y_pred, sample_weight, training=False)
            state = [scope.get_current_value(v) for v in tracked]
        # Keras builds the compiled metrics in fit's first (symbolic) step,
        # before this function is traced on a worker.
        compiled = _integration.compiled_metrics(model)
        if compiled is not None and compiled.built:
            initial = [tf.zeros(v.shape, v.dtype) for v in compiled.variables]
            state += compiled.stateless_update_state(
                initial, y, y_pred, sample_weight=sample_weight
            )
        return loss, list(state)

    return loss_fn


def loss_metric_variables(model):
    """The variables of the per-output loss trackers, in the objective's state order."""
    return [v for m in _integration.compiled_loss_metrics(model) for v in m.variables]


def _metric_state_variables(model):
    """Every variable of the objective's metric state (``keras_objective``), in order."""
    compiled = _integration.compiled_metrics(model)
    variables = loss_metric_variables(model)
    if compiled is not None and compiled.built:
        variables += list(compiled.variables)
    return variables


class _TrainStep:
    """``model.train_function``: one L-BFGS iteration per call."""

    def __init__(self, model, run):
        self.model = model
        self.run = run

    def __call__(self, iterator):
        model, run = self.model, self.run
        record = run.step()
        if run.done:
            model.stop_training = True
        model.optimizer.iterations.assign(run.nit)
        tracker = _integration.loss_tracker(model)
        tracker.reset_state()
        tracker.update_state(run.f)
        if run.aux:
            for variable, value in zip(_metric_state_variables(model), run.aux):
                variable.assign(value)
        logs = {k: float(v) for k, v in model.get_metrics_result().items()}
        logs.update({k: v for k, v in record.items() if k not in ("loss", "seconds")})
        return logs
