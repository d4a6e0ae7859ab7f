"""How ``model.fit`` runs Downpour (internal).

Keras 3 has no parameter-server path in ``fit``; ``tfdist_ext._integration``
routes the ``fit`` of a model whose strategy is a ``DownpourStrategy`` to
:func:`downpour_fit`, which sets ``model.train_function`` to a
:class:`_TrainFunction`, and routes ``_get_metrics_result_or_logs`` (which
Keras calls right after each epoch's last batch) to :func:`epoch_logs`, which
waits for the epoch's rounds. It then runs Keras's own ``fit``
loop unchanged (progress bar, callbacks, validation, checkpoints). For every
other model ``fit`` is Keras's, untouched.

Each call of the train function counts steps; every ``round_steps`` steps it
schedules one *round* on whichever worker is free (``ClusterCoordinator``):
fetch the parameters from the ``ps`` shards, run the local steps on that
copy (``keras.StatelessScope`` maps the model's variables to the local
tensors), fetch again every ``n_fetch`` steps, and push the summed gradient
every ``n_push`` steps through the compiled optimizer, whose update ops run
on the ``ps`` task that owns each variable. A round is
``lcm(n_fetch, n_push)`` steps, so round boundaries fall exactly where both a
fetch and a push are due and no state has to live on the worker between
rounds: a lost worker loses only the gradients of its round in flight.
"""

import contextlib
import time
import warnings
import weakref

import keras
import tensorflow as tf

from tfdist_ext import _integration
from tfdist_ext.cluster._local import ClusterError
from tfdist_ext.cluster._local import ClusterTimeoutError
from tfdist_ext.cluster._local import ping

_MAX_SOURCES = 16


class SourceDataset:
    """What ``DownpourStrategy.experimental_distribute_dataset`` returns.

    Iterating it gives an ordinary ``tf.data`` iterator on the chief (Keras
    ``evaluate``/``predict`` use it as is); the strategy remembers which
    dataset each iterator came from so that ``fit`` can build per-worker
    shards of it.
    """

    def __init__(self, dataset, strategy):
        self.dataset = dataset
        self._strategy = strategy

    def __iter__(self):
        try:
            iterator = iter(self.dataset)
        except tf.errors.InvalidArgumentError as e:
            if "unknown device" not in str(e):
                raise
            raise ValueError(
                "DownpourStrategy: this dataset was created before the process "
                "connected to the cluster (before DownpourStrategy(...)), so its "
                "device no longer exists; create datasets after the strategy"
            ) from None
        sources = self._strategy._sources
        sources.append((iterator, self.dataset))
        del sources[:-_MAX_SOURCES]
        return iterator

    @property
    def element_spec(self):
        return self.dataset.element_spec


def _source_of(strategy, iterator):
    for it, dataset in reversed(strategy._sources):
        if it is iterator:
            return dataset
    raise ValueError(
        "DownpourStrategy: fit() got data that was not distributed by this "
        "strategy; build and fit the model under the same strategy"
    )


def _adopt_optimizer(model, strategy):
    """An optimizer made outside ``strategy.scope()`` but not yet built joins it."""
    optimizer = model.optimizer
    if optimizer is None or _integration.optimizer_strategy(optimizer) in (None, strategy):
        return
    if optimizer.built:
        raise ValueError(
            "DownpourStrategy: the model's optimizer was built under another "
            "strategy; create and compile it inside `strategy.scope()`"
        )
    _integration.set_optimizer_strategy(optimizer, strategy)


def downpour_fit(model, strategy, original, *args, **kwargs):
    _adopt_optimizer(model, strategy)
    train_function = _TrainFunction(model, strategy)
    model.train_function = train_function
    try:
        return original(model, *args, **kwargs)
    finally:
        model.train_function = None
        train_function.close()


def epoch_logs(model, logs, keras_epoch_logs):
    """Keras calls this right after an epoch's last batch (also when the loop
    broke early), and at the end of ``evaluate``: after training steps it is
    the epoch's end, so wait for every round and report exact values;
    otherwise it is evaluate's and stays Keras's."""
    train_function = model.train_function
    if isinstance(train_function, _TrainFunction) and train_function.steps_since_finish:
        return train_function.finish_epoch()
    return keras_epoch_logs(model, logs)


