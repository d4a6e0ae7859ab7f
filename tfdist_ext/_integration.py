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
* The trainer module's ``reduce_per_replica`` (how Keras's step function
  reduces a step's logs over the replicas) is routed to the strategy when it
  defines ``_tfdist_reduce_per_replica`` (:func:`install_trainer_hooks`):
  under a multi-worker strategy Keras reduces every log with a collective of
  its own, and the synchronous strategy reduces them in one;
  ``CollectiveAllReduceExtended._in_multi_worker_mode`` tells it when Keras
  would reduce across workers at all.
* ``TFOptimizer._all_reduce_sum_gradients`` (where Keras sums gradients over
  replicas) and the optimizer's ``build`` are routed to the strategy when it
  defines ``_tfdist_all_reduce_sum_gradients`` / ``_tfdist_build_optimizer``
  (:func:`install_optimizer_hooks`): the compressed strategies exchange the
  compressed form there.
* ``Optimizer._apply_weight_decay`` / ``_use_weight_decay`` /
  ``_get_variable_index``: ``LARS`` overrides the first (its weight decay is
  added to the gradient, not decoupled) and asks the second which variables
  ``exclude_from_weight_decay`` excludes; the third is how every Keras
  optimizer finds a variable's slots (no public accessor exists).
* ``Trainer._compute_loss``, ``_loss_tracker``, ``_compile_metrics``,
  ``Layer._call_has_training_arg``: what Keras's own ``train_step`` uses to
  compute the loss and metrics exactly as ``fit`` would.
* ``Layer._flatten_layers`` and ``Layer._get_own_losses``: the losses a
  layer's call added (``add_loss``, activity regularizers), which the
  pipelined model-parallel step sends their gradient in the stage that
  computed them; ``Layer.losses`` mixes in freshly computed weight
  regularization, with no public way to tell the two apart.
* For model parallelism: a functional model's graph (``Function``'s
  ``_nodes_by_depth`` and ``_outputs_struct``, ``SymbolicArguments.fill_in``)
  and Keras masks, to cut the graph into pipeline stages; the list of
  variables Keras creates uninitialized while it builds a model lazily, to
  create each on its stage's device; ``KerasVariable._value``,
  ``tf.Variable._distribute_strategy`` and the optimizer's slot index, to move
  a variable a plan places elsewhere.
* For the piece-by-piece update of a variable split across ``ps`` tasks:
  ``KerasVariable._value`` (a slot points at its piece while the update is
  traced) and ``TFOptimizer._var_key``'s ``_distributed_container`` hook (how
  the piece finds its variable's slots).
* ``BaseOptimizer``'s backend-neutral update (``stateless_apply``,
  ``assign*``, ``_apply_weight_decay``, ``_backend_update_step``) and
  ``TFOptimizer._var_key``: elastic averaging runs the compiled optimizer's
  update on each replica's tensors (:func:`stateless_apply`), which Keras's
  TensorFlow optimizer refuses.
* ``ParameterServerStrategyV2Extended``: Downpour and Sandblaster place
  variables through a subclass of it, which :func:`use_extended` installs
  in place of the one TensorFlow's ``__init__`` builds.
* ``CollectiveReplicaLauncher``'s keys, options and ordering token and
  ``collective_ops.all_reduce_v2``: the compressed multi-worker strategy sums
  through TensorFlow's ring subdivided into pipelined chunks
  (:func:`pipelined_all_sum`), which the launcher never asks for.
* TensorFlow's parameter-server strategy, ``ShardedVariable``, the
  coordinator's per-worker resources, remote datasets, collective keys and
  the eager context: ``tf.distribute`` exposes the classes but not the
  extension points a Downpour round needs.
* ``ShardedVariable`` gets the ``__array__`` (and ``numpy``) it lacks
  (:func:`make_sharded_variables_readable`), so that Keras saving reads a
  variable split across ``ps`` tasks as one array; the parameter-server
  extended object gets the ``_cluster_resolver`` the public
  ``strategy.cluster_resolver`` reads, and runs without a coordinator on
  the chief without a warning per trace.
* ``OneDeviceExtended``'s ``_device``, ``_local_results``,
  ``_container_strategy`` and the methods ``ModelParallelStrategy``'s
  extended overrides (``_create_variable``, ``_update``, the
  ``_experimental_distribute_*`` / ``_distribute_datasets_from_function``
  hooks).
* ``BaseOptimizer._learning_rate`` (:func:`given_learning_rate`): the rate
  an optimizer was given, to tell a schedule (``LinearScalingWarmup``
  refuses one: it sets the rate itself); ``learning_rate`` is only its
  current value.
* ``Operation._inbound_nodes`` and a ``KerasTensor``'s ``_keras_history``
  (:func:`inbound_nodes`, :func:`producer`): ``apply_goyal_recipe`` walks a
  functional model's graph backwards from each ``Add`` to find the
  normalisation ending each residual branch.
* ``BackupAndRestore._load_model`` / ``_save_model``:
  ``_state_backup.StateBackupAndRestore`` restores and saves a strategy's
  own state (a compressor's, EASGD's replicas) where Keras restores and
  saves the model.

