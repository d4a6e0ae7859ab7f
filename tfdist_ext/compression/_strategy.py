"""Compressed gradient exchange for MirroredStrategy and MultiWorkerMirroredStrategy (internal).

Where the hook is: Keras 3's TensorFlow optimizer sums gradients over
replicas in ``TFOptimizer._all_reduce_sum_gradients`` (replica context,
``ReplicaContext.all_reduce(SUM, grads)``), then applies them per replica in
``_distributed_tf_update_step``. For an optimizer created under one of the
strategies below, ``tfdist_ext._integration`` routes that one method to
:meth:`_CompressedExchange._compressed_all_reduce`, which (per replica)
compresses each gradient with the replica's own state, **all-gathers only the
wire tensors** (``ReplicaContext.all_gather``: cross-device copies within a
process, collective all-gather over gRPC across processes), and decompresses
and sums the gathered wires on every replica. All the wire tensors of a step
travel packed in one buffer, so a step costs one all-gather (TensorFlow adds
one of the buffer's length), not one per tensor: each collective is a round
trip, and they run one after another. A compressor whose wire can be summed
(:class:`NoCompression`, :class:`FP16`, :class:`PowerSGD`) has an
``exchange`` method instead, which sums lists of tensors in batched
all-reduces (one collective per list). Across workers that all-reduce is
TensorFlow's ring, subdivided so that its chunks pipeline
(``_integration.pipelined_all_sum``). Across workers a step's scalar logs
(Keras reduces each with a collective of its own) are reduced together, one
collective per dtype (``MultiWorkerMirroredStrategy._tfdist_reduce_per_replica``).
Every other reduction (sync batch-norm, user code) is left dense.

``model.fit`` under these strategies also tells a compressor that follows
epochs (DGC's warm-up without ``steps_per_epoch``) which epoch is running:
the strategy's ``_tfdist_fit`` hook adds an internal callback that writes the
epoch into a variable the traced step reads.
"""

import contextlib
import inspect
import threading
import weakref
from collections.abc import Sequence

import keras
import tensorflow as tf

from tfdist_ext import _integration
from tfdist_ext.compression import _backup
from tfdist_ext.compression import _wire
from tfdist_ext.compression import _worker_files
from tfdist_ext.compression._base import Compressor
from tfdist_ext.compression._compressors import NoCompression
from tfdist_ext.compression._registry import get


class CompressionState(tf.Module):
    """The per-replica compressor state of a strategy, as a checkpointable object.

    One variable per replica, gradient and state tensor, named
    ``r{replica}_g{gradient}_s{index}`` (``r{replica}_o{k}_g...`` for the
    k-th further optimizer trained under the same strategy). Add it to a checkpoint next to the
    model and optimizer; it restores on creation if the checkpoint is read
    before the first step.

    Example:
      >>> ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer,  # doctest: +SKIP
      ...                            compression=strategy.compression_state)
    """

    def __init__(self):
        super().__init__(name="compression_state")

    def slot_names(self):
        return sorted(k for k in vars(self) if k.startswith("r") and "_s" in k)


def _local_variable(value, name):
    # Direct ResourceVariable construction bypasses the strategy's variable
    # creator: this is one replica's private state, not a mirrored variable.
    return _integration.ResourceVariable(value, trainable=False, name=name)


