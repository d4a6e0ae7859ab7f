"""The parameter-server base shared by Downpour and Sandblaster (internal).

Both algorithms keep their parameters on the ``ps`` tasks of a cluster
driven by a coordinating ``chief``. :class:`ParameterServerBase` is
TensorFlow's ``ParameterServerStrategy`` (V2) with the placement both need:
variables of at least ``min_shard_bytes`` split along axis 0 across the ``ps``
tasks (``ShardedVariable``), smaller ones placed whole on the least-loaded
shard by bytes, optimizer slots of a split variable split alike, and every
task pinged with a deadline before TensorFlow connects (a dead task is a clear
error, not a hang). Importing this module imports TensorFlow.
"""

import contextlib
import gc
import re
import threading
import weakref

import keras
import tensorflow as tf

from tfdist_ext import _integration
from tfdist_ext._chief_lease import ChiefLease
from tfdist_ext._stderr import native_log_without
from tfdist_ext.cluster._local import ClusterError
from tfdist_ext.cluster._local import ClusterTimeoutError
from tfdist_ext.cluster._local import attach_to_local_cluster
from tfdist_ext.cluster._local import ping
from tfdist_ext.cluster._process import port_taken

_PSSV2 = _integration.ParameterServerStrategyV2
_PSSV2Extended = _integration.ParameterServerStrategyV2Extended


def check_compiled_for_workers(model, owner):
    """Refuses, at ``fit`` start, compile options the workers' traced step cannot honour.

    Downpour's rounds and Sandblaster's slices run as traced functions on
    the workers, reading and updating the parameters on the ``ps`` tasks
    (as TensorFlow's ParameterServerStrategy, which refused ``run_eagerly``
    too); XLA cannot compile those remote reads and updates. The
    optimizer's ``gradient_accumulation_steps`` would accumulate on the
    ``ps`` tasks across concurrent pushes, which is not what Keras does.
    """
    if model.run_eagerly:
        raise ValueError(
            f"{owner}: run_eagerly=True cannot hold: the training step runs as a "
            "tf.function on the workers, with the parameters on the ps tasks. Compile "
            "with run_eagerly=False (to step through the model eagerly, run it "
            "without the strategy)."
        )
    if model.jit_compile:
        raise ValueError(
            f"{owner}: jit_compile=True cannot hold: the step reads and updates the "
            "parameters on the ps tasks, which XLA cannot compile. Compile with "
            "jit_compile=False (or leave the default 'auto', which is False under a "
            "strategy)."
        )
    optimizer = getattr(model.optimizer, "inner_optimizer", model.optimizer)
    steps = getattr(optimizer, "gradient_accumulation_steps", None)
    if steps:
        advice = {
            "DownpourStrategy": "set n_push instead: each push sums the gradients of "
            "n_push local steps (summed, not averaged: scale the learning rate by "
            "1/n_push for Keras's averaged accumulation)",
        }.get(owner, "compile the optimizer without it")
        raise ValueError(
            f"{owner}: the optimizer's gradient_accumulation_steps={steps} is not "
            f"supported; {advice}."
        )


def positive_int(owner, name, value, low=1):
    """``value`` if it is an int >= ``low``, else a ValueError naming ``owner.name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{owner}: {name} must be an integer >= {low}, got {value!r}")
    return value


def positive_float(owner, name, value):
    """``float(value)`` if it is a number > 0, else a ValueError naming ``owner.name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{owner}: {name} must be a number > 0, got {value!r}")
    return float(value)