Keras is pinned in ``setup.cfg`` to :data:`KERAS_TESTED`'s range; CI tests
both ends (tox envs ``keras-oldest`` and ``keras-newest``).
"""

import contextlib
import contextvars
import functools
import importlib
import inspect
import itertools
import threading

import keras
import numpy as np
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


def _check_source(function, text):
    """Records a problem unless ``function``'s source contains ``text`` (an
    attribute we read or replace that has no other handle to check)."""
    label = f"{getattr(function, '__module__', '')}.{getattr(function, '__qualname__', function)}"
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        _problems.append(f"the source of {label} cannot be read")
        return
    if text not in source:
        _problems.append(f"{label} no longer contains {text!r}")


def _import(module, *names):
    """``from module import names`` as a tuple; records a problem for each that fails."""
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


def _check_sets(owner, method, attr):
    """Records a problem unless ``owner.method``'s source assigns ``self.attr``
    (for instance attributes, which cannot be checked on the class)."""
    try:
        source = inspect.getsource(getattr(owner, method))
    except (AttributeError, OSError, TypeError):
        source = ""
    if f"self.{attr} =" not in source:
        _problems.append(f"{owner.__module__}.{owner.__qualname__}.{method} no longer sets {attr}")


# -- Keras ------------------------------------------------------------------

(TensorFlowTrainer,) = _import("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer")
(TFOptimizer,) = _import("keras.src.backend.tensorflow.optimizer", "TFOptimizer")
(global_state,) = _import("keras.src.backend.common", "global_state")
(train_validation_split,) = _import(
    "keras.src.trainers.data_adapters.array_slicing", "train_validation_split"
)
(get_data_adapter,) = _import("keras.src.trainers.data_adapters", "get_data_adapter")
if get_data_adapter is not None:
    _params = set(inspect.signature(get_data_adapter).parameters)
    _wanted = ("x", "y", "sample_weight", "batch_size", "shuffle", "class_weight")
    for _name in _wanted:
        if _name not in _params:
            _problems.append(f"keras get_data_adapter no longer takes {_name}")
#: Public since Keras 3.0.
unpack_x_y_sample_weight = keras.utils.unpack_x_y_sample_weight

_TRAINER_ENTRY_POINTS = (
    "fit",
    "evaluate",
    "predict",
    "train_on_batch",
    "test_on_batch",
    "predict_on_batch",
)
if TensorFlowTrainer is not None:
    _check(TensorFlowTrainer, "fit", params=("x", "y", "epochs", "callbacks"))
    for _name in _TRAINER_ENTRY_POINTS[1:]:
        _check(TensorFlowTrainer, _name)
    _check(TensorFlowTrainer, "train_step", params=("data",))
    _check(TensorFlowTrainer, "_get_metrics_result_or_logs", params=("logs",))
    _check(
        TensorFlowTrainer, "_compute_loss", params=("x", "y", "y_pred", "sample_weight", "training")
    )
    _check(TensorFlowTrainer, "compute_metrics", params=("x", "y", "y_pred", "sample_weight"))
    _check(TensorFlowTrainer, "get_metrics_result")
    _check(TensorFlowTrainer, "_maybe_symbolic_build", params=("iterator", "data_batch"))
    _check_source(TensorFlowTrainer._maybe_symbolic_build, "for _, _, it in iterator:")
    # The step functions call the module's function by name: replacing it there reaches them.
    _check_source(TensorFlowTrainer._make_function, "outputs = reduce_per_replica(")
    _keras_trainer_module = importlib.import_module(TensorFlowTrainer.__module__)
    keras_reduce_per_replica = _check(
        _keras_trainer_module, "reduce_per_replica", params=("values", "strategy", "reduction")
    )
(PyDatasetEnqueuer,) = _import(
    "keras.src.trainers.data_adapters.py_dataset_adapter", "PyDatasetEnqueuer"
)
(EpochIterator,) = _import("keras.src.trainers.epoch_iterator", "EpochIterator")
if EpochIterator is not None:
    _check_sets(EpochIterator, "__init__", "data_adapter")
if PyDatasetEnqueuer is not None:
    _check_sets(PyDatasetEnqueuer, "__init__", "ready_queue")
    _check_source(PyDatasetEnqueuer.stop, "self.ready_queue.put(inputs)")
    _check(PyDatasetEnqueuer, "stop", params=("drain_queue_and_join",))
if TFOptimizer is not None:
    _check(TFOptimizer, "_all_reduce_sum_gradients", params=("grads_and_vars",))
    # A split variable's piece finds its slots through this hook (_ps_strategy).
    _check_source(TFOptimizer._var_key, "_distributed_container")
_check(keras.optimizers.Optimizer, "apply", params=("grads", "trainable_variables"))
_check(keras.optimizers.LossScaleOptimizer, "apply", params=("grads", "trainable_variables"))
# LARS (optimizers/_lars.py) replaces Keras's decoupled weight decay by its own
# (added to the gradient) and honours Keras's exclude_from_weight_decay.
_check(keras.optimizers.Optimizer, "_apply_weight_decay", params=("variables",))
_check(keras.optimizers.Optimizer, "_use_weight_decay", params=("variable",))
_check(keras.optimizers.Optimizer, "_get_variable_index", params=("variable",))
if global_state is not None:
    _check(global_state, "get_global_attribute")
# What a layer's call added with add_loss (the pipelined step sends these
# losses their gradient in the stage that computed them).
_check(keras.layers.Layer, "_flatten_layers", params=("include_self",))
_check(keras.layers.Layer, "_get_own_losses")

# model parallelism: a functional model's layer graph (the pipelined step cuts
# it into stages; a tensor's Keras mask, e.g. from Embedding(mask_zero=True),
# is carried across the cuts), and the variables Keras creates uninitialized in
# a StatelessScope while ``fit`` builds a model lazily (placed as they are
# initialized).
(Functional,) = _import("keras.src.models.functional", "Functional")
(Function,) = _import("keras.src.ops.function", "Function")
(SymbolicArguments,) = _import("keras.src.ops.symbolic_arguments", "SymbolicArguments")
(KerasVariable,) = _import("keras.src.backend.common.variables", "Variable")


(get_keras_mask, set_keras_mask) = _import(
    "keras.src.backend.common.masking", "get_keras_mask", "set_keras_mask"
)
(BaseOptimizer,) = _import("keras.src.optimizers.base_optimizer", "BaseOptimizer")
if Function is not None:
    _check_sets(Function, "__init__", "_nodes_by_depth")
    _check_sets(Function, "__init__", "_outputs_struct")
if SymbolicArguments is not None:
    _check(SymbolicArguments, "fill_in", params=("tensor_dict",))
if KerasVariable is not None:
    _check(KerasVariable, "_deferred_initialize")
    _check_sets(KerasVariable, "__init__", "_value")
if BaseOptimizer is not None:
    _check_sets(BaseOptimizer, "__init__", "_trainable_variables_indices")
    _check_sets(BaseOptimizer, "build", "_trainable_variables")
    _check(BaseOptimizer, "_var_key", params=("variable",))
    _check(BaseOptimizer, "_get_current_learning_rate")
    _check_source(BaseOptimizer.learning_rate.fget, "self._get_current_learning_rate()")
    _check_source(BaseOptimizer._backend_apply_gradients, "self.learning_rate")
    # LinearScalingWarmup: the rate the optimizer was given (a schedule or
    # not), which ``learning_rate`` (its current value) does not tell.
    _check_sets(BaseOptimizer, "__init__", "_learning_rate")

# recipes (residual_branch_norms): a functional model's graph read backwards
# from a layer: the nodes that called it, the tensors each read, and the
# layer that made each tensor.
(Operation,) = _import("keras.src.ops.operation", "Operation")
(Node, KerasHistory) = _import("keras.src.ops.node", "Node", "KerasHistory")
if Operation is not None:
    _check_sets(Operation, "__init__", "_inbound_nodes")
if Node is not None:
    _check(Node, "input_tensors")
    _check_source(Node.__init__, "tensor._keras_history = KerasHistory(")
if KerasHistory is not None:
    _check(KerasHistory, "operation")

# StateBackupAndRestore saves and restores a strategy's own state where
# Keras's BackupAndRestore saves and restores the model.
_check(keras.callbacks.BackupAndRestore, "_load_model")
_check(keras.callbacks.BackupAndRestore, "_save_model")
_check_source(keras.callbacks.BackupAndRestore.on_train_begin, "self._load_model()")
_check_source(keras.callbacks.BackupAndRestore.on_epoch_end, "self._save_model()")

# Elastic averaging updates each replica with Keras's backend-neutral
# optimizer, on tensors (stateless_apply): the TensorFlow optimizer's
# in-place versions of these are set aside while the update is traced.
_IN_PLACE_UPDATES = (
    "stateless_apply",
    "assign",
    "assign_add",
    "assign_sub",
    "_apply_weight_decay",
    "_backend_update_step",
)
if BaseOptimizer is not None and TFOptimizer is not None:
    _check(
        BaseOptimizer,
        "stateless_apply",
        params=("optimizer_variables", "grads", "trainable_variables"),
    )
    for _name in _IN_PLACE_UPDATES:
        _check(BaseOptimizer, _name)
        _check(TFOptimizer, _name)

# -- TensorFlow -------------------------------------------------------------

(distribute_lib,) = _import("tensorflow.python.distribute", "distribute_lib")
(ParameterServerStrategyV2, ParameterServerStrategyV2Extended) = _import(
    "tensorflow.python.distribute.parameter_server_strategy_v2",
    "ParameterServerStrategyV2",
    "ParameterServerStrategyV2Extended",
)
(ShardedVariable,) = _import("tensorflow.python.distribute.sharded_variable", "ShardedVariable")
(OneDeviceExtended,) = _import(
    "tensorflow.python.distribute.one_device_strategy", "OneDeviceExtended"
)
(get_iterator_spec_from_dataset,) = _import(
    "tensorflow.python.distribute.input_lib", "get_iterator_spec_from_dataset"
)
(ClusterCoordinator,) = _import(
    "tensorflow.python.distribute.coordinator.cluster_coordinator", "ClusterCoordinator"
)
(RemoteValueStatus,) = _import(
    "tensorflow.python.distribute.coordinator.remote_value", "RemoteValueStatus"
)
(PerWorkerDistributedIterator, PerWorkerValues) = _import(
    "tensorflow.python.distribute.coordinator.values",
    "PerWorkerDistributedIterator",
    "PerWorkerValues",
)
(RemoteDataset,) = _import("tensorflow.python.data.experimental.ops.distribute", "_RemoteDataset")
(ResourceVariable,) = _import("tensorflow.python.ops.resource_variable_ops", "ResourceVariable")
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
# Keras saving reads a split variable as one array (make_sharded_variables_readable):
# TensorFlow converts a ShardedVariable to one tensor, its shards concatenated.
(tensor_conversion_functions,) = _import(
    "tensorflow.python.framework.tensor_conversion_registry", "get"
)
if ShardedVariable is not None and tensor_conversion_functions is not None:
    if not any(base is ShardedVariable for base, _ in tensor_conversion_functions(ShardedVariable)):
        _problems.append(
            "tensorflow.python.distribute.sharded_variable.ShardedVariable no longer "
            "converts to one tensor"
        )
# ModelParallelStrategy's extended: a OneDeviceExtended that places each
# variable and update on its stage's device.
_MODEL_PARALLEL_OVERRIDES = (
    "_create_variable",
    "_update",
    "_experimental_distribute_dataset",
    "_distribute_datasets_from_function",
    "_experimental_distribute_values_from_function",
)
if OneDeviceExtended is not None:
    for _name in _MODEL_PARALLEL_OVERRIDES:
        _check(OneDeviceExtended, _name)
    _check(OneDeviceExtended, "_local_results", params=("value",))
    _check(OneDeviceExtended, "_container_strategy")
    _check_sets(OneDeviceExtended, "__init__", "_device")
if tf.data.Dataset is not None:
    _check(
        tf.data.Dataset,
        "_as_serialized_graph",
        params=("strip_device_assignment", "external_state_policy"),
    )

# model parallelism: a variable moved to its stage's device keeps its strategy.
(BaseResourceVariable,) = _import(
    "tensorflow.python.ops.resource_variable_ops", "BaseResourceVariable"
)
if BaseResourceVariable is not None:
    _check_sets(BaseResourceVariable, "__init__", "_distribute_strategy")

# Parameter-server placement (Downpour, Sandblaster): a StrategyExtended
# subclass replaces the one ParameterServerStrategyV2.__init__ builds
# (see use_extended).
if ParameterServerStrategyV2Extended is not None and distribute_lib is not None:
    _check(
        ParameterServerStrategyV2Extended,
        "__init__",
        params=("container_strategy", "cluster_resolver", "variable_partitioner"),
    )
    _check(
        ParameterServerStrategyV2Extended,
        "_update",
        params=("var", "fn", "args", "kwargs", "group"),
    )
    _check(ParameterServerStrategyV2Extended, "_use_merge_call")
    _check_source(
        ParameterServerStrategyV2.__init__, "self._extended = ParameterServerStrategyV2Extended("
    )
    _check_source(ParameterServerStrategyV2Extended.__init__, "self._allow_run_without_coordinator")
    # What the public ``strategy.cluster_resolver`` returns (set_cluster_resolver).
    _check_source(distribute_lib.StrategyBase.cluster_resolver.fget, "extended._cluster_resolver")
    _check_source(
        distribute_lib.StrategyBase.__init__, "extended._retrace_functions_for_each_device"
    )

# Downpour: the coordinator's per-worker resources and round status.
(coordinator_lib,) = _import("tensorflow.python.distribute.coordinator", "cluster_coordinator")
(coordinator_values,) = _import("tensorflow.python.distribute.coordinator", "values")
if coordinator_lib is not None and coordinator_values is not None:
    _check(coordinator_lib.Worker, "create_resource", params=("function", "args"))
    _check(coordinator_lib, "_maybe_as_type_spec", params=("val",))
    _check(coordinator_lib, "_select_worker_slice", params=("worker_id", "structured"))
    _check_source(coordinator_lib.Closure.__init__, "_select_worker_slice(0, self._args)")
    _check_source(coordinator_lib.ClusterCoordinator.__init__, "self._cluster = Cluster(")
    _check_source(coordinator_lib.Cluster.__init__, "self.workers = ")
    _check_source(coordinator_values.RemoteValueImpl.__init__, "self._status = ")
    _check_source(coordinator_values.RemoteValueImpl.__init__, "self._type_spec = ")

# lifecycle (clean exit, parameters back on the chief): the coordinator's
# threads are stopped without ``WorkerPreemptionHandler.stop``, which waits for
# a lock the recovery thread holds as long as a killed worker stays down.
if coordinator_lib is not None:
    _check(coordinator_lib, "Cluster")
    _check(coordinator_lib.Cluster, "stop")
    _check(coordinator_lib, "WorkerPreemptionHandler")
    _check(coordinator_lib.WorkerPreemptionHandler, "_preemption_handler")
    _check(coordinator_lib, "Worker")
    _check(coordinator_lib.Worker, "stop")
if eager_context is not None:
    _check(eager_context, "get_server_def")
    _check(eager_context.Context, "update_server_def", params=("server_def",))
if keras.Variable is not None:
    _check(keras.Variable, "_initialize", params=("value",))

# compressed strategies: which cross-device ops a mirrored strategy uses (Keras's
# multi-step fit loop fails with the default collectives, not with reduction
# to one device).
(MirroredExtended,) = _import("tensorflow.python.distribute.mirrored_strategy", "MirroredExtended")
if MirroredExtended is not None:
    _check_source(MirroredExtended.__init__, "self._cross_device_ops = cross_device_ops")

# compressed strategies: where MirroredStrategy / MultiWorkerMirroredStrategy
# start their collective group keys (read from the strategy object by the
# extended's constructor; TensorFlow's own tests raise it for the same reason).
for _cls in (tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy):
    if not isinstance(getattr(_cls, "_collective_key_base", None), int):
        _problems.append(f"{_cls.__module__}.{_cls.__qualname__}._collective_key_base is missing")

# compressed multi-worker strategy: TensorFlow's ring, subdivided and pipelined
# (pipelined_all_sum).
(collective_ops,) = _import("tensorflow.python.ops", "collective_ops")
(CollectiveAllReduceExtended,) = _import(
    "tensorflow.python.distribute.collective_all_reduce_strategy", "CollectiveAllReduceExtended"
)
(CollectiveAllReduce,) = _import(
    "tensorflow.python.distribute.cross_device_ops", "CollectiveAllReduce"
)
(CollectiveReplicaLauncher, group_by_size) = _import(
    "tensorflow.python.distribute.cross_device_utils", "CollectiveReplicaLauncher", "group_by_size"
)
if collective_ops is not None:
    _check(
        collective_ops,
        "all_reduce_v2",
        params=("communication_hint", "timeout", "ordering_token", "max_subdivs_per_device"),
    )
if CollectiveAllReduceExtended is not None:
    _check_sets(CollectiveAllReduceExtended, "_initialize_multi_worker", "_cross_device_ops")
    _check(CollectiveAllReduceExtended, "_in_multi_worker_mode")
    _check(
        CollectiveAllReduceExtended,
        "_reduce_to",
        params=("reduce_op", "value", "destinations", "options"),
    )
if CollectiveAllReduce is not None:
    _check_sets(CollectiveAllReduce, "__init__", "_launchers")
if CollectiveReplicaLauncher is not None:
    for _name in ("_group_key", "_group_size", "_device", "_options"):
        _check_sets(CollectiveReplicaLauncher, "__init__", _name)
    _check(CollectiveReplicaLauncher, "_next_instance_key")
    _check(CollectiveReplicaLauncher, "_get_ordering_token")

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
    return model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
    )


def loss_tracker(model):
    """The ``Mean`` metric behind the ``loss`` entry of ``fit``'s logs."""
    tracker = getattr(model, "_loss_tracker", None)
    if tracker is None:
        raise ValueError(f"model {model.name!r} is not compiled (call model.compile first)")
    return tracker


