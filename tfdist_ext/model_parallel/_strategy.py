"""``ModelParallelStrategy``: one replica, its layers spread over devices (internal).

Built like ``tf.distribute.OneDeviceStrategy`` (one replica, so Keras'
``fit``/``evaluate``/``predict`` and save/load work unchanged) with an
extended object that overrides these hooks:

* ``_create_variable`` (the strategy's variable creator, active inside
  ``scope()``) creates each variable on its stage's device: next to the
  variable it is a slot of (``colocate_vars_with``, used by Keras optimizers);
  on its layer's device of an explicit partition; under a
  ``device_budget_bytes`` on the device the budget fill reached (the devices
  fill in order as layers are created, a layer where its first variable fits,
  and the plan then keeps the layers there, ``plan.partition == "filled"``);
  for a model Keras builds lazily inside ``fit``/``evaluate``/... (no
  ``Input``), where Keras creates the variables uninitialized and initializes
  them once the model is built, on the device of the plan made at that moment.
  Otherwise (``"balanced"`` without a budget, model built eagerly) a balanced
  plan needs every layer's size, which only the built model has: the variables
  go to the first device and are moved once when the model is placed;
* ``_update``: optimizer updates run on the updated variable's device;
* ``Strategy.run``: when Keras hands over the ``train_step`` of a
  ``Sequential`` or functional model the step runs as the micro-batch
  pipelined, stage-by-stage step of ``_pipeline``; any other function (a
  user's own ``train_step``, a subclassed model's step, ``evaluate`` and
  ``predict`` steps) runs inside ``_placement.stage_gradients`` so that its
  gradient ops follow their forward ops' devices.

A model is *placed* (plan made, variables moved if needed, layer calls wrapped
in ``tf.device``) by :meth:`ModelParallelStrategy.place`, which the strategy
calls by itself when Keras first hands it the model: Keras' ``fit``,
``evaluate``, ``predict`` (and the ``*_on_batch`` methods) distribute their
dataset with ``experimental_distribute_dataset`` or enter ``scope()`` before
building the optimizer and before tracing any step;
``tfdist_ext._integration`` tells the strategy which model's Keras method is
running, and hands ``fit``/``train_on_batch`` to the strategy first
(``_tfdist_fit``), which refuses there what micro-batches cannot train.
"""

import dataclasses
import functools
import warnings
import weakref
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Literal

import keras
import tensorflow as tf

from tfdist_ext import _integration
from tfdist_ext.model_parallel import _pipeline
from tfdist_ext.model_parallel import _placement
from tfdist_ext.model_parallel import _plan


def _check_devices(devices):
    devices = _plan._check_devices(devices)
    available = {d.name for d in tf.config.list_logical_devices()}
    available_short = {"/device:" + n.split("/device:")[-1] for n in available}
    resolved = []
    for d in devices:
        spec = tf.DeviceSpec.from_string(d)
        short = f"/device:{spec.device_type or 'CPU'}:{spec.device_index or 0}"
        if d not in available and short not in available_short:
            raise ValueError(
                f"device {d!r} does not exist; this process has {sorted(available_short)} "
                "(split the CPU with tfdist_ext.cluster.logical_cpus(n) first)"
            )
        resolved.append(short)
    if len(set(resolved)) != len(resolved):
        raise ValueError(f"devices must be distinct, got {devices}")
    return resolved


distribute_lib = _integration.distribute_lib


def _creating_unit():
    """The top-level layer whose variable is being created: the outermost open
    layer scope, looking inside a subclassed model that is being built by its
    first call (its sub-layers are the units of its plan)."""
    stack = _integration.layer_scope_stack()
    while len(stack) > 1 and isinstance(stack[0], keras.Model) and not stack[0].built:
        stack = stack[1:]
    return stack[0] if stack else None