def _check_tasks(owner, spec, deadline):
    """Every ``ps`` and ``worker`` task answers within ``deadline`` seconds (it
    may still be starting), as the job and index the cluster spec names it."""
    for job in ("ps", "worker"):
        for index, address in enumerate(spec[job]):
            try:
                devices = ping(address, timeout=deadline, wait=True)
            except ClusterTimeoutError:
                raise ClusterTimeoutError(
                    f"{owner}: task {job}:{index} at {address} did not answer within "
                    f"{deadline:g}s (deadline); check that it runs and that the cluster "
                    "(TF_CONFIG) names the right host:port"
                ) from None
            expected = f"/job:{job}/replica:0/task:{index}/"
            if devices and not any(d.startswith(expected) for d in devices):
                actual = devices[0].split("/device:")[0]
                raise ClusterError(
                    f"{owner}: the cluster names {address} as task {job}:{index}, but the "
                    f"server there is {actual}; every task's TF_CONFIG must list the "
                    "same cluster"
                )


@contextlib.contextmanager
def _naming_a_taken_chief_port(owner, spec):
    """Around connecting this process to the cluster: a chief address another
    process listens on is named, with its likely cause."""
    try:
        yield
    except tf.errors.UnknownError as e:
        if not port_taken(e):
            raise
        address = (spec.get("chief") or ["(none)"])[0]
        raise ClusterError(
            f"{owner}: could not listen on this chief's address {address}: another "
            "process holds that port. Is a second chief running with the same "
            "TF_CONFIG? Stop it, or give this chief a free port."
        ) from None


# What TensorFlow says of an op or variable made on this process's runtime
# before a strategy connected it to the cluster (it is gone with that runtime),
# whichever device it was on.
_BEFORE_CONNECTING = re.compile(
    r"/job:localhost/\S+ unknown device|Client for target /job:localhost not found"
)


def explain_made_before_connecting(owner, error):
    """``error`` re-raised as the same type naming the cause, when it comes from a
    dataset, variable or function made before the strategy connected; else ``error``."""
    message = getattr(error, "message", str(error))
    if not _BEFORE_CONNECTING.search(message):
        return error
    explained = (
        f"{owner}: a dataset, model, optimizer or variable used here was created before "
        "the strategy connected this process to the cluster, and is gone with the "
        "runtime it was made on. Build the strategy first, then create the datasets "
        f"and, under strategy.scope(), the model and its optimizer. ({message.strip()})"
    )
    return type(error)(error.node_def, error.op, explained)