def compiled_metrics(model):
    """The model's compiled metrics container, or ``None`` before it is built."""
    return getattr(model, "_compile_metrics", None)


def compiled_loss_metrics(model):
    """The per-output loss trackers (``<output>_loss`` in ``fit``'s logs) that
    Keras's compiled loss updates inside ``compute_loss``; ``[]`` for one output."""
    compile_loss = getattr(model, "_compile_loss", None)
    return [] if compile_loss is None else list(compile_loss.metrics)


def sublayers(layer):
    """``layer`` and every layer it tracks, recursively (custom layers' too)."""
    return list(layer._flatten_layers(include_self=True, recursive=True))


def added_losses(layer):
    """The losses ``layer``'s last call added (``add_loss``, activity
    regularizers), its sublayers' included; no weight regularization.

    Keras clears them when a layer is called outside another layer's call.
    A functional graph's plain operations (``keras.ops``) add none.
    """
    if not isinstance(layer, keras.layers.Layer):
        return []
    return [loss for sub in layer._flatten_layers() for loss in sub._get_own_losses()]


#: Held while a model is called to trace a step (see :func:`one_trace_at_a_time`).
_TRACE_LOCK = threading.RLock()


def one_trace_at_a_time():
    """A lock to hold while tracing a call of a shared model from a thread.

    A Keras layer keeps per-call state on itself: the ids of the losses its
    call added (``add_loss``, activity regularizers), cleared when a new call
    starts. Two threads tracing the same model at once (Sandblaster's
    per-worker functions) clear each other's, and ``model.losses`` then
    leaves the term out of one of them. Tracing runs the Python once, so the
    lock costs nothing when the traced function runs.
    """
    return _TRACE_LOCK


