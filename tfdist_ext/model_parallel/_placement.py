"""Applying a plan to a built Keras model: variables and computation (internal).

Two mechanisms, both plain TensorFlow device placement:

* variables -- each layer's ``KerasVariable`` wraps a ``tf.Variable``; a
  variable not already on its planned device is re-created there (value
  copied) and swapped into the ``KerasVariable``, so every Keras reference
  (the layer, ``model.weights``, checkpoints) sees the moved variable;
  optimizer slots created next to a moved variable move with it;
* computation -- each top-level layer's ``call`` is wrapped in
  ``tf.device(stage device)``. ``Layer.__call__`` dispatches to ``self.call``,
  so an instance attribute is picked up by eager calls, ``tf.function``
  traces, functional/sequential graphs and ``stateless_call`` alike, without
  changing the layer's class, config or saved form;
* gradients -- ``tf.GradientTape`` creates a gradient op in whatever device
  scope is open where ``tape.gradient`` is called, not on its forward op's
  device. Inside :func:`stage_gradients` (used by the pipelined step, by
  ``ModelParallelStrategy.run`` and by Downpour's local step) a graph device
  function gives each gradient op (TensorFlow names it
  ``gradient_tape/<forward op name or scope>/...``) the device of its forward
  op, or of the placed layer whose name scope it belongs to, so the backward
  pass of a stage (or of a column shard) runs where its forward pass ran. In
  eager execution gradient ops run on the device current at the
  ``tape.gradient`` call.

A plan may also *split* a ``Dense`` layer (``plan.splits``): ``apply_plan``
then replaces it in its ``Sequential`` model by a ``ColumnParallelDense`` of
the same name and weights whose shards are created on their devices.
"""

import contextlib
import functools
import weakref
from typing import Any

import keras
import tensorflow as tf

from tfdist_ext import _integration
from tfdist_ext.model_parallel._devices import current_forced_device  # noqa: F401 - _strategy's
from tfdist_ext.model_parallel._devices import forced_device
from tfdist_ext.model_parallel._layers import ColumnParallelDense
from tfdist_ext.model_parallel._plan import Plan
from tfdist_ext.model_parallel._plan import top_level_layers

_GRADIENT_PREFIX = "gradient_tape/"
_STAGE_SCOPES = weakref.WeakKeyDictionary()  # graph -> {name scope: device}


def _record_stage_scope(device):
    """Notes, in graph mode, that ops under the current name scope belong to ``device``."""
    if tf.executing_eagerly():
        return
    graph = tf.compat.v1.get_default_graph()
    scopes = _STAGE_SCOPES.setdefault(graph, {})
    scopes[graph.get_name_scope()] = device


def _forward_device(op):
    """Device for gradient op ``op``: its forward op's, or its placed layer's."""
    if op.device or not op.name.startswith(_GRADIENT_PREFIX):
        return op.device
    parts = op.name[len(_GRADIENT_PREFIX) :].split("/")
    for end in range(len(parts), 0, -1):
        prefix = "/".join(parts[:end])
        graph = op.graph
        while graph is not None:
            try:
                return graph.get_operation_by_name(prefix).device
            except (KeyError, ValueError):
                pass
            device = _STAGE_SCOPES.get(graph, {}).get(prefix)
            if device is not None:
                return device
            graph = getattr(graph, "outer_graph", None)
    return op.device


@contextlib.contextmanager
def stage_gradients():
    """Gradient ops created inside run on their forward ops' devices (graph mode).

    Wrap ``tape.gradient(...)`` (or a whole traced step) in it. Ops that
    already have a device, and ops that are not gradients of placed
    computation, are left alone. A no-op in eager execution.

    Example:
      >>> with stage_gradients():                   # doctest: +SKIP
      ...     grads = tape.gradient(loss, params)
    """

    if tf.executing_eagerly():
        yield
        return
    with tf.compat.v1.get_default_graph().device(_forward_device):
        yield


def same_device(a, b):
    """Whether two device strings name the same device (type and index)."""
    if not a or not b:
        return False
    da, db = tf.DeviceSpec.from_string(a), tf.DeviceSpec.from_string(b)
    return (da.device_type or "CPU") == (db.device_type or "CPU") and (da.device_index or 0) == (
        db.device_index or 0
    )