class _TrainFunction:
    """``model.train_function`` under Downpour: schedules rounds, returns logs."""

    def __init__(self, model, strategy):
        self.model = model
        self.strategy = strategy
        self.coordinator = strategy.coordinator
        self._round = None
        self._current = None
        self._pending = 0
        self._ahead = 0
        self._scheduled_steps = 0
        self._inflight = []
        self._logs = {}
        self._last_read = 0.0
        self.steps_since_finish = 0
        self._epoch_base = strategy.stats.snapshot()
        self._ps_addresses = strategy._cluster_resolver.cluster_spec().as_dict()["ps"]
        self._last_ps_check = time.monotonic()

    # -- Keras-facing --------------------------------------------------------

    def __call__(self, iterator):
        with self._explained_errors():
            return self._call(iterator)

    def _call(self, iterator):
        dataset = _source_of(self.strategy, iterator)
        self._current = self._per_worker_iterator(dataset)
        for _ in range(self.model.steps_per_execution):
            self.steps_since_finish += 1
            if self._ahead:
                self._ahead -= 1     # already scheduled by an early round
                continue
            self._scheduled_steps += 1
            if self._scheduled_steps <= self.strategy.warmstart_steps:
                # Warmstart: one replica at a time, in order.
                self._schedule(1)
                self._wait(lambda: not self._inflight)
            else:
                self._pending += 1
                if self._pending == self.strategy.round_steps:
                    self._schedule(self._pending)
        self._collect()
        if self.strategy.stats.steps == self._epoch_base["steps"]:
            # Nothing of this epoch has finished yet: wait for its first
            # round so that callbacks never see the reset metrics' zeros.
            if self._pending and not self._inflight:
                # Schedule the whole round now; its later steps are counted
                # off as Keras calls for them.
                self._ahead = self.strategy.round_steps - self._pending
                self._scheduled_steps += self._ahead
                self._schedule(self.strategy.round_steps)
            self._wait(lambda: self.strategy.stats.steps > self._epoch_base["steps"])
            self._read_logs()
        elif time.monotonic() - self._last_read > 0.5:
            self._read_logs()
        return self._logs

    def finish_epoch(self):
        """Schedules the partial round, waits for all rounds; exact epoch logs."""
        with self._explained_errors():
            if self._pending and self._current is not None:
                self._schedule(self._pending)
            self._wait(lambda: not self._inflight)
            self._read_logs()
        self._ahead = 0
        self.steps_since_finish = 0
        self._epoch_base = self.strategy.stats.snapshot()
        return dict(self._logs)

    def close(self):
        try:
            self._wait(lambda: not self._inflight)
        except Exception:  # noqa: BLE001 - fit is already raising its own error
            pass

    # -- scheduling ----------------------------------------------------------

    def _schedule(self, steps):
        self._pending = 0
        if steps <= 0:
            return
        if self._round is None:
            self._round = _cached_round(self.model, self.strategy)
        # Keep the coordinator's queue short so that every wait is ours, with
        # a deadline, rather than a blocking schedule() call.
        limit = 2 * self.strategy.num_workers
        self._wait(lambda: len(self._inflight) < limit)
        remote = self.coordinator.schedule(
            self._round,
            args=(self._current, _cached_worker_index(self.strategy),
                  tf.constant(steps, tf.int32)),
        )
        self._inflight.append((remote, steps))

    def _collect(self):
        still = []
        for remote, steps in self._inflight:
            status = getattr(remote, "_status", None)
            if status == _integration.RemoteValueStatus.READY:
                try:
                    out = remote.fetch()
                except tf.errors.UnavailableError:
                    # The round finished (its pushes are applied) but its
                    # worker died before the chief copied the small result
                    # back. Unless a ps is gone (then this raises), count
                    # its steps and go on without its staleness values.
                    self._check_ps(force=True)
                    self.strategy.stats.record_lost_round(steps)
                    continue
                self._record(out)
            elif status == _integration.RemoteValueStatus.ABORTED:
                remote.fetch()   # raises the round's error
            else:
                still.append((remote, steps))
        self._inflight = still
        if self.coordinator.done():   # raises a failed round's error, if any
            pass

    def _record(self, out):
        stats = self.strategy.stats
        staleness = out["staleness"]
        pushes = int(out["pushes"])
        rejected = int(out["rejected"])
        stats.record(
            steps=int(out["steps"]),
            pushes=pushes,
            fetches=int(out["fetches"]),
            rejected=rejected,
            push_bytes=int(out["push_bytes"]),
            fetch_bytes=int(out["fetch_bytes"]),
            staleness=staleness,
            worker=int(out["worker"]),
        )
        if rejected:
            warnings.warn(
                f"DownpourStrategy: the parameter server rejected {rejected} push(es) "
                "with NaN or Inf gradients; its parameters were left unchanged",
                RuntimeWarning,
                stacklevel=2,
            )

    @contextlib.contextmanager
    def _explained_errors(self):
        """A failed round or RPC: if a ps task is gone, say so plainly."""
        try:
            yield
        except tf.errors.OpError:
            self._check_ps(force=True)
            raise

    def _wait(self, condition):
        """Polls rounds until ``condition()``; fails if nothing finishes in time."""
        deadline = self.strategy.deadline
        last_progress = time.monotonic()
        count = len(self._inflight)
        while True:
            self._collect()
            if condition():
                return
            if len(self._inflight) != count:
                count = len(self._inflight)
                last_progress = time.monotonic()
            self._check_ps()
            if time.monotonic() - last_progress > max(deadline, 1.0) * 3:
                raise ClusterTimeoutError(
                    f"DownpourStrategy: no round finished within {3 * deadline:.0f}s "
                    f"({len(self._inflight)} in flight); the workers may all be gone"
                )
            time.sleep(0.005)

    def _check_ps(self, force=False):
        now = time.monotonic()
        if not force and now - self._last_ps_check < 2.0:
            return
        self._last_ps_check = now
        for index, address in enumerate(self._ps_addresses):
            try:
                ping(address, timeout=self.strategy.deadline)
            except ClusterTimeoutError:
                raise ClusterError(
                    f"DownpourStrategy: parameter server ps:{index} at {address} is "
                    f"unreachable (no answer within {self.strategy.deadline:.0f}s); "
                    "training stopped. Restart the ps task and resume from the last "
                    "checkpoint (e.g. keras.callbacks.BackupAndRestore)."
                ) from None

    # -- data ----------------------------------------------------------------

    def _per_worker_iterator(self, dataset):
        # Cached on the strategy: successive fit() calls on the same data
        # continue the same per-worker shards instead of rebuilding them.
        cache = self.strategy._per_worker_iterators
        for source, per_worker in cache:
            if source is dataset:
                return per_worker
        per_worker = _per_worker_iterator(self.strategy, dataset)
        cache.append((dataset, per_worker))
        del cache[:-_MAX_SOURCES]
        return per_worker

    # -- logs ----------------------------------------------------------------

    def _read_logs(self):
        logs = {}
        for key, value in self.model.get_metrics_result().items():
            try:
                logs[key] = float(value)
            except (TypeError, ValueError):
                logs[key] = value
        summary = self.strategy.stats.summary(since=self._epoch_base)
        for key in ("staleness_mean", "staleness_max", "pushes", "rejected_pushes",
                    "push_bytes_per_step", "fetch_bytes_per_step"):
            logs[key] = float(summary[key])
        self._logs = logs
        self._last_read = time.monotonic()