class ParameterServerBase(_PSSV2):
    """``ParameterServerStrategy`` with byte-balanced, sharded placement.

    Subclasses set ``_owner`` (the name used in error messages) and
    ``_needs`` (what the algorithm uses the jobs for).
    """

    _owner = "ParameterServerBase"
    # The open strategies of this process: they share its one connection to
    # the cluster, which only the last of them to close may end.
    _open = weakref.WeakSet()

    def __init__(self, cluster_resolver, *, min_shard_bytes, deadline):
        owner = self._owner
        self.min_shard_bytes = positive_int(owner, "min_shard_bytes", min_shard_bytes)
        self.deadline = positive_float(owner, "deadline", deadline)
        spec = cluster_resolver.cluster_spec().as_dict()
        for job in ("ps", "worker"):
            if not spec.get(job):
                raise ValueError(
                    f"{owner}: the cluster has no {job!r} job (jobs: "
                    f"{', '.join(sorted(spec)) or 'none'}); it needs "
                    "parameter-server ('ps') and 'worker' tasks"
                )
        if cluster_resolver.task_type not in ("chief", None):
            raise ValueError(
                f"{owner}: must be created in the coordinating 'chief' process, "
                f"not in task {cluster_resolver.task_type!r}"
            )
        _check_tasks(owner, spec, self.deadline)
        num_ps = len(spec["ps"])
        partitioner = None
        if num_ps > 1:
            partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
                min_shard_bytes=self.min_shard_bytes, max_shards=num_ps
            )
        with _naming_a_taken_chief_port(owner, spec):
            super().__init__(cluster_resolver, variable_partitioner=partitioner)
        self._lease = ChiefLease(owner, spec)
        self._lease.claim(timeout=min(self.deadline, 5.0))
        _integration.use_extended(self, PlacementExtended(self, cluster_resolver, partitioner))
        _integration.make_sharded_variables_readable()
        self._closed = False
        ParameterServerBase._open.add(self)
        attach_to_local_cluster(cluster_resolver, self)

    @classmethod
    def from_config(cls, config, cluster_resolver):
        """The strategy of ``config`` (a :meth:`get_config` dict) on ``cluster_resolver``'s cluster.

        A config holds the strategy's knobs, not its cluster, so the cluster
        is given again: ``type(s).from_config(s.get_config(), resolver)``
        makes a strategy configured as ``s`` is. The config is plain data
        (compressors and staleness policies in Keras's serialised form), so
        it may be stored as JSON in between.
        """
        return cls(cluster_resolver, **cls._kwargs_from_config(config))

    @classmethod
    def _kwargs_from_config(cls, config):
        """The constructor's keyword arguments (all but the resolver) of a :meth:`get_config`."""
        return dict(config)

    @property
    def num_workers(self):
        """Number of ``worker`` tasks."""
        return self.extended.num_worker_tasks

    @property
    def num_ps(self):
        """Number of parameter-server shards (``ps`` tasks)."""
        return self.extended.num_ps_tasks

    def shard_bytes(self):
        """Bytes of variables placed whole on each ``ps`` shard so far."""
        return self.extended.shard_bytes()

    # -- closing -------------------------------------------------------------

    @property
    def closed(self):
        """Whether :meth:`close` has run."""
        return self._closed

    def close(self):
        """Disconnects from the cluster; models keep their final parameters here.

        Stops the strategy's threads (the coordinator's, the algorithm's),
        copies every variable of every model and optimizer built under
        ``scope()`` to this process with its last value, releases what lives
        on the other tasks, and makes this process's TensorFlow runtime local
        again. Afterwards ``get_weights``, ``evaluate``, ``predict`` and
        ``save`` work in plain single-process mode; ``fit`` under this
        strategy is refused. Idempotent. ``LocalCluster`` calls it for every
        strategy connected to it when it stops.

        Raises:
          ClusterError: a ``ps`` task did not answer, so the parameters it held
            could not be brought back (everything else is closed all the same).

        Example:
          >>> strategy = tfdist_ext.DownpourStrategy(resolver)  # doctest: +SKIP
          >>> with strategy.scope():  # doctest: +SKIP
          ...     model = make_model()
          >>> model.fit(dataset, epochs=3)  # doctest: +SKIP
          >>> strategy.close()  # doctest: +SKIP
          >>> model.save("model.keras")   # the final parameters, from this process  # doctest: +SKIP
        """
        if self._closed:
            return
        self._closed = True
        ParameterServerBase._open.discard(self)
        # TensorFlow logs an RPC error for every message to a dead task;
        # those tasks are known here, the lines would say nothing new.
        dead = self._dead_tasks()
        patterns = [
            s.encode()
            for job, index, address in dead
            for s in (address, f"/job:{job}/replica:0/task:{index}")
        ]
        with native_log_without(patterns):
            self._stop_runtime()
            try:
                self._bring_parameters_back(
                    [f"ps:{index} at {address}" for job, index, address in dead if job == "ps"]
                )
            finally:
                gc.collect()  # remote handles go while their tasks still answer
                if not ParameterServerBase._open:
                    if not any(job == "ps" and index == 0 for job, index, _ in dead):
                        self._lease.release()
                    _integration.disconnect_from_cluster()

    def _check_open(self):
        if self._closed:
            raise RuntimeError(
                f"{self._owner} is closed: its cluster has stopped (the LocalCluster block "
                "ended or strategy.close() was called). The model keeps its final "
                "parameters in this process, so evaluate, predict and save work; to train "
                "further, create a new cluster and strategy and load the model under its "
                "scope() (or train it without a strategy)."
            )

    def _dead_tasks(self):
        """``(job, index, address)`` of the ``worker``/``ps`` tasks that do not answer."""
        spec = self.cluster_resolver.cluster_spec().as_dict()
        dead = []
        for job in ("worker", "ps"):
            for index, address in enumerate(spec[job]):
                try:
                    ping(address, timeout=2.0)
                except ClusterError:
                    dead.append((job, index, address))
        return dead

    def _stop_runtime(self):
        """Stops the algorithm's threads and drops its remote state (subclasses)."""

    def _bring_parameters_back(self, dead_ps):
        models, optimizers = self._keras_objects()
        variables = {}
        for model in models:
            model.train_function = model.test_function = model.predict_function = None
            for v in model.variables + model.metrics_variables:
                variables[id(v)] = v
            if getattr(model, "optimizer", None) is not None:
                optimizers.append(model.optimizer)
        for optimizer in optimizers:
            for v in optimizer.variables:
                variables[id(v)] = v
        remote = [v for v in variables.values() if _is_remote(v)]
        if not remote:
            return
        if dead_ps:
            raise ClusterError(
                f"{self._owner}: parameter server {', '.join(dead_ps)} did not answer "
                "when the strategy closed, so the final parameters of the models built under "
                f"it ({len(remote)} variables) could not be brought back to this process and "
                "are lost. Save checkpoints during fit (keras.callbacks.ModelCheckpoint or "
                "BackupAndRestore) to keep them."
            )
        try:
            values = [v.numpy() for v in remote]
        except tf.errors.OpError as e:
            raise ClusterError(
                f"{self._owner}: reading the final parameters from the parameter servers "
                f"failed ({type(e).__name__}); the models built under this strategy lost "
                "them. Save checkpoints during fit (keras.callbacks.ModelCheckpoint or "
                "BackupAndRestore) to keep them."
            ) from None
        # ResourceVariable itself, not tf.Variable: no variable creator (this
        # strategy's scope may be open) places the copies back on the cluster.
        with tf.init_scope(), _integration.colocate_with(None, ignore_existing=True):
            for v, value in zip(remote, values):
                _integration.replace_variable_value(
                    v,
                    _integration.ResourceVariable(
                        value, dtype=v.dtype, trainable=v.trainable, name=v.name
                    ),
                )

    def _keras_objects(self):
        """Models and optimizers built under this strategy, among the live objects
        of this process (Keras keeps no registry of models, and a strategy sees a
        model only when it trains it)."""
        models, optimizers = [], []
        for obj in gc.get_objects():
            if isinstance(obj, keras.Model):
                if obj.distribute_strategy is self:
                    models.append(obj)
            elif isinstance(obj, keras.optimizers.Optimizer):
                if _integration.optimizer_strategy(obj) is self:
                    optimizers.append(obj)
        return models, optimizers

    def experimental_distribute_dataset(self, dataset, options=None):
        """Returns ``dataset`` unchanged: Keras ``evaluate``/``predict`` iterate it on the chief."""
        return dataset

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """Builds ``dataset_fn(InputContext)`` on the chief; see ``experimental_distribute_dataset``."""
        context = tf.distribute.InputContext(
            num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1
        )
        return self.experimental_distribute_dataset(dataset_fn(context), options)


