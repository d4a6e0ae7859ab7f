"""The one door into Keras and TensorFlow internals (internal).

Every private Keras or TensorFlow symbol the package relies on is imported
here, and only here, and checked at import: that it exists and, for
functions we call or wrap, that it takes the arguments we pass. If any check
fails, importing ``tfdist_ext`` fails with one message naming the installed
Keras and TensorFlow versions and the tested range, instead of a strategy
misbehaving silently later (a renamed hook would otherwise just never be
called).

What we rely on, and why no public API does it:

* ``TensorFlowTrainer.fit/evaluate/predict/*_on_batch`` are wrapped once
  (:func:`install_trainer_hooks`): Keras 3 has no parameter-server path, so a
  strategy with its own loop (Downpour, Sandblaster) receives the call, and a
  strategy that must see the model before Keras traces a step
  (``ModelParallelStrategy``) learns which model is running
  (:func:`model_in_keras_call`) instead of inspecting the call stack. Models
  under any other strategy take Keras's own path, untouched.
* ``Trainer._get_metrics_result_or_logs`` (called by ``fit`` right after each
  epoch's last batch) is wrapped the same way, so an asynchronous strategy can
  wait for the epoch's work before Keras reads the logs.
* ``TFOptimizer._all_reduce_sum_gradients`` (where Keras sums gradients over
  replicas) and the optimizer's ``build`` are routed to the strategy when it
  defines ``_tfdist_all_reduce_sum_gradients`` / ``_tfdist_build_optimizer``
  (:func:`install_optimizer_hooks`): the compressed strategies exchange the
  compressed form there.
* ``Trainer._compute_loss``, ``_loss_tracker``, ``_compile_metrics``,
  ``Layer._call_has_training_arg``: what Keras's own ``train_step`` uses to
  compute the loss and metrics exactly as ``fit`` would.
* TensorFlow's parameter-server strategy, ``ShardedVariable``, the
  coordinator's per-worker resources, remote datasets, collective keys and
  the eager context: ``tf.distribute`` exposes the classes but not the
  extension points a Downpour round needs.

Keras is pinned in ``setup.cfg`` to :data:`KERAS_TESTED`'s range; CI tests
both ends (tox envs ``keras-oldest`` and ``keras-newest``).
"""

import contextvars
import functools
import inspect
import itertools
import threading

import keras
import tensorflow as tf

#: Oldest and newest Keras versions the test suite runs against.
KERAS_TESTED = ("3.12.0", "3.15.1")
#: The TensorFlow minor version the package is built for.
TENSORFLOW_TESTED = "2.21"

_problems = []


def _check(owner, name, *, params=()):
    """``getattr(owner, name)``; records a problem if missing or if it lacks ``params``."""
    label = f"{getattr(owner, '__module__', '')}.{getattr(owner, '__qualname__', owner)}.{name}"
    value = getattr(owner, name, None)
    if value is None:
        _problems.append(f"{label} is missing")
        return None
    if params:
        try:
            have = set(inspect.signature(value).parameters)
        except (TypeError, ValueError):
            have = set()
        missing = [p for p in params if p not in have]
        if missing:
            _problems.append(f"{label} no longer takes {', '.join(missing)}")
    return value


def _import(module, *names):
    """``from module import names`` as a tuple; records a problem for each that fails."""
    import importlib

    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        _problems.append(f"module {module} cannot be imported ({e})")
        return (None,) * len(names)
    found = []
    for name in names:
        value = getattr(mod, name, None)
        if value is None:
            _problems.append(f"{module}.{name} is missing")
        found.append(value)
    return tuple(found)


# -- Keras ------------------------------------------------------------------

(TensorFlowTrainer,) = _import("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer")
(TFOptimizer,) = _import("keras.src.backend.tensorflow.optimizer", "TFOptimizer")
(global_state,) = _import("keras.src.backend.common", "global_state")
(train_validation_split,) = _import(
    "keras.src.trainers.data_adapters.array_slicing", "train_validation_split")