def _move(keras_variable, device):
    """Re-creates ``keras_variable``'s tf.Variable on ``device``; True if moved."""
    old = keras_variable.value
    if same_device(old.device, device):
        return None
    with tf.init_scope(), forced_device(device), tf.device(device):
        new = tf.Variable(
            tf.identity(old.read_value()),
            trainable=old.trainable,
            name=keras_variable.name,
            aggregation=old.aggregation,
            synchronization=old.synchronization,
        )
    strategy = _integration.variable_strategy(old)
    if strategy is not None:  # still the strategy's (for optimizer slot colocation)
        _integration.set_variable_strategy(new, strategy)
    _integration.swap_variable(keras_variable, new)
    return old


def _wrap_call(layer, device):

    original = layer.__dict__.get("_tfdist_original_call")
    if original is None:
        original = layer.call
    if getattr(layer, "_tfdist_device", None) == device:
        return

    @functools.wraps(original)
    def call(*args, **kwargs):
        with tf.device(device):
            _record_stage_scope(device)
            return original(*args, **kwargs)

    layer.__dict__["_tfdist_original_call"] = original
    layer.__dict__["_tfdist_device"] = device
    layer.__dict__["call"] = call


def variable_devices(model, plan):
    """``{id(keras.Variable): device}`` for the variables of ``model``'s
    top-level layers as ``plan`` places them (column shards on theirs)."""

    out = {}
    for layer in top_level_layers(model):
        if layer.name in plan.shard_devices and hasattr(layer, "shard_variables"):
            for shard, device in zip(layer.shard_variables(), plan.shard_devices[layer.name]):
                out.update({id(v): device for v in shard})
        for v in layer.weights:
            out.setdefault(id(v), plan.layer_devices[layer.name])
    return out


def apply_plan(
    model: keras.Model,
    plan: Plan,
    *,
    place_variables: bool = True,
    colocated: dict[int, Any] | None = None,
) -> keras.Model:
    """Places ``model``'s variables and computation as ``plan`` says.

    Idempotent. Variables already on their device stay; others are moved
    (values copied). If the model's optimizer is already built, its slot
    variables that were created next to a moved variable move too, and traced
    train/test/predict functions are dropped so they re-trace with the new
    placement.

    Args:
      model: the built Keras model the plan was made for.
      plan: a :class:`Plan` (from :func:`plan_partition`).
      place_variables: if ``False`` only the computation is placed and the
        variables stay where they are (for a strategy that keeps the variables
        elsewhere, e.g. on parameter servers, and reads them in each step).
      colocated: optional ``{id(slot tf.Variable): reference tf.Variable}``
        recorded when slots were created (the strategy keeps it); without it
        optimizer slots are matched to variables by position.

    Returns:
      ``model``.

    Example:
      >>> plan = plan_partition(model, ["/device:CPU:0", "/device:CPU:1"])  # doctest: +SKIP
      >>> apply_plan(model, plan)  # doctest: +SKIP
      >>> model.layers[-1].kernel.value.device  # doctest: +SKIP
      '/job:localhost/replica:0/task:0/device:CPU:1'
    """

    layers = top_level_layers(model)
    _check_places_layers(model, layers, plan)
    split = _split_planned_layers(model, layers, plan, place_variables)
    if split:
        layers = top_level_layers(model)
    placement = variable_devices(model, plan)
    moved = _move_variables(model, placement) if place_variables else {}
    _place_calls(layers, plan)
    if moved:
        _move_optimizer_state(model, moved, colocated or {})
    if moved or split:
        # Traced steps captured the old variables, layers and devices.
        model.train_function = model.test_function = model.predict_function = None
    return model


def _check_places_layers(model, layers, plan):
    """Refuses a plan that leaves out some of ``model``'s layers, before anything changes."""
    devices = plan.layer_devices
    missing = [l.name for l in layers if l.name not in devices]
    if missing:
        raise ValueError(f"the plan does not place layers {missing} of model {model.name!r}")