def _per_worker_iterator(strategy, dataset):
    """An iterator on every worker over that worker's shard of ``dataset``."""
    num_workers = strategy.num_workers
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    # The dataset lives on the chief; ship its graph, not its handle, and
    # rebuild it on each worker (as tf.data's own `replicate` does).
    graph_def = dataset._as_serialized_graph(
        strip_device_assignment=True,
        external_state_policy=tf.data.experimental.ExternalStatePolicy.WARN,
    ).numpy()
    element_spec = dataset.element_spec

    # graph_def is an argument, not a captured constant: grappler would fold
    # a constant DatasetFromGraph into a variant that cannot cross processes.
    @tf.function
    def make_iterator(index, graph_def):
        rebuilt = _integration.RemoteDataset(graph_def, "", element_spec)
        shard = rebuilt.shard(num_workers, index).repeat().with_options(options)
        return iter(shard)

    spec = _integration.get_iterator_spec_from_dataset(strategy, dataset)
    remotes = []
    for index, worker in enumerate(strategy.coordinator._cluster.workers):
        remote = worker.create_resource(
            make_iterator, args=(tf.constant(index, tf.int64), tf.constant(graph_def))
        )
        remote._type_spec = spec
        remotes.append(remote)
    return _integration.PerWorkerDistributedIterator(tuple(remotes))