class _CompressedExchange:
    """Mixin: the compressed gradient exchange shared by both strategies."""

    def _setup_compression(self, compression):
        if compression is None:
            compression = NoCompression()
        if isinstance(compression, str):
            compression = get(compression)
        if not isinstance(compression, Compressor):
            raise ValueError(
                f"{type(self).__name__}: compression must be a tfdist_ext.compression."
                f"Compressor (e.g. compression.DGC(...)) or a name, got {compression!r}"
            )
        self._compression = compression
        self._compression_state = CompressionState()
        self._state_lock = threading.Lock()
        self._state_slots = {}
        self._optimizers = weakref.WeakKeyDictionary()
        self._counters = None
        self._epoch = None
        self._fits_running = 0
        _integration.install_optimizer_hooks()
        _integration.install_trainer_hooks()

    @contextlib.contextmanager
    def scope(self):
        """The strategy's scope (see ``tf.distribute.Strategy.scope``).

        One difference: a layer's non-trainable floating-point weight created
        in it without an aggregation -- BatchNormalization's moving mean and
        variance -- is averaged over the replicas at every update. Keras 3
        leaves such variables unaggregated, so under ``MirroredStrategy`` each
        replica drifts to its own statistics and a saved model keeps replica
        0's (tf.keras 2 aggregated them by their mean).

        Example:
          >>> with strategy.scope():                        # doctest: +SKIP
          ...     model = keras.Sequential([..., keras.layers.BatchNormalization()])
        """
        with super().scope(), tf.variable_creator_scope(_mean_aggregated_statistics):
            yield self

    def _tfdist_fit(self, model, keras_fit, args, kwargs):
        call = inspect.signature(keras_fit).bind(model, *args, **kwargs)
        _refuse_what_keras_mirrored_breaks(model, self, call.arguments.get("x"))
        callbacks = call.arguments.get("callbacks")
        if not isinstance(self._compression, NoCompression):
            # Keras's BackupAndRestore, as the user passes it, resumes the
            # compressor's state too (a dense exchange keeps none).
            callbacks = _backup.with_state_backups(self, callbacks)
            call.arguments["callbacks"] = callbacks
        if not self._compression.follows_epochs:
            return keras_fit(*call.args, **call.kwargs)
        clock = _EpochClock(self._epoch_variable())
        if isinstance(callbacks, keras.callbacks.CallbackList):
            callbacks.callbacks.append(clock)
        else:
            call.arguments["callbacks"] = [*(callbacks or []), clock]
        self._fits_running += 1
        try:
            return keras_fit(*call.args, **call.kwargs)
        finally:
            self._fits_running -= 1

    def _tfdist_predict_on_batch(self, model, keras_predict_on_batch, args, kwargs):
        """``model.predict_on_batch(x)``: Keras's own, under a mirrored strategy,
        runs the whole batch on every replica and returns one copy per
        replica; ``predict`` over that one batch returns it once."""
        x = inspect.signature(keras_predict_on_batch).bind(model, *args, **kwargs).arguments["x"]
        size = len(tf.nest.flatten(x)[0])
        return model.predict(x, batch_size=size, verbose=0)

    def _tfdist_build_optimizer(self, optimizer, variables):
        self._check_variable_dtypes(variables)
        self._check_optimizer_momentum(optimizer)

    def _tfdist_all_reduce_sum_gradients(self, optimizer, grads_and_vars):
        return self._compressed_all_reduce(optimizer, grads_and_vars)

    def _check_optimizer_momentum(self, optimizer):
        """Raises ValueError, when the optimizer is built, if it and the compressor both apply momentum."""
        if not self._compression.applies_momentum:
            return
        own = {name: getattr(optimizer, name, None) for name in ("momentum", "beta_1")}
        own = {
            name: value
            for name, value in own.items()
            if isinstance(value, (int, float)) and value > 0
        }
        if own:
            setting = ", ".join(f"{name}={value}" for name, value in own.items())
            raise ValueError(
                f"{type(self).__name__}: the compressor {self._compression!r} applies "
                f"momentum on each replica (momentum correction), and the optimizer "
                f"{type(optimizer).__name__}({setting}) would apply momentum a second time "
                "(training is much worse, without any error). Use an optimizer without "
                "momentum, e.g. keras.optimizers.SGD(learning_rate) (the compressor's "
                "momentum replaces it), or DGC(momentum_correction=False) to keep the "
                "optimizer's momentum."
            )

    def _epoch_variable(self):
        if self._epoch is None:
            with tf.init_scope():
                self._epoch = _local_variable(tf.constant(0, tf.int64), "epoch")
        return self._epoch

    def _fit_epoch(self):
        """The epoch ``model.fit`` is in, for a compressor that follows epochs."""
        if not self._fits_running:
            raise ValueError(
                f"{type(self).__name__}: the compressor {self._compression!r} needs to know "
                "where epochs end (its warm-up counts epochs); model.fit tells it, but this "
                "step runs outside fit (a custom loop or train_on_batch). Give the "
                "compressor steps_per_epoch=... (optimizer steps per epoch), or "
                "warmup_epochs=0."
            )
        return self._epoch

    def _check_variable_dtypes(self, variables):
        """Raises ValueError before the first step if the compressor cannot take a variable's dtype.

        Called when an optimizer created under this strategy is built (Keras'
        ``fit`` builds it before tracing the first step; ``optimizer.build``
        and the first ``apply`` too).
        """
        for var in variables:
            if not getattr(var, "trainable", True):
                continue
            try:
                self._compression.check_dtype(var.dtype)
            except ValueError as e:
                raise ValueError(
                    f"{type(self).__name__}: variable {getattr(var, 'path', var.name)!r} has "
                    f"dtype {tf.as_dtype(var.dtype).name}, which the compressor "
                    f"{self._compression!r} cannot take: {e}"
                ) from None

    @property
    def compression(self):
        """The :class:`~tfdist_ext.compression.Compressor` used for gradients."""
        return self._compression

    @property
    def compression_state(self):
        """The per-replica compressor state (:class:`CompressionState`), for checkpoints."""
        return self._compression_state

    def _local_devices(self):
        return list(self.extended.worker_devices)

    def _ensure_counters(self):
        if self._counters is None:
            with tf.init_scope():
                counters = []
                for r, device in enumerate(self._local_devices()):
                    with tf.device(device):
                        counters.append(
                            {
                                "wire_bytes": _local_variable(
                                    tf.constant(0, tf.int64), f"wire_bytes_{r}"
                                ),
                                "dense_bytes": _local_variable(
                                    tf.constant(0, tf.int64), f"dense_bytes_{r}"
                                ),
                                "seconds": _local_variable(
                                    tf.constant(0.0, tf.float64), f"seconds_{r}"
                                ),
                                "steps": _local_variable(tf.constant(0, tf.int64), f"steps_{r}"),
                            }
                        )
                self._counters = counters
        return self._counters

    def _optimizer_prefix(self, optimizer):
        # State names must be stable across processes (checkpoints): the first
        # optimizer that uses the strategy gets plain names, later ones "o1_"...
        with self._state_lock:
            if optimizer not in self._optimizers:
                self._optimizers[optimizer] = len(self._optimizers)
            n = self._optimizers[optimizer]
        return f"o{n}_" if n else ""

    def _state_variables(self, replica, index, shape, dtype, prefix=""):
        """The state variables (a nest like ``compressor.init``) of one replica and gradient."""
        key = (prefix, index, tuple(shape), tf.as_dtype(dtype).name)
        with self._state_lock:
            if key not in self._state_slots:
                slots = []
                with tf.init_scope():
                    for r, device in enumerate(self._local_devices()):
                        with tf.device(device):
                            init = self._compression.init(shape, dtype)
                            flat = tf.nest.flatten(init)
                            made = []
                            for j, value in enumerate(flat):
                                name = f"r{r}_{prefix}g{index}_s{j}"
                                var = _local_variable(value, name)
                                setattr(self._compression_state, name, var)
                                made.append(var)
                            slots.append(tf.nest.pack_sequence_as(init, made))
                self._state_slots[key] = slots
            return self._state_slots[key][replica]

    def compression_stats(self) -> dict[str, float]:
        """Totals since the last reset, summed over this process' replicas.

        Returns a dict of Python numbers: ``wire_bytes`` (bytes the replicas
        put on the wire), ``dense_bytes`` (what a dense float32 exchange of the
        same gradients would put), ``ratio`` (dense / wire), ``seconds``
        (time spent compressing, summed over replicas; for a compressor with
        an ``exchange`` method, :class:`NoCompression` and :class:`PowerSGD`,
        it spans the exchange, all-reduces included) and ``steps``.

        Example:
          >>> strategy.compression_stats()["ratio"]   # doctest: +SKIP
          812.3
        """
        totals = {"wire_bytes": 0, "dense_bytes": 0, "seconds": 0.0, "steps": 0}
        for counters in self._ensure_counters():
            for name, var in counters.items():
                if name == "steps":  # every replica takes every step
                    totals[name] = max(totals[name], var.numpy().item())
                else:
                    totals[name] += var.numpy().item()
        totals["ratio"] = (
            totals["dense_bytes"] / totals["wire_bytes"] if totals["wire_bytes"] else float("nan")
        )
        return totals

    def _backup_state(self, model):
        """The compressor's state, for Keras's ``BackupAndRestore`` (``_state_backup``)."""
        return _backup.CompressorState(self)

    def reset_compression_state(self) -> None:
        """Puts every replica's compressor state back to ``compressor.init`` (e.g. between runs).

        Example:
          >>> strategy.reset_compression_state()   # doctest: +SKIP
        """
        for (_, _, shape, dtype), slots in self._state_slots.items():
            for state_vars in slots:
                init = self._compression.init(shape, dtype)
                self._write(state_vars, init)

    def reset_compression_stats(self) -> None:
        """Sets the byte and time counters to zero.

        Example:
          >>> strategy.reset_compression_stats()   # doctest: +SKIP
        """
        for counters in self._ensure_counters():
            for var in counters.values():
                var.assign(tf.zeros_like(var))

    # -- the exchange, in replica context ---------------------------------

    def _local_replica_index(self):
        ctx = tf.distribute.get_replica_context()
        rid = tf.get_static_value(ctx.replica_id_in_sync_group)
        if rid is None:
            raise RuntimeError("compressed exchange needs a static replica id")
        return int(rid) % len(self._local_devices())

    def _compressed_all_reduce(self, optimizer, grads_and_vars):
        ctx = tf.distribute.get_replica_context()
        replica = self._local_replica_index()
        counters = self._ensure_counters()[replica]
        step = tf.cast(optimizer.iterations, tf.int64)
        compressor = self._compression
        pairs = list(grads_and_vars)
        live = [(i, g) for i, (g, _) in enumerate(pairs) if g is not None]
        if not live:
            raise ValueError("No gradients provided for any variable")
        states = []
        prefix = self._optimizer_prefix(optimizer)
        for i, g in live:
            if isinstance(g, tf.IndexedSlices):
                g = tf.convert_to_tensor(g)
            compressor.check_dtype(g.dtype)
            states.append(self._state_variables(replica, i, g.shape, g.dtype, prefix))
        grads = [tf.convert_to_tensor(g) for _, g in live]
        dense_bytes = sum(4 * g.shape.num_elements() for g in grads)

        if hasattr(compressor, "exchange"):
            reduced, sent = self._exchange_rounds(compressor, grads, states, step, counters)
        else:
            clock = {"epoch": self._fit_epoch()} if compressor.follows_epochs else {}
            reduced, sent = self._exchange_gather(
                ctx, compressor, grads, states, step, counters, clock
            )
        counters["wire_bytes"].assign_add(sent)
        counters["dense_bytes"].assign_add(tf.constant(dense_bytes, tf.int64))
        counters["steps"].assign_add(tf.constant(1, tf.int64))
        out = [(None, v) for _, v in pairs]
        for (i, _), r in zip(live, reduced):
            out[i] = (r, pairs[i][1])
        return out

    @staticmethod
    def _read(state_vars):
        return tf.nest.map_structure(lambda v: v.read_value(), state_vars)

    @staticmethod
    def _write(state_vars, new_state):
        for var, value in zip(tf.nest.flatten(state_vars), tf.nest.flatten(new_state)):
            var.assign(tf.cast(value, var.dtype))

    @staticmethod
    def _start_clock(grads):
        """``tf.timestamp()`` taken once every gradient exists.

        A timestamp without inputs may run as soon as the step starts, so the
        compression time would include the backward pass.
        """
        with tf.control_dependencies(grads):
            return tf.timestamp()

    def _exchange_gather(self, ctx, compressor, grads, states, step, counters, clock):
        n = self.num_replicas_in_sync
        t0 = self._start_clock(grads)
        wires, new_states = [], []
        with tf.control_dependencies([t0]):
            for g, state_vars in zip(grads, states):
                wire, new_state = compressor.compress(g, self._read(state_vars), step, **clock)
                wires.append(wire)
                new_states.append(new_state)
        flat = tf.nest.flatten(wires)
        with tf.control_dependencies(flat):
            t1 = tf.timestamp()
        counters["seconds"].assign_add(t1 - t0)
        for state_vars, new_state in zip(states, new_states):
            self._write(state_vars, new_state)
        # One buffer, one all-gather (a collective per wire tensor costs a
        # round trip each, serialised); variable-length tensors send their
        # length (4 bytes) in it.
        buffer = _wire.pack(flat)
        sent = _wire.wire_bytes(buffer)
        per_sender = [
            tf.nest.pack_sequence_as(wires, tensors)
            for tensors in _wire.unpack(ctx.all_gather(buffer, axis=0), flat, n)
        ]
        reduced = [
            compressor.aggregate([sender[i] for sender in per_sender], g.shape, g.dtype)
            for i, g in enumerate(grads)
        ]
        return reduced, sent

    def _all_sum(self, tensors):
        """Sums a list of tensors over the replicas (a summable compressor's rounds)."""
        ctx = tf.distribute.get_replica_context()
        return ctx.all_reduce(tf.distribute.ReduceOp.SUM, list(tensors))

    def _exchange_rounds(self, compressor, grads, states, step, counters):
        t0 = self._start_clock(grads)
        with tf.control_dependencies([t0]):
            reduced, new_states, sent = compressor.exchange(
                grads, [self._read(s) for s in states], step, self._all_sum
            )
        for state_vars, new_state in zip(states, new_states):
            self._write(state_vars, new_state)
        with tf.control_dependencies(reduced):
            t1 = tf.timestamp()
        # Includes the two all-reduce rounds: PowerSGD interleaves them.
        counters["seconds"].assign_add(t1 - t0)
        return reduced, sent