def call_has_training_arg(layer):
    """Whether ``layer.call`` takes a ``training`` argument."""
    return bool(getattr(layer, "_call_has_training_arg", False))


def call_model(model, x, training):
    """``model(x, training=training)`` where the model takes the argument."""
    if call_has_training_arg(model):
        return model(x, training=training)
    return model(x)


def overridden_step(model, name="train_step"):
    """The class that overrides Keras's ``name`` (e.g. ``"train_step"``) for
    ``model``, or ``None`` when the model uses Keras's own step."""
    default = getattr(TensorFlowTrainer, name)
    for cls in type(model).__mro__:
        if name in vars(cls):
            return None if vars(cls)[name] is default else cls
    return None


def inbound_nodes(layer):
    """The nodes of every call of ``layer`` on symbolic tensors (a functional
    model's graph), in call order; ``node.input_tensors`` are what each read."""
    return list(getattr(layer, "_inbound_nodes", ()))


def producer(tensor):
    """The layer (operation) whose call made ``KerasTensor`` ``tensor``, or ``None``
    (a model input, or not a symbolic tensor)."""
    history = getattr(tensor, "_keras_history", None)
    return None if history is None else history.operation


def layer_scope_stack():
    """Keras layers whose name scopes are open now (outermost first)."""
    stack = global_state.get_global_attribute("name_scope_stack") or []
    return [e.caller for e in stack if isinstance(getattr(e, "caller", None), keras.layers.Layer)]