#: Public since Keras 3.0.
unpack_x_y_sample_weight = keras.utils.unpack_x_y_sample_weight

_TRAINER_ENTRY_POINTS = ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch",
                         "predict_on_batch")
if TensorFlowTrainer is not None:
    _check(TensorFlowTrainer, "fit", params=("x", "y", "epochs", "callbacks"))
    for _name in _TRAINER_ENTRY_POINTS[1:]:
        _check(TensorFlowTrainer, _name)
    _check(TensorFlowTrainer, "train_step", params=("data",))
    _check(TensorFlowTrainer, "_get_metrics_result_or_logs", params=("logs",))
    _check(TensorFlowTrainer, "_compute_loss",
           params=("x", "y", "y_pred", "sample_weight", "training"))
    _check(TensorFlowTrainer, "compute_metrics", params=("x", "y", "y_pred", "sample_weight"))
    _check(TensorFlowTrainer, "get_metrics_result")
if TFOptimizer is not None:
    _check(TFOptimizer, "_all_reduce_sum_gradients", params=("grads_and_vars",))
if global_state is not None:
    _check(global_state, "get_global_attribute")

# -- TensorFlow -------------------------------------------------------------

(distribute_lib,) = _import("tensorflow.python.distribute", "distribute_lib")
(ParameterServerStrategyV2, ParameterServerStrategyV2Extended) = _import(
    "tensorflow.python.distribute.parameter_server_strategy_v2",
    "ParameterServerStrategyV2", "ParameterServerStrategyV2Extended")
(ShardedVariable,) = _import("tensorflow.python.distribute.sharded_variable", "ShardedVariable")
(OneDeviceExtended,) = _import("tensorflow.python.distribute.one_device_strategy",
                               "OneDeviceExtended")
(get_iterator_spec_from_dataset,) = _import("tensorflow.python.distribute.input_lib",
                                            "get_iterator_spec_from_dataset")
(ClusterCoordinator,) = _import("tensorflow.python.distribute.coordinator.cluster_coordinator",
                                "ClusterCoordinator")
(RemoteValueStatus,) = _import("tensorflow.python.distribute.coordinator.remote_value",
                               "RemoteValueStatus")
(PerWorkerDistributedIterator, PerWorkerValues) = _import(
    "tensorflow.python.distribute.coordinator.values",
    "PerWorkerDistributedIterator", "PerWorkerValues")
(RemoteDataset,) = _import("tensorflow.python.data.experimental.ops.distribute",
                           "_RemoteDataset")
(ResourceVariable,) = _import("tensorflow.python.ops.resource_variable_ops",
                              "ResourceVariable")
(colocate_with,) = _import("tensorflow.python.framework.ops", "colocate_with")
(eager_context,) = _import("tensorflow.python.eager", "context")
(executor_lib,) = _import("tensorflow.python.eager", "executor")
(server_lib,) = _import("tensorflow.python.training", "server_lib")

if distribute_lib is not None:
    _check(distribute_lib, "UpdateContext")
    _check(distribute_lib, "InputContext")
    _check(distribute_lib, "ValueContext")
if ParameterServerStrategyV2Extended is not None:
    for _name in ("_create_variable", "_update", "_create_variable_round_robin"):
        _check(ParameterServerStrategyV2Extended, _name)
if tf.data.Dataset is not None:
    _check(tf.data.Dataset, "_as_serialized_graph",
           params=("strip_device_assignment", "external_state_policy"))

# compressed strategies: where MirroredStrategy / MultiWorkerMirroredStrategy
# start their collective group keys (read from the strategy object by the
# extended's constructor; TensorFlow's own tests raise it for the same reason).
for _cls in (tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy):
    if not isinstance(getattr(_cls, "_collective_key_base", None), int):
        _problems.append(f"{_cls.__module__}.{_cls.__qualname__}._collective_key_base "
                         "is missing")