def _refuse_what_keras_mirrored_breaks(model, strategy, x):
    """Refuses, at ``fit`` start, what Keras 3's ``fit`` cannot run under a
    mirrored strategy (``tf.distribute.MirroredStrategy`` fails the same way,
    after the first step has started, or trains the wrong examples)."""
    owner = type(strategy).__name__
    if isinstance(x, keras.utils.PyDataset) or inspect.isgenerator(x):
        kind = "PyDataset" if isinstance(x, keras.utils.PyDataset) else "Python generator"
        raise ValueError(
            f"{owner}: fit's input is a {kind}; split over the replicas of a mirrored "
            "strategy, Keras's Python-side input is read so that some examples are "
            "never trained (tf.distribute.MirroredStrategy too, intermittently). Pass "
            "NumPy arrays or a tf.data.Dataset of tensors or files instead."
        )
    optimizer = getattr(model.optimizer, "inner_optimizer", model.optimizer)
    broken = {
        "jit_compile=True": (model.jit_compile, "compile with jit_compile=False"),
        f"steps_per_execution={model.steps_per_execution} with collective all-reduce": (
            model.steps_per_execution > 1 and not _integration.reduces_to_one_device(strategy),
            "compile with steps_per_execution=1, or pass "
            "cross_device_ops=tf.distribute.ReductionToOneDevice() to the strategy",
        ),
        f"gradient_accumulation_steps={getattr(optimizer, 'gradient_accumulation_steps', None)}": (
            bool(getattr(optimizer, "gradient_accumulation_steps", None)),
            "compile the optimizer without it and raise the batch size instead",
        ),
    }
    for feature, (used, advice) in broken.items():
        if used:
            raise ValueError(
                f"{owner}: {feature} is not supported: Keras's step fails with it under "
                f"a mirrored strategy (tf.distribute.MirroredStrategy too); {advice}."
            )