class ModelParallelExtended(_integration.OneDeviceExtended):
    """The ``tf.distribute.StrategyExtended`` of :class:`ModelParallelStrategy`."""

    def __init__(
        self,
        container_strategy,
        devices,
        partition,
        microbatches,
        balance_by,
        device_budget_bytes,
        split_large_layers,
    ):
        super().__init__(container_strategy, devices[0])
        self._devices = tuple(devices)
        self._partition = partition
        self._microbatches = microbatches
        self._balance_by = balance_by
        self._budget = device_budget_bytes
        self._split_large_layers = split_large_layers
        self._colocated = {}  # id(slot tf.Variable) -> reference tf.Variable
        self._plans = weakref.WeakKeyDictionary()  # model -> Plan
        self._placing = False
        # Creation-time placement: a budget fills the devices in order.
        self._unit_devices = weakref.WeakKeyDictionary()  # top-level layer -> device
        self._fill_index = 0
        self._filled_bytes = dict.fromkeys(self._devices, 0)
        # model -> {id(keras.Variable): device}, for a model built lazily
        self._deferred_devices = weakref.WeakKeyDictionary()
        self._placed = weakref.WeakSet()  # models placed (plan applied)
        self._warned = weakref.WeakSet()  # models told their train_step is not pipelined

    def _restart_filling(self):
        self._fill_index = 0
        self._filled_bytes = dict.fromkeys(self._devices, 0)

    def _create_variable(self, next_creator, **kwargs):
        colocate_with = kwargs.pop("colocate_with", None)
        forced = _placement.current_forced_device()
        if forced is not None:
            with tf.device(forced):
                return next_creator(**kwargs)
        if colocate_with is not None and hasattr(colocate_with, "device"):
            with tf.device(colocate_with.device):
                variable = next_creator(**kwargs)
            self._colocated[id(variable)] = colocate_with
            return variable
        device = self._planned_device_of_deferred_variable(kwargs)
        if device is None and isinstance(self._partition, dict):
            device = self._explicit_device()
        elif device is None and self._budget is not None and _creating_unit() is not None:
            device, kwargs = self._filled_device(_creating_unit(), kwargs)
        with tf.device(device or self._devices[0]):
            return next_creator(**kwargs)

    def _explicit_device(self):
        for layer in reversed(_integration.layer_scope_stack()):
            if layer.name in self._partition:
                return self._partition[layer.name]
        return None

    def _filled_device(self, unit, kwargs):
        """Device for a variable of top-level layer ``unit`` under a budget: the
        devices fill in order; a layer goes where its first variable fits
        (the current device, else the next one) and stays there."""
        device = self._unit_devices.get(unit, self._devices[self._fill_index])
        value = kwargs["initial_value"]
        if callable(value):  # its size decides the device
            with tf.init_scope(), tf.device(device):
                value = value()
        value = tf.convert_to_tensor(value, dtype=kwargs.get("dtype"))
        kwargs = {**kwargs, "initial_value": value}
        nbytes = value.shape.num_elements() * value.dtype.size
        if unit not in self._unit_devices:
            used = self._filled_bytes[device]
            if used and used + nbytes > self._budget and self._fill_index + 1 < len(self._devices):
                self._fill_index += 1
                device = self._devices[self._fill_index]
            self._unit_devices[unit] = device
        self._filled_bytes[device] += nbytes
        return device, kwargs

    def _planned_device_of_deferred_variable(self, kwargs):
        """For a model Keras builds lazily inside ``fit``/``evaluate``/... (its
        variables made uninitialized, then initialized one by one once its
        layers are built): the variable's device in the model's plan, made
        then, before any of its variables exist."""
        variable = _integration.variable_being_initialized()
        model = _integration.model_in_keras_call()
        if variable is None or model is None or kwargs.get("name") != variable.name:
            return None
        devices = self._deferred_devices.get(model)
        if devices is None:
            if model in self._plans or not _plan._built(model):
                return None
            plan = self._plans[model] = self._container_strategy().make_plan(model)
            devices = self._deferred_devices[model] = _placement.variable_devices(model, plan)
        return devices.get(id(variable))

    def _update(self, var, fn, args, kwargs, group):
        device = getattr(var, "device", None) or self._device
        with tf.device(device), distribute_lib.UpdateContext(device):
            result = fn(var, *args, **kwargs)
            if group:
                return result
            return tf.nest.map_structure(self._local_results, result)

    @property
    def parameter_devices(self):
        return self._devices

    def non_slot_devices(self, var_list):
        del var_list
        return (self._devices[0],)

    def _experimental_distribute_dataset(self, dataset, options):
        # One replica on one host: like the default strategy, hand the dataset
        # over as it is (OneDeviceStrategy's per-device prefetching iterator
        # costs a multi-device function call per step).
        self._container_strategy()._place_calling_model()
        del options
        return dataset

    def _distribute_datasets_from_function(self, dataset_fn, options):
        del options
        return dataset_fn(distribute_lib.InputContext())

    def _experimental_distribute_values_from_function(self, value_fn):
        return value_fn(distribute_lib.ValueContext())