def creating_layer():
    """The Keras layer whose weight is being created now (the innermost name
    scope's caller, as ``Layer.add_weight`` opens it), or ``None`` (e.g. an
    optimizer's ``add_variable``)."""
    stack = global_state.get_global_attribute("name_scope_stack") or []
    caller = getattr(stack[-1], "caller", None) if stack else None
    return caller if isinstance(caller, keras.layers.Layer) else None


# model parallelism


def graph_nodes(model):
    """The call nodes of functional ``model`` in a topological order, as
    ``(layer, node)`` pairs; ``node.input_tensors`` and ``node.outputs`` are
    the ``KerasTensor``s it reads and writes (input layers left out)."""
    nodes = model._nodes_by_depth
    return [
        (node.operation, node)
        for depth in sorted(nodes, reverse=True)
        for node in nodes[depth]
        if node.operation is not None and not node.is_input
    ]


def node_arguments(node, values):
    """``(args, kwargs)`` of ``node``'s call with its ``KerasTensor``s replaced
    by ``values[id(keras_tensor)]``."""
    return node.arguments.fill_in(values)


def is_functional(model):
    """Whether ``model`` is a functional model (built from ``keras.Input``)."""
    return isinstance(model, Functional)


def output_structure(model):
    """The nesting of functional ``model``'s outputs (as its call returns them)."""
    return model._outputs_struct


def variable_being_initialized():
    """The ``keras.Variable`` whose deferred initialization is running now (the
    first of those Keras created uninitialized in a ``StatelessScope``, e.g.
    while ``fit`` builds a model lazily, that still has no value), or ``None``."""
    pending = global_state.get_global_attribute("uninitialized_variables") or []
    return next((v for v in pending if v._value is None), None)


def swap_variable(variable, tf_variable):
    """Makes ``keras.Variable`` ``variable`` hold ``tf_variable`` (e.g. a copy on
    another device): every Keras reference to ``variable`` sees the new one."""
    variable._value = tf_variable


@contextlib.contextmanager
def swapped_variable(variable, tf_variable):
    """Within the block, ``keras.Variable`` ``variable`` holds ``tf_variable``
    (for tracing: a split slot's piece while that piece is updated)."""
    original = variable._value
    variable._value = tf_variable
    try:
        yield
    finally:
        variable._value = original


def variable_value(variable):
    """The ``tf.Variable`` (or ``ShardedVariable``) behind a ``keras.Variable``;
    anything else is returned as it is."""
    return getattr(variable, "_value", variable)


def variable_strategy(tf_variable):
    """The ``tf.distribute`` strategy ``tf_variable`` was created under, or ``None``."""
    return getattr(tf_variable, "_distribute_strategy", None)


def set_variable_strategy(tf_variable, strategy):
    """Marks ``tf_variable`` as created under ``strategy`` (what
    ``colocate_vars_with`` checks when an optimizer makes its slots)."""
    tf_variable._distribute_strategy = strategy