if _problems:
    raise ImportError(
        f"tfdist_ext does not support Keras {keras.__version__} with TensorFlow "
        f"{tf.__version__} (tested: Keras {KERAS_TESTED[0]} to {KERAS_TESTED[1]}, "
        f"TensorFlow {TENSORFLOW_TESTED}.x); these internals it relies on changed: "
        + "; ".join(_problems)
        + f". Install a tested Keras: pip install 'keras>={KERAS_TESTED[0]},<=" 
        + f"{KERAS_TESTED[1]}'"
    )


# -- what Keras's own train_step uses ----------------------------------------

def compute_loss(model, x, y, y_pred, sample_weight=None, training=True):
    """The model's loss exactly as Keras's ``train_step`` computes it (honours a
    user's ``compute_loss`` override, with or without its ``training`` arg)."""
    return model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                               training=training)


def loss_tracker(model):
    """The ``Mean`` metric behind the ``loss`` entry of ``fit``'s logs."""
    tracker = getattr(model, "_loss_tracker", None)
    if tracker is None:
        raise ValueError(f"model {model.name!r} is not compiled (call model.compile first)")
    return tracker


def compiled_metrics(model):
    """The model's compiled metrics container, or ``None`` before it is built."""
    return getattr(model, "_compile_metrics", None)


def call_has_training_arg(layer):
    """Whether ``layer.call`` takes a ``training`` argument."""
    return bool(getattr(layer, "_call_has_training_arg", False))


def call_model(model, x, training):
    """``model(x, training=training)`` where the model takes the argument."""
    if call_has_training_arg(model):
        return model(x, training=training)
    return model(x)


def default_train_step():
    """Keras's own ``train_step`` (TensorFlow backend)."""
    return TensorFlowTrainer.train_step


def overridden_step(model, name="train_step"):
    """The class that overrides Keras's ``name`` (e.g. ``"train_step"``) for
    ``model``, or ``None`` when the model uses Keras's own step."""
    default = getattr(TensorFlowTrainer, name)
    for cls in type(model).__mro__:
        if name in vars(cls):
            return None if vars(cls)[name] is default else cls
    return None


def layer_scope_stack():
    """Keras layers whose name scopes are open now (outermost first)."""
    stack = global_state.get_global_attribute("name_scope_stack") or []
    return [e.caller for e in stack if isinstance(getattr(e, "caller", None), keras.layers.Layer)]


# -- hooks --------------------------------------------------------------------

_HOOK_LOCK = threading.Lock()
_TRAINER_HOOKED = False
_OPTIMIZER_HOOKED = False
_current_model = contextvars.ContextVar("tfdist_ext_current_model", default=None)


def model_in_keras_call():
    """The model whose ``fit``/``evaluate``/``predict``/``*_on_batch`` is running
    in this thread (innermost), or ``None``. Needs :func:`install_trainer_hooks`."""
    return _current_model.get()


def _strategy_of(model):
    try:
        return model.distribute_strategy
    except Exception:  # noqa: BLE001 - a half-built model: no strategy to ask
        return None


def install_trainer_hooks():
    """Wraps Keras's trainer entry points once (idempotent).

    For ``fit`` (and the others) the wrapper records the running model (see
    :func:`model_in_keras_call`) and, when the model's strategy defines
    ``_tfdist_<method>(model, keras_method, args, kwargs)``, hands the call to
    it; otherwise Keras's method runs unchanged. ``_get_metrics_result_or_logs``
    goes to ``strategy._tfdist_epoch_logs(model, logs, keras_method)`` when
    defined.
    """
    global _TRAINER_HOOKED
    with _HOOK_LOCK:
        if _TRAINER_HOOKED:
            return
        for name in _TRAINER_ENTRY_POINTS:
            _wrap_entry_point(name)
        original_logs = TensorFlowTrainer._get_metrics_result_or_logs

        @functools.wraps(original_logs)
        def _get_metrics_result_or_logs(self, logs):
            handler = getattr(_strategy_of(self), "_tfdist_epoch_logs", None)
            if handler is not None:
                return handler(self, logs, original_logs)
            return original_logs(self, logs)

        TensorFlowTrainer._get_metrics_result_or_logs = _get_metrics_result_or_logs
        _TRAINER_HOOKED = True