def _cached_worker_index(strategy):
    if strategy._worker_index is None:
        strategy._worker_index = _per_worker_index(strategy)
    return strategy._worker_index


def _partition(model, strategy):
    """Places each replica's computation over ``strategy.model_devices``."""
    if not strategy.model_devices or getattr(model, "_downpour_plan", None) is not None:
        return
    from tfdist_ext.model_parallel import apply_plan
    from tfdist_ext.model_parallel import plan_partition

    plan = plan_partition(model, strategy.model_devices)
    # Variables stay on the ps tasks; only the computation is placed.
    apply_plan(model, plan, place_variables=False)
    model._downpour_plan = strategy.plan = plan


def _cached_round(model, strategy):
    """One traced round function per (model, optimizer, n_fetch, n_push)."""
    _partition(model, strategy)
    key = (id(model), id(model.optimizer), strategy.n_fetch, strategy.n_push,
           id(strategy.compression))
    entry = strategy._rounds.get(key)
    if entry is None or entry[0]() is not model:
        entry = (weakref.ref(model), _build_round(model, strategy))
        strategy._rounds[key] = entry
    return entry[1]


def _per_worker_index(strategy):
    """Each worker's task index, as a value resolved on that worker."""
    @tf.function
    def identity(index):
        return tf.identity(index)

    return _integration.PerWorkerValues(tuple(
        worker.create_resource(identity, args=(tf.constant(index, tf.int64),))
        for index, worker in enumerate(strategy.coordinator._cluster.workers)
    ))


def _build_round(model, strategy):
    """The tf.function one worker runs for a round of local steps."""
    from tfdist_ext.model_parallel._placement import stage_gradients

    trainable = list(model.trainable_variables)
    non_trainable = list(model.non_trainable_variables)
    optimizer = model.optimizer
    if not trainable:
        raise ValueError("DownpourStrategy: the model has no trainable weights")
    n_fetch, n_push = strategy.n_fetch, strategy.n_push
    if strategy._server_version is None:
        with strategy.scope():
            strategy._server_version = tf.Variable(
                tf.constant(0, tf.int64), trainable=False, name="downpour_server_version"
            )
    version = strategy._server_version
    param_bytes = sum(_nbytes(v) for v in trainable)
    nt_bytes = sum(_nbytes(v) for v in non_trainable)

    def fetch():
        return [tf.convert_to_tensor(v.value) for v in trainable], version.read_value()

    def local_step(params, x, y, sample_weight):
        with tf.GradientTape() as tape:
            tape.watch(params)
            mapping = list(zip(trainable, params))
            mapping += [(v, v.value) for v in non_trainable]
            with keras.StatelessScope(state_mapping=mapping) as scope:
                y_pred = _integration.call_model(model, x, training=True)
                loss = _integration.compute_loss(model, x, y, y_pred, sample_weight)
            new_non_trainable = [scope.get_current_value(v) for v in non_trainable]
        with stage_gradients():  # backward ops on their stage's device (model_devices)
            grads = tape.gradient(loss, params)
        grads = [tf.zeros_like(p) if g is None else tf.convert_to_tensor(g)
                 for g, p in zip(grads, params)]
        for v, value in zip(non_trainable, new_non_trainable):
            if value is not None:
                v.assign(value)
        batch = tf.shape(tf.nest.flatten(x)[0])[0]
        _integration.loss_tracker(model).update_state(loss, sample_weight=batch)
        model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        return grads

    push, state_vars = _make_push(strategy, optimizer, trainable, param_bytes)

    @tf.function
    def round_fn(iterator, worker, num_steps):
        state = tf.nest.map_structure(lambda v: v.read_value(), state_vars)
        sent = tf.constant(0, tf.int64)
        params, fetched = fetch()
        accum = [tf.zeros_like(p) for p in params]
        fetches = tf.constant(1, tf.int64)
        pushes = tf.constant(0, tf.int64)
        rejected = tf.constant(0, tf.int64)
        staleness = tf.TensorArray(tf.int64, size=0, dynamic_size=True)
        for i in tf.range(num_steps):
            if i > 0 and i % n_fetch == 0:
                params, fetched = fetch()
                fetches += 1
            data = next(iterator)
            x, y, sample_weight = _integration.unpack_x_y_sample_weight(data)
            grads = strategy.run(local_step, args=(params, x, y, sample_weight))
            accum = [a + g for a, g in zip(accum, grads)]
            if (i + 1) % n_push == 0 or i + 1 == num_steps:
                accepted, state, nbytes = push(accum, state, version.read_value())
                sent += nbytes
                if accepted:
                    before = version.assign_add(1) - 1
                    staleness = staleness.write(staleness.size(), before - fetched)
                    pushes += 1
                else:
                    rejected += 1
                accum = [tf.zeros_like(a) for a in accum]
        steps = tf.cast(num_steps, tf.int64)
        # Per-worker compressor state (error-feedback residuals, momenta)
        # carries over to this worker's next round. PerWorkerVariables get
        # no automatic control dependencies: tie the writes to the outputs.
        saved = [v.assign(t) for v, t in zip(tf.nest.flatten(state_vars), tf.nest.flatten(state))]
        with tf.control_dependencies(saved):
            steps = tf.identity(steps)
        return {
            "worker": worker,
            "steps": steps,
            "pushes": pushes,
            "fetches": fetches,
            "rejected": rejected,
            "staleness": staleness.stack(),
            "push_bytes": sent,
            "fetch_bytes": fetches * param_bytes + steps * 2 * nt_bytes,
        }

    return round_fn