def _is_remote(variable):
    """Whether a Keras variable's value lives on another task of the cluster."""
    return any(
        "/job:ps/" in piece.device or "/job:worker/" in piece.device
        for piece in components(variable)
    )


def variable_bytes(kwargs):
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


class PlacementExtended(_PSSV2Extended):
    """TensorFlow's ``ParameterServerStrategyV2Extended`` with the placement both algorithms need.

    * Whole variables go to the ``ps`` shard holding the fewest bytes
      (TensorFlow's default is round robin by count).
    * Optimizer slots of a split variable are split the same way.
    * ``update`` also takes a split (``ShardedVariable``) variable; within
      :meth:`per_shard_updates` an elementwise optimizer updates it shard by
      shard, each on its own ``ps`` task.
    * Updates are applied from a cross-replica context without
      ``merge_call``; Keras's optimizer then calls ``update`` per variable,
      which runs on the variable's ``ps`` task.
    * Keras evaluates and predicts on the chief (this process) without a
      coordinator; that is not a mistake worth a warning at every trace.
    """

    def __init__(self, container_strategy, cluster_resolver, variable_partitioner):
        super().__init__(container_strategy, cluster_resolver, variable_partitioner)
        _integration.set_cluster_resolver(self, cluster_resolver)
        spec = cluster_resolver.cluster_spec().as_dict()
        self.num_worker_tasks = len(spec.get("worker", ()))
        self.num_ps_tasks = len(spec.get("ps", ()))
        self._ps_bytes = [0] * self.num_ps_tasks
        self._placement_lock = threading.Lock()
        # id(slot) -> (slot, its variable), weakly: the slots of split variables.
        self._split_slots = {}
        # id(split variable) -> its slots as Keras variables, within per_shard_updates.
        self._shard_slots = None
        _integration.allow_run_without_coordinator(self)

    def shard_bytes(self):
        """Bytes of variables placed whole on each ``ps`` shard so far."""
        with self._placement_lock:
            return list(self._ps_bytes)

    def _use_merge_call(self):
        return False

    def _create_variable_round_robin(self, next_creator, **kwargs):
        """Places a whole variable on the ``ps`` shard holding the fewest bytes."""
        with self._placement_lock:
            index = min(range(len(self._ps_bytes)), key=self._ps_bytes.__getitem__)
            self._ps_bytes[index] += variable_bytes(kwargs)
        with _integration.colocate_with(None, ignore_existing=True):
            with tf.device(f"/job:ps/task:{index}/device:CPU:0"):
                return next_creator(**kwargs)

    def _update(self, var, fn, args, kwargs, group):
        """A whole variable is updated on the ``ps`` task that owns it
        (TensorFlow's colocation). A split (``ShardedVariable``) one is
        updated piece by piece, each on its own ``ps`` task, within
        :meth:`per_shard_updates`; otherwise its update is computed where the
        caller runs and written back piece by piece."""
        if not isinstance(var, _integration.ShardedVariable):
            return super()._update(var, fn, args, kwargs, group)
        slots = self._slots_to_split(var, args, kwargs)
        if slots is None:
            with _integration.distribute_lib.UpdateContext(var.variables[0].device):
                return fn(var, *args, **kwargs)
        pieces = tf.split(args[0], [p.shape[0] for p in var.variables], axis=0)
        results = []
        for i, (variable_piece, gradient_piece) in enumerate(zip(var.variables, pieces)):
            with contextlib.ExitStack() as stack:
                for slot in slots:
                    slot_piece = _integration.variable_value(slot).variables[i]
                    stack.enter_context(_integration.swapped_variable(slot, slot_piece))
                stack.enter_context(tf.device(variable_piece.device))
                stack.enter_context(
                    _integration.distribute_lib.UpdateContext(variable_piece.device)
                )
                results.append(fn(_ShardView(variable_piece, var), gradient_piece, *args[1:]))
        return results

    def _slots_to_split(self, var, args, kwargs):
        """The optimizer's slots (Keras variables) of split ``var`` when its
        update may run piece by piece (within :meth:`per_shard_updates`, a
        dense gradient, every slot split like ``var``), else ``None``."""
        slots = None if self._shard_slots is None else self._shard_slots.get(id(var))
        if slots is None or kwargs or not _dense_gradient_of(var, args):
            return None
        rows = [p.shape[0] for p in var.variables]
        for slot in slots:
            if [p.shape[0] for p in _integration.variable_value(slot).variables] != rows:
                return None
        return slots

    @contextlib.contextmanager
    def per_shard_updates(self, optimizer, variables):
        """Within the block, ``optimizer`` (traced) updates each split variable
        shard by shard, each shard on its own ``ps`` task: only the
        gradient's piece crosses to each task, and the tasks work in
        parallel. Without it the whole update of a split variable (reading
        every piece of its slots) runs in one place. Only for optimizers whose
        update is elementwise (:data:`ELEMENTWISE_OPTIMIZERS`); others keep
        the whole-variable update (e.g. ``Lamb``'s layer-wise norms).
        """
        if type(optimizer) not in ELEMENTWISE_OPTIMIZERS or not optimizer.built:
            yield
            return
        split = [_integration.variable_value(v) for v in variables]
        slots = {id(v): [] for v in split if isinstance(v, _integration.ShardedVariable)}
        for v in optimizer.variables:
            value = _integration.variable_value(v)
            entry = self._split_slots.get(id(value))
            if entry is not None and entry[0]() is value and id(entry[1]()) in slots:
                slots[id(entry[1]())].append(v)
        previous, self._shard_slots = self._shard_slots, slots
        try:
            yield
        finally:
            self._shard_slots = previous

    def _create_variable(self, next_creator, **kwargs):
        """Keras creates a slot "colocated" with its variable; a
        ``ShardedVariable`` cannot be colocated with, so the slot of a split
        variable goes through the partitioner instead, which splits it like
        the variable across the ``ps`` tasks."""
        reference = kwargs.get("colocate_with")
        if not isinstance(reference, _integration.ShardedVariable):
            return super()._create_variable(next_creator, **kwargs)
        kwargs.pop("colocate_with")
        slot = super()._create_variable(next_creator, **kwargs)
        if isinstance(slot, _integration.ShardedVariable):
            self._split_slots[id(slot)] = (weakref.ref(slot), weakref.ref(reference))
        return slot