def reindex_optimizer(optimizer):
    """Re-keys a built optimizer's per-variable slots after its variables'
    ``tf.Variable``s were swapped (the TensorFlow optimizer keys them by the
    ``tf.Variable``)."""
    optimizer._trainable_variables_indices = {
        optimizer._var_key(v): i for i, v in enumerate(optimizer._trainable_variables)
    }


def given_learning_rate(optimizer):
    """The rate ``optimizer`` was given or last set to: a ``LearningRateSchedule``,
    a callable or the rate's variable (``optimizer.learning_rate`` is its
    current value, a schedule's too)."""
    return optimizer._learning_rate


@contextlib.contextmanager
def scaled_learning_rate(optimizer, factor):
    """Within the block, ``optimizer.learning_rate`` (what its ``apply`` uses:
    a variable, a schedule's value or a constant) is multiplied by ``factor``
    (a tensor). For tracing one apply (Downpour's ``StalenessAwareLR``)."""
    original = optimizer._get_current_learning_rate

    def scaled():
        rate = tf.convert_to_tensor(original())
        return rate * tf.cast(factor, rate.dtype)

    optimizer._get_current_learning_rate = scaled
    try:
        yield
    finally:
        del optimizer._get_current_learning_rate


def stateless_apply(optimizer, optimizer_values, grads, values, variables):
    """Keras's ``optimizer.stateless_apply``, under the TensorFlow backend too.

    Returns ``(new values, new optimizer values)``: the optimizer's update by
    ``grads`` of ``values`` (tensors for ``variables``, the trainable
    variables the optimizer was built with) and of ``optimizer_values``
    (tensors for ``optimizer.variables``); no variable is written. Keras's
    TensorFlow optimizer refuses ``stateless_apply`` because its update
    writes through ``tf.distribute``; here, while the update is traced, the
    optimizer (and a ``LossScaleOptimizer``'s inner one) updates as Keras's
    backend-neutral optimizer does, clipping, weight decay and constraints
    included.
    """
    parts = [optimizer]
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        parts.append(optimizer.inner_optimizer)
    with one_trace_at_a_time(), contextlib.ExitStack() as stack:
        for part in parts:
            stack.enter_context(_backend_neutral(part, variables))
        return optimizer.stateless_apply(optimizer_values, grads, values)


@contextlib.contextmanager
def _backend_neutral(optimizer, variables):
    """Within the block, ``optimizer`` updates as ``BaseOptimizer`` does (see :func:`stateless_apply`)."""
    methods = {
        name: getattr(BaseOptimizer, name).__get__(optimizer)
        for name in _IN_PLACE_UPDATES
        if getattr(type(optimizer), name) is getattr(TFOptimizer, name)
    }
    # A slot is found by its variable's key, which TensorFlow's optimizer
    # reads from the variable's value: a tensor inside the StatelessScope.
    keys = {id(v): optimizer._var_key(v) for v in variables}
    var_key = optimizer._var_key
    methods["_var_key"] = lambda v: keys[id(v)] if id(v) in keys else var_key(v)
    # Instance attributes (not the class's): this optimizer only, only while traced.
    vars(optimizer).update(methods)
    try:
        yield
    finally:
        for name in methods:
            vars(optimizer).pop(name, None)


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
        _wrap_symbolic_build()
        _wrap_log_reduction()
        _TRAINER_HOOKED = True


def _wrap_log_reduction():
    """Keras's step functions reduce a step's logs with the trainer module's
    ``reduce_per_replica``; a strategy that defines
    ``_tfdist_reduce_per_replica(values, reduction, keras_reduce)`` gets the
    call, every other strategy Keras's own."""
    original = keras_reduce_per_replica

    # Not functools.wraps: autograph would find Keras's source through
    # ``__wrapped__`` and convert that instead of this function.
    @tf.autograph.experimental.do_not_convert
    def reduce_per_replica(values, strategy, reduction):
        handler = getattr(strategy, "_tfdist_reduce_per_replica", None)
        if handler is not None:
            return handler(values, reduction, original)
        return original(values, strategy, reduction)

    _keras_trainer_module.reduce_per_replica = reduce_per_replica


def in_multi_worker_mode(strategy):
    """Whether a collective strategy spans several workers (Keras's test for
    reducing a step's logs across them)."""
    return strategy.extended._in_multi_worker_mode()


def _wrap_symbolic_build():
    """Under a strategy (only there) Keras builds the model from one batch of an
    epoch it then abandons. A threaded or multiprocess ``PyDataset``'s
    enqueuer keeps what it prefetched for that epoch and yields it first in
    the next, so the first real epochs train the wrong batches. Under a
    tfdist_ext strategy, what the abandoned epoch prefetched is dropped."""
    original = TensorFlowTrainer._maybe_symbolic_build

    @functools.wraps(original)
    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        result = original(self, iterator=iterator, data_batch=data_batch)
        strategy = _strategy_of(self)
        enqueuer = getattr(getattr(iterator, "data_adapter", None), "enqueuer", None)
        if enqueuer is not None and type(strategy).__module__.startswith("tfdist_ext."):
            # Keras's reset, next, stops the enqueuer, keeping its prefetched
            # batches for the next run: stop it here and drop them.
            enqueuer.stop()
            while not enqueuer.ready_queue.empty():
                enqueuer.ready_queue.get_nowait()
        return result

    TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build


def _wrap_entry_point(name):
    original = getattr(TensorFlowTrainer, name)

    @functools.wraps(original)
    def entry_point(self, *args, **kwargs):
        token = _current_model.set(self)
        try:
            handler = getattr(_strategy_of(self), f"_tfdist_{name}", None)
            if handler is not None:
                if name == "fit":
                    kwargs = _no_default_shuffle(original, self, args, kwargs)
                return handler(self, original, args, kwargs)
            return original(self, *args, **kwargs)
        finally:
            _current_model.reset(token)

    setattr(TensorFlowTrainer, name, entry_point)