def _mean_aggregated_statistics(next_creator, **kwargs):
    """Variable creator: a layer's unaggregated non-trainable float weights get MEAN aggregation.

    Only a layer's weights (BatchNormalization's statistics): an optimizer's
    state (e.g. ``LossScaleOptimizer``'s dynamic scale, updated inside a
    ``tf.cond``) keeps Keras's own aggregation.
    """
    if _integration.creating_layer() is None:
        return next_creator(**kwargs)
    aggregation = kwargs.get("aggregation") or tf.VariableAggregation.NONE
    dtype = kwargs.get("dtype")
    if dtype is None and not callable(kwargs.get("initial_value")):
        dtype = getattr(kwargs.get("initial_value"), "dtype", None)
    if (
        not kwargs.get("trainable", True)
        and aggregation == tf.VariableAggregation.NONE
        and dtype is not None
        and tf.as_dtype(dtype).is_floating
    ):
        kwargs["aggregation"] = tf.VariableAggregation.MEAN
    return next_creator(**kwargs)


class _EpochClock(keras.callbacks.Callback):
    """Writes the epoch ``model.fit`` starts into ``epoch`` (an int64 variable) (internal)."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch.assign(epoch)


class MirroredStrategy(_CompressedExchange, tf.distribute.MirroredStrategy):
    """``tf.distribute.MirroredStrategy`` that Keras 3's ``fit`` runs under, with an
    optional compressed gradient exchange.

    Dense by default. With ``compression``, each replica compresses its
    gradients inside ``model.fit`` with its own state (error-feedback
    residuals, DGC momentum) and only the wire form is all-gathered between
    devices; every replica decompresses and sums the senders' wires, so
    replicas stay in sync. Everything else behaves like ``MirroredStrategy``.
    Also importable as ``CompressedMirroredStrategy``.

    Args:
      devices: as for ``MirroredStrategy``.
      cross_device_ops: as for ``MirroredStrategy`` (used for non-gradient reductions).
      compression: a :class:`~tfdist_ext.compression.Compressor` or a name
        accepted by :func:`tfdist_ext.compression.get`; None means dense.

    Example:
      >>> from tfdist_ext import compression
      >>> strategy = MirroredStrategy(
      ...     devices=["/cpu:0", "/cpu:1"],
      ...     compression=compression.ErrorFeedback(compression.TopK(0.01)))
      >>> with strategy.scope():                                   # doctest: +SKIP
      ...     model = make_model(); model.compile("sgd", loss)
      >>> model.fit(ds, callbacks=[CompressionLogger()])           # doctest: +SKIP
    """

    def __init__(
        self,
        devices: Sequence[str] | None = None,
        cross_device_ops: tf.distribute.CrossDeviceOps | None = None,
        compression: Compressor | str | None = None,
    ):
        _integration.claim_collective_keys(self)
        super().__init__(devices=devices, cross_device_ops=cross_device_ops)
        self._setup_compression(compression)


class MultiWorkerMirroredStrategy(_CompressedExchange, tf.distribute.MultiWorkerMirroredStrategy):
    """``tf.distribute.MultiWorkerMirroredStrategy`` that Keras 3's ``fit`` runs under.

    A drop-in: the same arguments, ``TF_CONFIG`` read by default, every
    worker running the same program. Dense by default; ``compression``
    exchanges a compressed wire form with collective all-gathers over gRPC.
    Under ``model.fit``, as in Keras's multi-worker guide (and tf.keras 2):

    * only the chief writes ``ModelCheckpoint``, ``TensorBoard`` and
      ``BackupAndRestore`` files; the other workers write to temporary
      directories removed when ``fit`` ends (``backup_dir`` must be readable
      by every worker, e.g. a shared file system);
    * a worker that stops makes ``fit`` raise on every other worker (within
      TensorFlow's heartbeat timeout, about 10 s), naming the lost task;
      relaunched, a job with ``BackupAndRestore`` resumes from its last
      completed epoch.

    Also importable as ``CompressedMultiWorkerMirroredStrategy``.

    Args:
      cluster_resolver: as for ``MultiWorkerMirroredStrategy`` (default: ``TF_CONFIG``).
      communication_options: as for ``MultiWorkerMirroredStrategy``.
      compression: a :class:`~tfdist_ext.compression.Compressor` or a name; None means dense.

    Example:
      >>> strategy = tfdist_ext.MultiWorkerMirroredStrategy()   # doctest: +SKIP
      >>> with strategy.scope():                                 # doctest: +SKIP
      ...     model = make_model(); model.compile("adam", loss)
    """

    def __init__(
        self,
        cluster_resolver: tf.distribute.cluster_resolver.ClusterResolver | None = None,
        communication_options: tf.distribute.experimental.CommunicationOptions | None = None,
        compression: Compressor | str | None = None,
    ):
        _integration.claim_collective_keys(self)
        super().__init__(
            cluster_resolver=cluster_resolver, communication_options=communication_options
        )
        self._setup_compression(compression)
        _integration.reduce_nests(self.extended)

    def _tfdist_fit(self, model, keras_fit, args, kwargs):
        call = inspect.signature(keras_fit).bind(model, *args, **kwargs)
        with _worker_files.chief_writes(self, call.arguments.get("callbacks")) as callbacks:
            if callbacks is not None:
                call.arguments["callbacks"] = callbacks
            try:
                return super()._tfdist_fit(model, keras_fit, call.args[1:], call.kwargs)
            except _LOST_PEER_ERRORS as e:
                raise _lost_peer(self, e) from e

    def _all_sum(self, tensors):
        # A pipelined ring (see _integration.pipelined_all_sum): a large sum
        # crosses in chunks, so sending one overlaps adding the last.
        return _integration.pipelined_all_sum(
            self.extended, self._local_replica_index(), list(tensors)
        )

    def _tfdist_reduce_per_replica(self, values, reduction, keras_reduce):
        """A step's logs, reduced over the workers as Keras reduces them, with
        one collective for the scalars of each dtype.

        Keras 3 gives every log (the loss, each metric) a ``strategy.reduce``
        of its own under a multi-worker strategy: a collective each, launched
        one after another behind the gradients'. Stacked, their means are
        the same numbers in one round trip. Anything else (non-scalar logs,
        other reductions) goes to Keras as it is.
        """
        if reduction not in ("auto", "mean") or not _integration.in_multi_worker_mode(self):
            return keras_reduce(values, self, reduction)
        leaves = tf.nest.flatten(values)
        scalars = {}
        out = []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, tf.Tensor) and leaf.shape.rank == 0:
                scalars.setdefault(leaf.dtype, []).append(i)
                out.append(None)
            else:
                out.append(keras_reduce(leaf, self, reduction))
        for indices in scalars.values():
            mean = self.reduce("MEAN", tf.stack([leaves[i] for i in indices]), axis=None)
            for i, value in zip(indices, tf.unstack(mean, num=len(indices))):
                out[i] = value
        return tf.nest.pack_sequence_as(values, out)

    def reduce(self, reduce_op, value, axis):
        # Keras 3 reduces scalar per-replica logs with ``axis=0`` under
        # MultiWorkerMirroredStrategy, which TensorFlow rejects for rank-0
        # values; a scalar has no batch axis, so reduce it across replicas only.
        if axis is not None:
            parts = getattr(value, "values", (value,))
            if all(getattr(p, "shape", None) is not None and p.shape.rank == 0 for p in parts):
                axis = None
        return super().reduce(reduce_op, value, axis)


#: What TensorFlow's collectives raise once a peer task has stopped.
_LOST_PEER_ERRORS = (
    tf.errors.UnavailableError,
    tf.errors.AbortedError,
    tf.errors.DeadlineExceededError,
)


def _lost_peer(strategy, error):
    """``error`` (same type) with a message that says what happened and what to do."""
    lines = [line.strip() for line in (error.message or "").splitlines() if line.strip()]
    tasks = [line for line in lines if line.startswith("/job:")]
    detail = "unhealthy: " + ", ".join(tasks) if tasks else (lines[0][:300] if lines else "")
    resolver = strategy.cluster_resolver
    message = (
        f"{type(strategy).__name__}: a task of the cluster stopped or cannot be reached "
        f"({detail}), so training cannot go on on this worker "
        f"({resolver.task_type}:{resolver.task_id}). Relaunch the whole job; with "
        "keras.callbacks.BackupAndRestore in fit's callbacks it resumes from its last "
        "completed epoch."
    )
    return type(error)(error.node_def, error.op, message)


#: The names these strategies had when compression was their only purpose.
CompressedMirroredStrategy = MirroredStrategy
CompressedMultiWorkerMirroredStrategy = MultiWorkerMirroredStrategy
