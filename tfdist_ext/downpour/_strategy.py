"""DownpourStrategy: asynchronous Downpour SGD for Keras 3 ``model.fit``."""

import math
import threading
import types

import tensorflow as tf
from tensorflow.python.distribute import parameter_server_strategy_v2
from tensorflow.python.distribute.coordinator import cluster_coordinator

from tfdist_ext.cluster._local import ping
from tfdist_ext.downpour import _fit
from tfdist_ext.downpour._stats import DownpourStats


def _positive_int(name, value, low=1):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(
            f"DownpourStrategy: {name} must be an integer >= {low}, got {value!r}"
        )
    return value


def _variable_bytes(kwargs):
    """A variable's size before it exists (for placement).

    Keras passes the initial value as a shapeless callable: it is evaluated
    here once and handed on as a tensor, so it is not computed twice.
    """
    shape, dtype = kwargs.get("shape"), kwargs.get("dtype")
    if shape is not None and tf.TensorShape(shape).is_fully_defined():
        return tf.TensorShape(shape).num_elements() * tf.as_dtype(dtype or tf.float32).size
    initial_value = kwargs.get("initial_value")
    if initial_value is None:
        return 0
    if callable(initial_value):
        initial_value = kwargs["initial_value"] = initial_value()
    value = tf.convert_to_tensor(initial_value, dtype=dtype)
    return value.shape.num_elements() * value.dtype.size