def _no_default_shuffle(fit, model, args, kwargs):
    """``kwargs`` with ``shuffle=False`` when ``x`` is a dataset and the user left
    ``shuffle`` out: Keras's default ``shuffle=True`` would only make it warn
    that it ignores the flag for a dataset. An explicit ``shuffle`` is kept."""
    try:
        arguments = inspect.signature(fit).bind(model, *args, **kwargs).arguments
    except TypeError:  # a wrong call: Keras's fit raises its own error
        return kwargs
    datasets = (tf.data.Dataset, tf.distribute.DistributedDataset)
    if "shuffle" in arguments or not isinstance(arguments.get("x"), datasets):
        return kwargs
    return dict(kwargs, shuffle=False)


def install_optimizer_hooks():
    """Routes Keras's gradient all-reduce and optimizer ``build`` to the strategy (idempotent).

    An optimizer whose strategy defines
    ``_tfdist_apply(optimizer, grads, variables, keras_apply)`` has its
    ``apply`` (and so ``apply_gradients``) handed to it. One whose strategy defines
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
            if (
                handler is not None
                and tf.distribute.in_cross_replica_context() is False
                and tf.distribute.has_strategy()
            ):
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
        for cls in (keras.optimizers.Optimizer, keras.optimizers.LossScaleOptimizer):
            _wrap_apply(cls)
        _OPTIMIZER_HOOKED = True


def _wrap_apply(cls):
    """``cls.apply`` goes to ``strategy._tfdist_apply(optimizer, grads,
    variables, keras_apply)`` when the optimizer's strategy defines it."""
    original = cls.apply

    @functools.wraps(original)
    def apply(self, grads, trainable_variables=None):
        handler = getattr(optimizer_strategy(self), "_tfdist_apply", None)
        if handler is not None:
            return handler(self, grads, trainable_variables, original)
        return original(self, grads, trainable_variables)

    cls.apply = apply


def optimizer_strategy(optimizer):
    """The strategy an optimizer creates its variables under."""
    return getattr(optimizer, "_distribution_strategy", None)


def set_optimizer_strategy(optimizer, strategy):
    """Makes an optimizer built later create its variables under ``strategy``."""
    optimizer._distribution_strategy = strategy


# -- parameter-server placement (Downpour, Sandblaster) -------------------------


def set_cluster_resolver(extended, cluster_resolver):
    """Makes the public ``strategy.cluster_resolver`` of ``extended``'s strategy
    return ``cluster_resolver`` (TensorFlow's parameter-server extended object
    leaves it unset: ``None``)."""
    extended._cluster_resolver = cluster_resolver


def allow_run_without_coordinator(extended):
    """Lets ``extended``'s parameter-server strategy run functions on this
    process without a ``ClusterCoordinator`` (Keras evaluates and predicts on
    the chief) without TensorFlow's warning at every trace."""
    extended._allow_run_without_coordinator = True


def make_sharded_variables_readable():
    """Lets Keras saving read a split variable as one array.

    Keras reads weights with ``np.asarray(variable)``; TensorFlow's
    ``ShardedVariable`` converts to a tensor but has no ``__array__``. Adds
    the readers it lacks to the class (nothing else of it changes; a reader
    TensorFlow has is kept).
    """
    if not hasattr(ShardedVariable, "__array__"):
        ShardedVariable.__array__ = _sharded_array
    if not hasattr(ShardedVariable, "numpy"):
        ShardedVariable.numpy = _sharded_numpy


def _sharded_numpy(variable):
    return tf.convert_to_tensor(variable).numpy()


def _sharded_array(variable, dtype=None, copy=None):
    return np.asarray(_sharded_numpy(variable), dtype=dtype)


def use_extended(strategy, extended):
    """Makes a just-built ``ParameterServerStrategyV2`` use ``extended``.

    ``extended`` is an instance of a ``ParameterServerStrategyV2Extended``
    subclass built for ``strategy``. TensorFlow's ``__init__`` builds its own
    extended object with no way to choose the class; the strategy's public
    ``extended`` property and all of its methods read ``_extended``. Call
    before any variable is created.
    """
    extended._retrace_functions_for_each_device = (
        strategy._extended._retrace_functions_for_each_device
    )
    strategy._extended = extended


# -- Downpour: the coordinator's per-worker resources ----------------------------


def coordinator_workers(coordinator):
    """The ``Worker`` objects of a ``ClusterCoordinator``, in task order."""
    return coordinator._cluster.workers


def per_worker_resource(worker, function, args, type_spec):
    """``worker.create_resource(function, args)`` whose value has ``type_spec``."""
    remote = worker.create_resource(function, args=args)
    if type_spec is not None:
        remote._type_spec = type_spec
    return remote


def scheduled_arg_specs(structure):
    """What ``ClusterCoordinator.schedule`` traces a function with for these
    arguments: per-worker values as worker 0's value's type spec, the rest as
    they are."""
    sliced = coordinator_lib._select_worker_slice(0, structure)
    return tf.nest.map_structure(coordinator_lib._maybe_as_type_spec, sliced)


def reduces_to_one_device(strategy):
    """Whether a ``MirroredStrategy`` sums through ``ReductionToOneDevice``."""
    ops = getattr(strategy.extended, "_cross_device_ops", None)
    return isinstance(ops, tf.distribute.ReductionToOneDevice)


def remote_value_status(remote):
    """A scheduled function's ``RemoteValueStatus`` (without blocking)."""
    return remote._status


def serialized_dataset_graph(dataset):
    """``dataset``'s graph, without device placement, to rebuild it on another task."""
    return dataset._as_serialized_graph(
        strip_device_assignment=True,
        external_state_policy=tf.data.experimental.ExternalStatePolicy.WARN,
    ).numpy()


# -- lifecycle: clean exit and parameters back on the chief --------------------