def _wrap_entry_point(name):
    original = getattr(TensorFlowTrainer, name)

    @functools.wraps(original)
    def entry_point(self, *args, **kwargs):
        token = _current_model.set(self)
        try:
            handler = getattr(_strategy_of(self), f"_tfdist_{name}", None)
            if handler is not None:
                return handler(self, original, args, kwargs)
            return original(self, *args, **kwargs)
        finally:
            _current_model.reset(token)

    setattr(TensorFlowTrainer, name, entry_point)


def install_optimizer_hooks():
    """Routes Keras's gradient all-reduce and optimizer ``build`` to the strategy (idempotent).

    An optimizer whose strategy defines
    ``_tfdist_all_reduce_sum_gradients(optimizer, grads_and_vars)`` has its
    replica-context gradient sum done there; one whose strategy defines
    ``_tfdist_build_optimizer(optimizer, variables)`` has it called before the
    optimizer creates its slots (to refuse what the strategy cannot train,
    before step 1).
    """
    global _OPTIMIZER_HOOKED
    with _HOOK_LOCK:
        if _OPTIMIZER_HOOKED:
            return
        original = TFOptimizer._all_reduce_sum_gradients

        @functools.wraps(original)
        def _all_reduce_sum_gradients(self, grads_and_vars):
            strategy = getattr(self, "_distribution_strategy", None)
            handler = getattr(strategy, "_tfdist_all_reduce_sum_gradients", None)
            if (handler is not None and tf.distribute.in_cross_replica_context() is False
                    and tf.distribute.has_strategy()):
                return handler(self, grads_and_vars)
            return original(self, grads_and_vars)

        TFOptimizer._all_reduce_sum_gradients = _all_reduce_sum_gradients

        # TFOptimizer defines no ``build``: this one sits between the concrete
        # optimizers' ``build`` (SGD, Adam, ...) and BaseOptimizer's in the MRO.
        def build(self, variables):
            strategy = getattr(self, "_distribution_strategy", None)
            handler = getattr(strategy, "_tfdist_build_optimizer", None)
            if handler is not None:
                handler(self, variables)
            return super(TFOptimizer, self).build(variables)

        TFOptimizer.build = build
        _OPTIMIZER_HOOKED = True


def optimizer_strategy(optimizer):
    """The strategy an optimizer creates its variables under."""
    return getattr(optimizer, "_distribution_strategy", None)


def set_optimizer_strategy(optimizer, strategy):
    """Makes an optimizer built later create its variables under ``strategy``."""
    optimizer._distribution_strategy = strategy


# -- collective keys (compressed strategies) ---------------------------------

#: Group keys one strategy may use: TensorFlow allocates a handful (one per
#: device set) upwards from its base; ``MirroredStrategy`` starts at 1.
COLLECTIVE_KEY_STRIDE = 100_000
_collective_key_bases = itertools.count(1)


def claim_collective_keys(strategy):
    """Gives ``strategy`` collective group keys no other strategy in this process uses.

    Call in ``__init__`` before ``tf.distribute`` constructs the extended
    object. TensorFlow's collective runtime keeps the parameters (op type,
    dtype, shape) of every (group key, instance key) it has seen for the life
    of the process, and every new ``MirroredStrategy`` starts again at group
    key 1, instance key 100; a second strategy in the same process then
    collides with the first one's cached collectives. The bases are handed
    out in creation order, so processes of a multi-worker job that create
    their strategies in the same order (the same program) agree on them.
    """
    strategy._collective_key_base = next(_collective_key_bases) * COLLECTIVE_KEY_STRIDE