def _make_push(strategy, optimizer, trainable, param_bytes):
    """``push(accum, state, step) -> (accepted, state, bytes_sent)`` and the state variables.

    The server checks every push: each ``ps`` task tests the gradient of the
    variables it owns for NaN/Inf, and the optimizer is applied only if all
    are finite. Without compression the dense gradient is what crosses the
    wire and the optimizer's per-variable updates run on the owning ``ps``
    task. With a compressor the worker sends the compressed wire form, the
    owning ``ps`` task decompresses it, and the compressor's state
    (error-feedback residuals, DGC momenta) stays on the worker in
    per-worker variables; a rejected push leaves that state unchanged.
    """
    compressor = strategy.compression

    def home(variable):
        value = variable.value
        if isinstance(value, _integration.ShardedVariable):
            return None           # split: checked and decompressed on the worker
        return value.device

    def apply(grads):
        # Cross-replica context: each variable's update runs on the ps task
        # that owns it (extended.update colocates).
        optimizer.apply_gradients(zip(grads, trainable))
        return tf.constant(True)

    def checked_apply(grads):
        checks = []
        for g, v in zip(grads, trainable):
            with tf.device(home(v)):
                checks.append(tf.reduce_all(tf.math.is_finite(g)))
        accepted = tf.reduce_all(checks)
        return tf.cond(accepted, lambda: apply(grads), lambda: tf.constant(False))

    if compressor is None:
        def push(accum, state, step):
            return checked_apply(accum), state, tf.constant(param_bytes, tf.int64)

        return push, []

    with strategy.scope():
        state_vars = [
            tf.nest.map_structure(
                lambda t: tf.Variable(t, trainable=False, per_worker_variable=True),
                compressor.init(v.shape, v.dtype),
            )
            for v in trainable
        ]

    def push(accum, state, step):
        wires, candidate = [], []
        for a, s in zip(accum, state):
            wire, s = compressor.compress(a, s, step)
            wires.append(wire)
            candidate.append(s)
        grads = []
        for wire, v, a in zip(wires, trainable, accum):
            with tf.device(home(v)):
                grads.append(compressor.decompress(wire, a.shape, a.dtype))
        accepted = checked_apply(grads)
        if tf.nest.flatten(candidate):
            state = tf.cond(accepted, lambda: candidate, lambda: state)
        return accepted, state, tf.add_n([compressor.wire_bytes(w) for w in wires])

    return push, state_vars


def _nbytes(variable):
    return int(variable.shape.num_elements()) * tf.as_dtype(variable.dtype).size