if ClusterCoordinator is not None:

    class ClosableClusterCoordinator(ClusterCoordinator):
        """TensorFlow's ``ClusterCoordinator`` that can be shut down without hanging.

        TensorFlow stops a coordinator only in ``__del__``, through
        ``WorkerPreemptionHandler.stop``, which takes the lock that the
        recovery thread holds while it waits for a killed worker to come
        back: with a worker down, interpreter exit hung for good. Here
        :meth:`shutdown` asks every coordinator thread to stop without that
        lock, and ``__del__`` does the same.
        """

        def __init__(self, strategy):
            super().__init__(strategy)
            handler = self._cluster.failure_handler
            server_def = getattr(handler, "_server_def", None)
            if server_def is not None and server_def.HasField("cluster_device_filters"):
                # Recovery re-sends the server def; TensorFlow ignores the
                # filters then and logs a warning each time it sees them.
                handler._server_def = _without_device_filters(server_def)

        def shutdown(self):
            """Stops the worker, recovery and queue threads; never blocks (idempotent)."""
            cluster = getattr(self, "_cluster", None)
            if cluster is None:
                return
            handler = cluster.failure_handler
            wake = getattr(handler, "_cluster_due_for_update_or_finish", None)
            if wake is not None:  # WorkerPreemptionHandler: stop() without its lock
                handler._should_preemption_thread_run = False
                wake.set()
            else:  # the coordination-service handler's stop() does not block
                handler.stop()
            for worker in cluster.workers:
                worker.stop()
            cluster.closure_queue.stop()
            cluster.resource_cancellation_mgr.start_cancel()

        def __del__(self):
            self.shutdown()


def _without_device_filters(server_def):
    copy = type(server_def)()
    copy.CopyFrom(server_def)
    copy.ClearField("cluster_device_filters")
    return copy


def disconnect_from_cluster():
    """Makes the eager runtime of this process local again (its own job only).

    TensorFlow closes its contexts on the other tasks. Functions and tensors
    deleted afterwards are then removed here only, instead of by one RPC per
    task -- to tasks that, once the cluster has stopped, refuse the
    connection (hundreds of error lines at exit). Returns whether the
    process was connected.
    """
    server_def = eager_context.get_server_def()
    if server_def is None:
        return False
    local = _without_device_filters(server_def)
    jobs = [job for job in local.cluster.job if job.name == local.job_name]
    del local.cluster.job[:]
    local.cluster.job.extend(jobs)
    eager_context.context().update_server_def(local)
    return True


def replace_variable_value(variable, value):
    """Points a Keras variable at another ``tf.Variable`` (Keras's own
    ``_initialize`` path for a ``tf.Variable`` value)."""
    variable._value = None
    variable._initialize(value)


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


def reduce_nests(extended):
    """Lets a ``CollectiveAllReduceExtended``'s ``_reduce_to`` take a nest of values.

    Keras 3's ``fit`` reduces the first input batch, an ``(x, y)`` tuple of
    ``PerReplica``, with ``strategy.reduce("MEAN", ...)`` before building;
    MirroredStrategy maps over the nest, the collective extended does not
    (it tries to convert the tuple to one tensor and fails), so plain
    ``MultiWorkerMirroredStrategy`` cannot ``fit`` in Keras 3. Map here too.
    """
    original = extended._reduce_to

    def _reduce_to(reduce_op, value, destinations, options):
        if isinstance(value, (tuple, list, dict)):
            return tf.nest.map_structure(
                lambda v: original(reduce_op, v, destinations, options), value
            )
        return original(reduce_op, value, destinations, options)

    extended._reduce_to = _reduce_to


# -- pipelined all-reduce (compressed multi-worker strategy) -----------------

#: Upper bound on the ring's subdivisions per device (TensorFlow stops
#: subdividing once a chunk is at most 4 MiB, so 16 lets a 128 MiB sum over
#: two workers reach that size).
MAX_SUBDIVS = 16


def pipelined_all_sum(extended, replica, tensors):
    """Sums ``tensors`` over every replica of a multi-worker collective strategy.

    What ``ReplicaContext.all_reduce(SUM, tensors)`` does under
    ``MultiWorkerMirroredStrategy`` (one ring all-reduce per pack of
    ``CommunicationOptions.bytes_per_pack``, ordered with the strategy's other
    collectives, the same group and instance keys) with one difference: the
    ring is subdivided. TensorFlow's launcher asks for no subdivision, so a
    large sum over two workers crosses as two messages each half its size, one
    after the other, and a message's gRPC copies and parsing wait for all of
    its bytes. Subdivided into chunks of at most 4 MiB, the chunks pipeline:
    one is parsed and summed while the next crosses.

    ``replica``: the local replica's index (its launcher's). Tensors of
    several dtypes are summed in one collective per dtype.
    """
    launcher = extended._cross_device_ops._launchers[replica]
    options = launcher._options
    by_dtype = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    out = [None] * len(tensors)
    with tf.device(launcher._device):
        for indices in by_dtype.values():
            # Last first, as TensorFlow packs: the last layers' gradients exist first.
            order = indices[::-1]
            packs = group_by_size([tensors[i] for i in order], options.bytes_per_pack)
            totals = [t for pack in packs for t in _subdivided_sum(launcher, options, pack)]
            for i, total in zip(order, totals):
                out[i] = total
    return out


def _subdivided_sum(launcher, options, tensors):
    flat = tf.concat([tf.reshape(t, [-1]) for t in tensors], 0)
    summed = collective_ops.all_reduce_v2(
        flat,
        launcher._group_size,
        launcher._group_key,
        launcher._next_instance_key(),
        communication_hint=options.implementation.value,
        timeout=options.timeout_seconds,
        ordering_token=launcher._get_ordering_token(),
        max_subdivs_per_device=MAX_SUBDIVS,
    )
    sizes = tf.stack([tf.size(t) for t in tensors])
    parts = tf.split(summed, sizes, num=len(tensors))
    return [
        tf.reshape(part, t.shape if t.shape.is_fully_defined() else tf.shape(t))
        for part, t in zip(parts, tensors)
    ]