class ModelParallelStrategy(distribute_lib.Strategy):
    """Model parallelism: one model's layers partitioned over several devices.

    Under ``strategy.scope()`` build and compile a Keras model as usual. The
    strategy cuts its top-level layers into contiguous stages, one per device,
    and creates each layer's variables and runs its computation on its stage's
    device; only activations cross stage boundaries. With ``microbatches > 1``
    micro-batches flow through the stages GPipe-style, with the gradients of
    the unpipelined step. ``fit``, ``evaluate``, ``predict`` and save/load work
    as usual. The guide (``docs/api/guides/model_parallel.rst``) covers where
    variables are created, which models can be pipelined and what is refused.

    Args:
      devices: device names in pipeline order (e.g. ``logical_cpus(2)``).
      partition: ``"balanced"`` (contiguous stages balancing ``balance_by``,
        then fewest boundary activation bytes) or a ``{layer name: device}`` map.
      microbatches: micro-batches per training step (>= 1; 1: no pipelining).
      balance_by: ``"params"`` or ``"flops"`` (see :func:`plan_partition`).
      device_budget_bytes: optional per-device parameter budget (bytes); the
        devices fill in order as layers are created.
      split_large_layers: with a budget, replace a ``Dense`` over it by a
        :class:`ColumnParallelDense` over several devices (``False``: raise).

    Attributes:
      plan: the :class:`Plan` of the most recently placed model (``None``
        before one is placed).

    Example:
      >>> devices = tfdist_ext.cluster.logical_cpus(2)            # doctest: +SKIP
      >>> strategy = ModelParallelStrategy(devices, microbatches=4)  # doctest: +SKIP
      >>> with strategy.scope():                                  # doctest: +SKIP
      ...     model = keras.Sequential([keras.Input((784,)),
      ...         keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])
      ...     model.compile("sgd", "sparse_categorical_crossentropy")
      >>> model.fit(x, y, batch_size=64)                          # doctest: +SKIP
      >>> print(strategy.plan)                                    # doctest: +SKIP
    """

    def __init__(
        self,
        devices: Sequence[str],
        partition: str | Mapping[str, str] = "balanced",
        microbatches: int = 1,
        *,
        balance_by: Literal["params", "flops"] = "params",
        device_budget_bytes: int | None = None,
        split_large_layers: bool = True,
    ):
        devices = _check_devices(devices)
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"microbatches must be an integer >= 1, got {microbatches!r}")
        if balance_by not in ("params", "flops"):
            raise ValueError(f"balance_by must be 'params' or 'flops', got {balance_by!r}")
        if partition != "balanced":
            if not isinstance(partition, dict) or not partition:
                raise ValueError(
                    "partition must be 'balanced' or a non-empty dict "
                    f"{{layer name: device}}, got {partition!r}"
                )
            partition = {str(k): _check_devices([v])[0] for k, v in partition.items()}
            outside = sorted(set(partition.values()) - set(devices))
            if outside:
                raise ValueError(f"partition uses devices {outside} not in devices={devices}")
        if device_budget_bytes is not None and device_budget_bytes <= 0:
            raise ValueError(f"device_budget_bytes must be positive, got {device_budget_bytes!r}")
        if not isinstance(split_large_layers, bool):
            raise ValueError(f"split_large_layers must be a bool, got {split_large_layers!r}")
        _integration.install_trainer_hooks()
        _integration.install_optimizer_hooks()  # for _tfdist_build_optimizer
        super().__init__(
            ModelParallelExtended(
                self,
                devices,
                partition,
                microbatches,
                balance_by,
                device_budget_bytes,
                split_large_layers,
            )
        )
        self.plan = None

    @property
    def devices(self):
        """The strategy's devices, in pipeline order."""
        return self.extended._devices

    @property
    def microbatches(self):
        return self.extended._microbatches

    def make_plan(self, model):
        """The :class:`Plan` this strategy would use for a built ``model``.

        Under a ``device_budget_bytes`` the layers of a model built in this
        strategy's scope were created on the devices in order as they came
        (see the class docstring): the plan keeps them there.

        Example:
          >>> print(strategy.make_plan(model))  # doctest: +SKIP
        """
        ext = self.extended
        devices = list(ext._devices)
        filled = self._filled_partition(model)
        if filled is not None:
            try:
                return dataclasses.replace(
                    _plan.plan_partition(
                        model,
                        devices,
                        filled,
                        balance_by=ext._balance_by,
                        device_budget_bytes=ext._budget,
                        split_large_layers=ext._split_large_layers,
                    ),
                    partition="filled",
                )
            except ValueError:
                pass  # e.g. column shards that fit only when spread: plan afresh
        if ext._partition == "balanced":
            n = len(_plan.top_level_layers(model))
            if len(devices) > n:
                raise ValueError(
                    f"cannot make {len(devices)} stages from the {n} layer(s) of model "
                    f"{model.name!r}: use at most {n} devices"
                )
        return _plan.plan_partition(
            model,
            devices,
            ext._partition,
            balance_by=ext._balance_by,
            device_budget_bytes=ext._budget,
            split_large_layers=ext._split_large_layers,
        )

    def _filled_partition(self, model):
        """``{layer name: device}`` where a budget filled the devices with
        ``model``'s layers at creation, or ``None`` if they were not all
        created that way."""
        ext = self.extended
        layers = [l for l in _plan.top_level_layers(model) if l.weights]
        if (
            ext._budget is None
            or ext._partition != "balanced"
            or not layers
            or any(l not in ext._unit_devices for l in layers)
        ):
            return None
        return {l.name: ext._unit_devices[l] for l in layers}

    def place(self, model):
        """Plans and places a built ``model``; returns it. Idempotent.

        ``fit``/``evaluate``/``predict`` call this by themselves; call it
        directly to see ``strategy.plan`` before training or before calling the
        model on data outside those methods.

        Example:
          >>> with strategy.scope():
          ...     model = build_model()          # doctest: +SKIP
          >>> strategy.place(model)              # doctest: +SKIP
          >>> print(strategy.plan)               # doctest: +SKIP
        """
        ext = self.extended
        plan = ext._plans.get(model)
        if plan is None:
            plan = ext._plans[model] = self.make_plan(model)
            ext._restart_filling()  # the next model fills the devices afresh
        _placement.apply_plan(model, plan, colocated=ext._colocated)
        for variable in model.weights:
            # The strategy now owns these variables (some may have been built
            # outside its scope): Keras' optimizer may colocate slots with them.
            _integration.set_variable_strategy(variable.value, self)
        optimizer = getattr(model, "optimizer", None)
        if (
            optimizer is not None
            and not optimizer.built
            and _integration.optimizer_strategy(optimizer) is not None
        ):
            # An optimizer constructed outside the scope (e.g. passed to
            # compile) would create its slots through the default strategy.
            _integration.set_optimizer_strategy(optimizer, self)
        ext._placed.add(model)
        self.plan = plan
        return model

    def _place_calling_model(self):
        ext = self.extended
        if ext._placing:
            return
        model = _integration.model_in_keras_call()
        if model is None or not model.built:
            return
        if model.distribute_strategy is not self:
            self._refuse_foreign_steps(model)
            return
        if model in ext._placed:
            return
        ext._placing = True
        try:
            self.place(model)
        finally:
            ext._placing = False

    def _tfdist_build_optimizer(self, optimizer, variables):
        """Called before this strategy's ``optimizer`` creates its slots (see
        ``_integration.install_optimizer_hooks``): slots made outside this
        scope would fail in ``colocate_vars_with`` with a less helpful error."""
        del optimizer, variables
        model = _integration.model_in_keras_call()
        if model is not None and model.built and model.distribute_strategy is not self:
            self._refuse_foreign_steps(model)

    def _refuse_foreign_steps(self, model):
        """Refuses a model compiled in this scope whose steps Keras runs with
        another strategy, when this strategy first sees it (the optimizer's
        build or first update, while the first step is traced; nothing has
        run yet).

        Keras takes a model's strategy from the scope the model was built in,
        or else from the scope ``fit`` is called in: a model built outside the
        scope and trained outside it has its steps run by the default
        strategy, so none of its layers would be placed or pipelined, and
        placing it now, half-way through tracing a step, would break Keras's
        step function.
        """
        if _integration.optimizer_strategy(getattr(model, "optimizer", None)) is not self:
            return  # not compiled in this scope: not this strategy's model
        other = model.distribute_strategy
        raise ValueError(
            f"model {model.name!r} was built outside strategy.scope() and is trained "
            f"outside it, so Keras runs its steps with {type(other).__name__}, not this "
            "ModelParallelStrategy: its layers would not be placed on "
            f"{list(self.devices)}. Build the model inside strategy.scope() (or call "
            "fit/train_on_batch inside strategy.scope())."
        )

    def scope(self):  # pylint: disable=useless-super-delegation
        """The strategy's scope: variables created inside are placed by it."""
        self._place_calling_model()
        return super().scope()

    # -- trainer hooks (see tfdist_ext._integration.install_trainer_hooks) --

    def _tfdist_fit(self, model, keras_fit, args, kwargs):
        self._check_trainable(model)
        return keras_fit(model, *args, **kwargs)

    def _tfdist_train_on_batch(self, model, keras_train_on_batch, args, kwargs):
        self._check_trainable(model)
        return keras_train_on_batch(model, *args, **kwargs)

    def _check_trainable(self, model):
        """Refuses, before anything runs, what cannot be trained on these devices."""
        if model.jit_compile:
            raise ValueError(
                "ModelParallelStrategy: jit_compile=True cannot hold: XLA compiles a "
                f"step for one device, and the variables of model {model.name!r} live on "
                f"{list(self.devices)}. Compile with jit_compile=False (or leave the "
                "default 'auto', which is False under a strategy)."
            )
        if self.microbatches == 1:
            return
        overridden = _integration.overridden_step(model)
        if overridden is not None:
            if model not in self.extended._warned:
                self.extended._warned.add(model)
                warnings.warn(
                    f"model {model.name!r} overrides train_step ({overridden.__name__}): "
                    f"your step runs as written, on whole batches, without the "
                    f"microbatches={self.microbatches} pipeline (its gradients still "
                    "run on their stages' devices); to pipeline, use Keras's own "
                    "train_step (customise compute_loss instead)",
                    stacklevel=4,
                )
            return
        problem = _pipeline.pipeline_problem(model)
        if problem is not None:
            raise ValueError(
                f"microbatches={self.microbatches} cannot train {problem}. Train it with "
                "ModelParallelStrategy(..., microbatches=1) (its sub-layers are still "
                "placed per stage), or build it as a Sequential or functional model. "
                "(evaluate and predict need no micro-batches and work either way.)"
            )
        problem = _pipeline.batch_statistics_problem(model, self.microbatches)
        if problem is not None:
            raise ValueError(problem)

    def run(self, fn, args=(), kwargs=None, options=None):
        """As ``tf.distribute.Strategy.run``; a model's ``train_step`` is pipelined."""
        model = getattr(fn, "__self__", None)
        if (
            isinstance(model, keras.Model)
            and getattr(fn, "__name__", "") == "train_step"
            and _integration.overridden_step(model) is None
            and _pipeline.pipeline_problem(model) is None
        ):
            if model not in self.extended._placed:
                self.place(model)
            fn = functools.partial(
                _pipeline.pipelined_train_step,
                model,
                self.extended._plans[model],
                self.microbatches,
            )
        else:
            # A user's train_step, a subclassed model's, evaluate, predict:
            # tape.gradient would put every backward op on the first device.
            fn = _with_stage_gradients(fn)
        return super().run(fn, args, kwargs, options)


def _with_stage_gradients(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with _placement.stage_gradients():
            return fn(*args, **kwargs)

    return run
