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
  changing the layer's class, config or saved form.
"""

import contextlib
import functools
import threading

_LOCAL = threading.local()


@contextlib.contextmanager
def forced_device(device):
    """Variables created inside go to ``device`` even under a strategy scope."""
    previous = getattr(_LOCAL, "device", None)
    _LOCAL.device = device
    try:
        yield
    finally:
        _LOCAL.device = previous


def current_forced_device():
    return getattr(_LOCAL, "device", None)


def same_device(a, b):
    """Whether two device strings name the same device (type and index)."""
    import tensorflow as tf

    if not a or not b:
        return False
    da, db = tf.DeviceSpec.from_string(a), tf.DeviceSpec.from_string(b)
    return (da.device_type or "CPU") == (db.device_type or "CPU") and \
        (da.device_index or 0) == (db.device_index or 0)


def _move(keras_variable, device):
    """Re-creates ``keras_variable``'s tf.Variable on ``device``; True if moved."""
    import tensorflow as tf

    old = keras_variable.value
    if same_device(old.device, device):
        return None
    with tf.init_scope(), forced_device(device), tf.device(device):
        new = tf.Variable(
            tf.identity(old.read_value()), trainable=old.trainable,
            name=keras_variable.name, aggregation=old.aggregation,
            synchronization=old.synchronization,
        )
    if hasattr(old, "_distribute_strategy"):
        # Marks the variable as created in the strategy's scope (checked by
        # ``colocate_vars_with`` when an optimizer makes its slots).
        new._distribute_strategy = old._distribute_strategy
    keras_variable._value = new
    return old


def _wrap_call(layer, device):
    import tensorflow as tf

    original = layer.__dict__.get("_tfdist_original_call")
    if original is None:
        original = layer.call
    if getattr(layer, "_tfdist_device", None) == device:
        return

    @functools.wraps(original)
    def call(*args, **kwargs):
        with tf.device(device):
            return original(*args, **kwargs)

    layer.__dict__["_tfdist_original_call"] = original
    layer.__dict__["_tfdist_device"] = device
    layer.__dict__["call"] = call


def layer_variables(layer):
    return list(layer.weights)


def apply_plan(model, plan, *, place_variables=True, colocated=None):
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
    from tfdist_ext.model_parallel._plan import top_level_layers

    layers = top_level_layers(model)
    devices = plan.layer_devices
    missing = [l.name for l in layers if l.name not in devices]
    if missing:
        raise ValueError(f"the plan does not place layers {missing} of model {model.name!r}")
    moved = {}
    for layer in layers:
        device = devices[layer.name]
        shard_ids = set()
        if layer.name in plan.shard_devices:
            shard_devices = list(plan.shard_devices[layer.name])
            layer._shard_placement = shard_devices
            for shard, shard_device in zip(layer.shard_variables(), shard_devices):
                for v in shard:
                    shard_ids.add(id(v))
                    old = _move(v, shard_device) if place_variables else None
                    if old is not None:
                        moved[id(old)] = v.value
        for v in layer_variables(layer):
            if id(v) in shard_ids:
                continue
            old = _move(v, device) if place_variables else None
            if old is not None:
                moved[id(old)] = v.value
        _wrap_call(layer, device)
    if moved:
        _move_optimizer_state(model, moved, colocated or {})
        model.train_function = model.test_function = model.predict_function = None
    return model


def _move_optimizer_state(model, moved, colocated):
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not optimizer.built:
        return
    for slot in optimizer.variables:
        reference = colocated.get(id(slot.value))
        if reference is not None and id(reference) in moved:
            _move(slot, moved[id(reference)].device)
    optimizer._trainable_variables_indices = {
        optimizer._var_key(v): i for i, v in enumerate(optimizer._trainable_variables)
    }


def placement_report(model):
    """``{variable path: device}`` for every variable of ``model`` (for checks).

    Example:
      >>> placement_report(model)["dense_1/kernel"]  # doctest: +SKIP
      '/job:localhost/replica:0/task:0/device:CPU:1'
    """
    return {v.path: v.value.device for v in model.weights}