class DownpourStrategy(parameter_server_strategy_v2.ParameterServerStrategyV2):
    """Downpour SGD (Dean et al., 2012) as a ``tf.distribute`` strategy.

    Model replicas run asynchronously on the ``worker`` tasks; the parameters
    and the optimizer state live on the ``ps`` tasks, sharded: variables of at
    least ``min_shard_bytes`` are split along their first axis across the
    ``ps`` tasks, smaller ones are placed whole on the least-loaded shard so
    that shards carry balanced bytes. Each replica keeps a local copy of the
    parameters, fetches fresh ones every ``n_fetch`` steps, accumulates its
    gradients locally and pushes their sum every ``n_push`` steps; the ``ps``
    tasks apply the user's compiled optimizer (Adagrad in the paper) to each
    push. Pushes holding NaN or Inf are rejected and counted. Replicas never
    wait for each other.

    Use it as any Keras user uses a strategy: build and compile under
    ``scope()``, then ``fit``, ``evaluate``, ``predict`` and ``save`` as usual.
    ``fit`` reports ``staleness_mean``/``staleness_max`` (server updates
    between a replica's fetch and its push), ``pushes``,
    ``rejected_pushes`` and bytes per step in the logs and ``History``;
    ``strategy.stats`` keeps every staleness value.

    Dispatch, worker-failure handling and variable placement are TensorFlow's
    own: the strategy extends ``ParameterServerStrategy`` and schedules each
    round of local steps with ``ClusterCoordinator``. A killed worker loses
    only its unsent gradients; the others carry on and it rejoins when it is
    back. A lost ``ps`` task stops ``fit`` with a clear error within
    ``deadline`` seconds.

    Args:
      cluster_resolver: resolver of a cluster with ``chief`` (this process),
        ``worker`` and ``ps`` jobs, e.g. ``LocalCluster(...).resolver``.
      n_fetch: fetch parameters from the server every ``n_fetch`` steps.
      n_push: push the accumulated gradient every ``n_push`` steps.
      warmstart_steps: train the first steps on a single replica (one step at
        a time, in order) before the other replicas join.
      min_shard_bytes: variables at least this large are split across the
        ``ps`` tasks.
      deadline: seconds any wait on another task may take before it fails.
      compression: a ``tfdist_ext.compression`` compressor (or its name, e.g.
        ``"ef_topk"``) applied to every push: the worker sends the compressed
        wire form, the ``ps`` task owning each variable decompresses it, and
        the compressor's state (error-feedback residuals, DGC momenta) stays
        on the worker. ``push_bytes_per_step`` then counts the wire tensors.
      model_devices: devices of one worker task (e.g. ``["/device:CPU:0",
        "/device:CPU:1"]``) over which each replica's model is partitioned,
        as in DistBelief: contiguous stages balanced by parameter bytes
        (``tfdist_ext.model_parallel.plan_partition``), computation placed
        stage by stage, only activations crossing stages. The plan is in
        ``strategy.plan`` after ``fit`` starts. Needs workers with that many
        devices (``LocalCluster(devices_per_worker=k)``).

    Example:
      >>> with tfdist_ext.LocalCluster(num_workers=2, num_ps=1) as cluster:  # doctest: +SKIP
      ...     strategy = tfdist_ext.DownpourStrategy(cluster.resolver, n_fetch=5, n_push=5)
      ...     with strategy.scope():
      ...         model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
      ...         model.compile(optimizer=keras.optimizers.Adagrad(0.05),
      ...                       loss="sparse_categorical_crossentropy", metrics=["accuracy"])
      ...     model.fit(train_ds, epochs=5, steps_per_epoch=200)
    """

    _is_downpour = True

    def __init__(
        self,
        cluster_resolver,
        *,
        n_fetch=1,
        n_push=1,
        warmstart_steps=0,
        min_shard_bytes=256 << 10,
        deadline=60.0,
        compression=None,
        model_devices=None,
    ):
        self.n_fetch = n_fetch
        self.n_push = n_push
        self.warmstart_steps = _positive_int("warmstart_steps", warmstart_steps, 0)
        self.min_shard_bytes = _positive_int("min_shard_bytes", min_shard_bytes)
        if not deadline or deadline <= 0:
            raise ValueError(
                f"DownpourStrategy: deadline must be > 0 seconds, got {deadline!r}"
            )
        self.deadline = float(deadline)
        if compression is not None:
            from tfdist_ext import compression as compression_lib

            compression = compression_lib.get(compression)
        self.compression = compression
        if model_devices is not None:
            if (isinstance(model_devices, str) or not model_devices
                    or not all(isinstance(d, str) and d for d in model_devices)):
                raise ValueError(
                    "DownpourStrategy: model_devices must be a non-empty list of "
                    f"device names of one worker task, got {model_devices!r}"
                )
            model_devices = list(model_devices)
        self.model_devices = model_devices
        self.plan = None
        spec = cluster_resolver.cluster_spec().as_dict()
        for job in ("ps", "worker"):
            if not spec.get(job):
                raise ValueError(
                    f"DownpourStrategy: the cluster has no {job!r} job "
                    f"(jobs: {', '.join(sorted(spec)) or 'none'}); Downpour needs "
                    "parameter-server ('ps') and 'worker' tasks"
                )
        if cluster_resolver.task_type not in ("chief", None):
            raise ValueError(
                "DownpourStrategy: must be created in the coordinating 'chief' "
                f"process, not in task {cluster_resolver.task_type!r}"
            )
        for job in ("ps", "worker"):
            for address in spec[job]:
                ping(address, timeout=self.deadline)

        num_ps = len(spec["ps"])
        partitioner = None
        if num_ps > 1:
            partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
                min_shard_bytes=self.min_shard_bytes, max_shards=num_ps
            )
        super().__init__(cluster_resolver, variable_partitioner=partitioner)
        self._ps_bytes = [0] * num_ps
        self._placement_lock = threading.Lock()
        self._extended._create_variable_round_robin = types.MethodType(
            _create_variable_balanced, self
        )
        # Keras evaluates and predicts on the chief (this process); that is
        # not a mistake worth a warning at every trace.
        self._extended._allow_run_without_coordinator = True
        # The push applies the optimizer from the round function's
        # cross-replica context; with no merge_call Keras's optimizer then
        # calls extended.update per variable, which runs on the variable's ps.
        self._extended._use_merge_call = lambda: False
        self._extended._update = types.MethodType(
            _update_sharded_aware, self._extended
        )
        self._extended._create_variable = types.MethodType(
            _create_variable_sharded_slots, self._extended
        )
        self.coordinator = cluster_coordinator.ClusterCoordinator(self)
        self.stats = DownpourStats()
        self._sources = []
        self._per_worker_iterators = []
        self._rounds = {}
        self._worker_index = None
        self._server_version = None
        _fit.install()
        _make_sharded_variables_readable()

    @property
    def n_fetch(self):
        """Local steps between parameter fetches (settable between ``fit`` calls)."""
        return self._n_fetch

    @n_fetch.setter
    def n_fetch(self, value):
        self._n_fetch = _positive_int("n_fetch", value)

    @property
    def n_push(self):
        """Local steps between gradient pushes (settable between ``fit`` calls)."""
        return self._n_push

    @n_push.setter
    def n_push(self, value):
        self._n_push = _positive_int("n_push", value)

    @property
    def num_workers(self):
        """Number of asynchronous model replicas (``worker`` tasks)."""
        return self._extended._num_workers

    @property
    def num_ps(self):
        """Number of parameter-server shards (``ps`` tasks)."""
        return self._extended._num_ps

    @property
    def round_steps(self):
        """Local steps per scheduled round: ``lcm(n_fetch, n_push)``."""
        return math.lcm(self.n_fetch, self.n_push)

    def shard_bytes(self):
        """Bytes of variables placed whole on each ``ps`` shard so far."""
        return list(self._ps_bytes)

    def experimental_distribute_dataset(self, dataset, options=None):
        """Returns ``dataset`` for use on the chief; ``fit`` shards it per worker.

        Keras ``evaluate`` and ``predict`` iterate it on the chief. For ``fit``
        each worker gets its own shard (``dataset.shard(num_workers, i)``,
        repeated) built on the worker.
        """
        return _fit.SourceDataset(dataset, self)

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """Builds ``dataset_fn(InputContext)`` on the chief; see ``experimental_distribute_dataset``."""
        context = tf.distribute.InputContext(
            num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1
        )
        return self.experimental_distribute_dataset(dataset_fn(context), options)

    def get_config(self):
        """The strategy's knobs (not the cluster) as a dict."""
        return {
            "n_fetch": self.n_fetch,
            "n_push": self.n_push,
            "warmstart_steps": self.warmstart_steps,
            "min_shard_bytes": self.min_shard_bytes,
            "deadline": self.deadline,
            "compression": None if self.compression is None else repr(self.compression),
            "model_devices": self.model_devices,
        }