#: Keras optimizers whose update of a variable is elementwise (so a split
#: variable may be updated piece by piece); exact classes, not subclasses.
ELEMENTWISE_OPTIMIZERS = (
    keras.optimizers.SGD,
    keras.optimizers.Adagrad,
    keras.optimizers.Adam,
    keras.optimizers.AdamW,
    keras.optimizers.Adamax,
    keras.optimizers.Nadam,
    keras.optimizers.RMSprop,
    keras.optimizers.Adadelta,
    keras.optimizers.Ftrl,
    keras.optimizers.Lion,
)


def _dense_gradient_of(var, args):
    """Whether ``args`` starts with a dense gradient of ``var``'s whole shape."""
    return (
        bool(args)
        and isinstance(args[0], tf.Tensor)
        and args[0].shape.is_compatible_with(var.shape)
        and args[0].shape.rank is not None
        and args[0].shape.rank > 0
    )


class _ShardView:
    """One piece of a split variable as an optimizer's ``update_step`` sees it.

    It reads and assigns like the piece, and Keras finds its slots by the
    split variable it belongs to (``_distributed_container``, the hook Keras's
    ``_var_key`` follows for a distributed variable's component).
    """

    def __init__(self, piece, container):
        self._piece = piece
        self._container = container

    def _distributed_container(self):
        return self._container

    def __getattr__(self, name):
        return getattr(self._piece, name)


tf.register_tensor_conversion_function(
    _ShardView,
    lambda view, dtype=None, name=None, as_ref=False: tf.convert_to_tensor(
        view._piece, dtype=dtype, name=name
    ),
)


def split_paths(variables):
    """Paths of the (Keras) ``variables`` split across ``ps`` tasks (``ShardedVariable``)."""
    return [v.path for v in variables if isinstance(v.value, _integration.ShardedVariable)]


def components(variable):
    """The ``tf.Variable`` pieces of a (Keras, sharded or plain) variable, in axis-0 order."""
    value = _integration.variable_value(variable)
    if isinstance(value, _integration.ShardedVariable):
        return list(value.variables)
    return [value]