def _split_planned_layers(model, layers, plan, place_variables):
    """Replaces each ``Dense`` the plan splits by a ColumnParallelDense; returns the Dense layers.

    A layer already a ColumnParallelDense (the plan applied before) is left
    alone, which keeps ``apply_plan`` idempotent.
    """
    split = [l for l in layers if l.name in plan.splits and not isinstance(l, ColumnParallelDense)]
    for layer in split:
        if not place_variables:
            raise ValueError(
                f"the plan splits layer {layer.name!r} column-wise, which places "
                "variables; it cannot be applied with place_variables=False"
            )
        _split_dense(model, layer, plan.shard_devices[layer.name])
    return split


def _move_variables(model, placement):
    """Moves ``model``'s variables to their devices in ``placement``.

    Returns ``{id(old tf.Variable): new tf.Variable}`` for those that moved,
    which is how optimizer slots created next to an old one find where to go.
    """
    moved = {}
    for v in model.weights:
        device = placement.get(id(v))
        old = _move(v, device) if device is not None else None
        if old is not None:
            moved[id(old)] = v.value
    return moved


def _place_calls(layers, plan):
    """Runs each layer's call on its stage's device, and a split layer's shards on theirs."""
    devices = plan.layer_devices
    for layer in layers:
        if layer.name in plan.shard_devices:
            layer._shard_placement = list(plan.shard_devices[layer.name])
        _wrap_call(layer, devices[layer.name])


def _split_dense(model, dense, devices):
    """Replaces ``dense`` in Sequential ``model`` by a same-weights ColumnParallelDense."""
    if not isinstance(model, keras.Sequential):
        raise ValueError(
            f"the plan splits layer {dense.name!r} column-wise, which needs a Sequential "
            f"model; model {model.name!r} is not one: build the layer as a "
            "ColumnParallelDense(num_shards=...) instead"
        )
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and optimizer.built:
        raise ValueError(
            f"the plan splits layer {dense.name!r} column-wise, but the optimizer of "
            f"model {model.name!r} is already built with the unsplit variables: place the "
            "model before training it (a model loaded with its optimizer: load it with "
            "compile=False, place it, then compile)"
        )
    layer = ColumnParallelDense(
        dense.units,
        num_shards=len(devices),
        activation=dense.activation,
        use_bias=dense.use_bias,
        kernel_initializer=dense.kernel_initializer,
        bias_initializer=dense.bias_initializer,
        name=dense.name,
        dtype=dense.dtype_policy,
        activity_regularizer=dense.activity_regularizer,
        trainable=dense.trainable,
    )
    layer._shard_placement = list(devices)
    kernel = dense.kernel
    with tf.init_scope():
        layer.build((None, int(kernel.shape[0])))  # shards created on their devices
        start = 0
        for i, size in enumerate(layer.shard_sizes):
            layer.kernels[i].assign(kernel.value[:, start : start + size])
            if dense.use_bias:
                layer.biases[i].assign(dense.bias.value[start : start + size])
            start += size
    # Swap it in with Sequential's own pop/add; the other layers keep their
    # weights and the model is rebuilt once.
    index = model.layers.index(dense)
    tail = [model.pop(rebuild=False) for _ in range(len(model.layers) - index)][::-1]
    rest = [layer, *tail[1:]]
    for i, l in enumerate(rest):
        model.add(l, rebuild=i == len(rest) - 1)
    return layer


def _move_optimizer_state(model, moved, colocated):
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not optimizer.built:
        return
    for slot in optimizer.variables:
        reference = colocated.get(id(slot.value))
        if reference is not None and id(reference) in moved:
            _move(slot, moved[id(reference)].device)
    _integration.reindex_optimizer(optimizer)


def placement_report(model: keras.Model) -> dict[str, str]:
    """``{variable path: device}`` for every variable of ``model`` (for checks).

    Example:
      >>> placement_report(model)["dense_1/kernel"]  # doctest: +SKIP
      '/job:localhost/replica:0/task:0/device:CPU:1'
    """
    return {v.path: v.value.device for v in model.weights}