def _create_variable_balanced(strategy, next_creator, **kwargs):
    """Places a whole variable on the ``ps`` shard holding the fewest bytes."""
    from tensorflow.python.framework import ops

    with strategy._placement_lock:
        index = min(range(len(strategy._ps_bytes)), key=strategy._ps_bytes.__getitem__)
        strategy._ps_bytes[index] += _variable_bytes(kwargs)
    with ops.colocate_with(None, ignore_existing=True):
        with ops.device(f"/job:ps/task:{index}/device:CPU:0"):
            return next_creator(**kwargs)


_keras_update = parameter_server_strategy_v2.ParameterServerStrategyV2Extended._update


def _update_sharded_aware(extended, var, fn, args, kwargs, group):
    """``extended.update`` that also takes a variable split across ``ps`` shards.

    A whole variable is updated on the ``ps`` task that owns it (TensorFlow's
    colocation). A split (``ShardedVariable``) one cannot be colocated: its
    update is computed where the push runs and written back shard by shard.
    """
    from tensorflow.python.distribute import distribute_lib
    from tensorflow.python.distribute import sharded_variable

    if isinstance(var, sharded_variable.ShardedVariable):
        with distribute_lib.UpdateContext(var.variables[0].device):
            return fn(var, *args, **kwargs)
    return _keras_update(extended, var, fn, args, kwargs, group)


_pss_create_variable = parameter_server_strategy_v2.ParameterServerStrategyV2Extended._create_variable


def _create_variable_sharded_slots(extended, next_creator, **kwargs):
    """Optimizer slots of a split variable are split the same way.

    Keras creates a slot "colocated" with its variable; a ``ShardedVariable``
    cannot be colocated with, so the slot goes through the partitioner
    instead, which splits it like the variable across the ``ps`` tasks.
    """
    from tensorflow.python.distribute import sharded_variable

    if isinstance(kwargs.get("colocate_with"), sharded_variable.ShardedVariable):
        kwargs.pop("colocate_with")
    return _pss_create_variable(extended, next_creator, **kwargs)


def _make_sharded_variables_readable():
    """Lets Keras saving read a split variable as one array.

    Keras reads weights with ``np.asarray(variable)``; TensorFlow's
    ``ShardedVariable`` converts to a tensor but has no ``__array__``. Adds
    the two readers it lacks (nothing else of the class changes).
    """
    import numpy as np
    from tensorflow.python.distribute import sharded_variable

    cls = sharded_variable.ShardedVariable
    if not hasattr(cls, "__array__"):
        cls.__array__ = lambda self, dtype=None, copy=None: np.asarray(
            tf.convert_to_tensor(self).numpy(), dtype=dtype
        )
    if not hasattr(cls, "numpy"):
        cls.numpy = lambda self: tf.convert_to_tensor(self).numpy()
