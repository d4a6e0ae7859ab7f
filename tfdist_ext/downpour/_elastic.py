"""ElasticAveragingStrategy: asynchronous EASGD for Keras 3 ``model.fit``."""

import contextlib
import numbers
import weakref

import keras
import tensorflow as tf

from tfdist_ext import _integration
from tfdist_ext._ps_strategy import positive_int
from tfdist_ext._ps_strategy import split_paths
from tfdist_ext._state_backup import fit_with_state_backups
from tfdist_ext.downpour import _round
from tfdist_ext.downpour import _staleness
from tfdist_ext.downpour._elastic_backup import RESTORED
from tfdist_ext.downpour._elastic_backup import ReplicaState
from tfdist_ext.downpour._elastic_backup import fitted
from tfdist_ext.downpour._strategy import DownpourStrategy

# Optimizer options a replica's update cannot honour, with what to do
# instead; ``fit`` refuses them rather than ignore them.
_UNSUPPORTED = {
    "use_ema": (
        "its moving average would be of each worker's replica, never of the centre "
        "that evaluate() and save() see",
        "Compile without use_ema (the centre already averages the replicas)",
    ),
    "gradient_accumulation_steps": (
        "Keras accumulates gradients in variables written inside a cond, which an "
        "update on a replica's local tensors cannot carry out of it",
        "Compile without it and raise the batch size instead",
    ),
}


class ElasticAveragingStrategy(DownpourStrategy):
    """Asynchronous elastic averaging (Zhang, Choromanska, LeCun 2015).

    A centre variable, the model's own weights, lives on the ``ps`` tasks.
    Each ``worker`` task trains a replica of its own with the model's compiled
    optimizer (any Keras optimizer, ``weight_decay`` and clipping included:
    SGD with momentum is the paper's EAMSGD; Adagrad or Adam train as local
    SGD/DiLoCo's inner optimizers do); every ``tau`` of its local steps
    (across rounds) it exchanges the elastic difference with the centre, no
    other replica waiting (the model's bytes cross once each way)::

        d = alpha * (x_i - centre)     # computed on the ps, against its current centre
        x_i    <- x_i - d              # the replica moves toward the centre
        centre <- centre + d           # the centre moves toward the replica

    ``evaluate``, ``predict``, ``save`` and checkpoints see the centre. Each
    replica's weights and own copy of the optimizer's state (slots,
    ``iterations``, which a learning-rate schedule counts, a
    ``LossScaleOptimizer``'s scale) are kept on the ``ps`` tasks between
    rounds: a killed worker resumes from its last round. The learning rate is
    the compiled optimizer's (a callback setting it reaches every replica);
    ``optimizer.iterations`` counts the steps exchanged into the centre. As
    in Downpour, the logs hold ``staleness_*`` (the other replicas' exchanges
    since this one's last), ``pushes`` (exchanges) and bytes. A replica
    turned NaN or Inf skips its exchange (``rejected_pushes``) and restarts
    from the centre with a fresh optimizer state, as all do in an epoch that
    starts after the centre's weights were set or loaded. ``fit`` refuses,
    before the first step: ``use_ema``, ``gradient_accumulation_steps``, a
    ``train_step`` override (it would update the centre; ``compute_loss`` is
    honoured), split weights.

    Args:
      cluster_resolver: resolver of a cluster with ``chief``, ``worker`` and ``ps`` jobs.
      alpha: the moving rate of one exchange, in ``(0, 1)``; default ``0.9 / num_workers``.
      tau: a replica's local steps between its exchanges (the communication period).
      min_shard_bytes: as ``DownpourStrategy``'s; every weight must stay whole.
      deadline: seconds any wait on another task may take before it fails.

    Example (then ``compile`` in ``strategy.scope()``, e.g. with ``keras.optimizers.Adam()``):
      >>> strategy = tfdist_ext.ElasticAveragingStrategy(cluster.resolver, tau=10)  # doctest: +SKIP
    """

    _owner = "ElasticAveragingStrategy"

    def __init__(
        self,
        cluster_resolver,
        *,
        alpha=None,
        tau=10,
        min_shard_bytes=256 << 20,
        deadline=60.0,
    ):
        tau = positive_tau(tau)
        if alpha is not None:
            alpha = check_alpha(alpha)
        super().__init__(
            cluster_resolver,
            n_fetch=tau,
            n_push=tau,
            min_shard_bytes=min_shard_bytes,
            deadline=deadline,
        )
        self.alpha = 0.9 / self.num_workers if alpha is None else alpha
        self._replicas = {}  # id(model) -> (weakref(model), its latest round's _Replicas)
        self._restored = {}  # id(model) -> replica arrays from a backup, for its next round

    @property
    def tau(self):
        """A replica's local steps between its exchanges (settable between ``fit`` calls)."""
        return self.n_push

    @tau.setter
    def tau(self, value):
        self.n_fetch = self.n_push = positive_tau(value)

    def _round_knobs(self):
        return (self.tau, self.alpha)

    def _build_round(self, model, version):
        # A replica of an older generation restarts from the centre.
        return build_elastic_round(model, self, version, self._runtime.fit_generation())

    def _tfdist_fit(self, model, keras_fit, args, kwargs):
        self._check_open()
        check_trainable(model)
        # Keras's BackupAndRestore, as the user passes it, resumes the replicas too.
        args, kwargs = fit_with_state_backups(self, keras_fit, model, args, kwargs)
        return super()._tfdist_fit(model, keras_fit, args, kwargs)

    def _backup_state(self, model):
        """The replicas of ``model``, for Keras's ``BackupAndRestore`` (``_state_backup``)."""
        return ReplicaState(self, model)

    def _replicas_of(self, model):
        """The replicas of ``model``'s latest round, or ``None`` before its first."""
        entry = self._replicas.get(id(model))
        return entry[1] if entry is not None and entry[0]() is model else None

    def _restore_replicas(self, model, arrays):
        """Gives ``model``'s replicas the backed-up ``arrays`` now, or to its next round."""
        replicas = self._replicas_of(model)
        if replicas is None:
            self._restored[id(model)] = arrays
        else:
            replicas.assign(arrays)

    def _new_replicas(self, model, replicas):
        """``model``'s round made ``replicas``: they take a pending backup's values."""
        self._replicas[id(model)] = (weakref.ref(model), replicas)
        arrays = self._restored.pop(id(model), None)
        if arrays is not None:
            replicas.assign(arrays)

    def _stop_runtime(self):
        super()._stop_runtime()
        self._replicas.clear()

    def get_config(self):
        """The strategy's knobs (not the cluster) as a dict (see :meth:`from_config`)."""
        return {
            "alpha": self.alpha,
            "tau": self.tau,
            "min_shard_bytes": self.min_shard_bytes,
            "deadline": self.deadline,
        }


def positive_tau(value):
    return positive_int("ElasticAveragingStrategy", "tau", value)


def check_alpha(value):
    """``alpha`` as a float in ``(0, 1)``, or a clear error."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not 0.0 < float(value) < 1.0
    ):
        raise ValueError(
            "ElasticAveragingStrategy: alpha must be a number in (0, 1), the fraction "
            "of the replica-centre difference one exchange moves (the paper uses "
            f"0.9 / num_workers), got {value!r}"
        )
    return float(value)


def check_trainable(model):
    """Refuses, before the first step, what the replicas cannot train."""
    name = "ElasticAveragingStrategy"
    owner = _integration.overridden_step(model, "train_step")
    if owner is not None:
        raise ValueError(
            f"{name}: {owner.__name__} overrides train_step, which would read and update "
            "the centre variable on the parameter servers, not the worker's own replica. "
            "Put the custom loss in a compute_loss override instead (EASGD's local step "
            "then runs it on the replica), or use DownpourStrategy."
        )
    optimizer = model.optimizer
    if optimizer is None:
        raise ValueError(f"{name}: compile the model before fit()")
    for part in _with_inner(optimizer):
        config = part.get_config()
        for key, (why, instead) in _UNSUPPORTED.items():
            if config.get(key) not in (None, False):
                raise ValueError(
                    f"{name}: the compiled {type(part).__name__} has {key}={config[key]!r}; "
                    f"{why}. {instead}."
                )
    split = split_paths(model.trainable_variables)
    if split:
        raise ValueError(
            f"{name}: every replica's copy is kept next to its weight on the ps; "
            f"{', '.join(split)} are split across ps tasks (min_shard_bytes). Raise "
            "min_shard_bytes above the largest weight's size."
        )


def _with_inner(optimizer):
    """``optimizer``, and the one a ``LossScaleOptimizer`` wraps."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return [optimizer, optimizer.inner_optimizer]
    return [optimizer]


class _OptimizerState:
    """The compiled optimizer's variables as a replica has them.

    A replica has its own copy of each (``kept``: slots, ``iterations``, a
    ``LossScaleOptimizer``'s scale and counter) but the learning-rate
    variable (``shared``), which every block reads from the compiled
    optimizer so that a callback setting it reaches every replica.
    """

    def __init__(self, optimizer):
        self.variables = list(optimizer.variables)
        rate = optimizer.learning_rate  # the variable itself, unless a schedule
        self.shared = [v for v in self.variables if v is rate]
        self.kept = [v for v in self.variables if v is not rate]
        self.counter = optimizer.iterations
        self.scale_at = None
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            self.scale_at = next(i for i, v in enumerate(self.kept) if v is optimizer.dynamic_scale)

    @_staleness.graph_code
    def fresh(self, variable):
        """A fresh replica's value of ``variable`` (a weight or a kept one), read on its ps.

        The compiled optimizer's own state is never updated by the rounds:
        it is Keras's initial state (or one loaded); ``iterations`` starts
        at 0, as in a newly built optimizer (Adam's bias correction counts
        from the slots' start).
        """
        if variable is self.counter:
            return tf.zeros(variable.shape, variable.dtype)
        return tf.convert_to_tensor(variable.value.read_value())

    @_staleness.graph_code
    def read_shared(self):
        return [tf.convert_to_tensor(v.value.read_value()) for v in self.shared]

    @_staleness.graph_code
    def merge(self, kept, shared):
        """Values for all of ``optimizer.variables``, in their order."""
        kept, shared = iter(kept), iter(shared)
        return [next(shared) if self._is_shared(v) else next(kept) for v in self.variables]

    @_staleness.graph_code
    def keep(self, values):
        """The ``kept`` part of values for all of ``optimizer.variables``."""
        return [t for v, t in zip(self.variables, values) if not self._is_shared(v)]

    @_staleness.graph_code
    def scale(self, kept):
        """The replica's dynamic loss scale (a ``LossScaleOptimizer``'s), or ``None``."""
        return None if self.scale_at is None else kept[self.scale_at]

    def _is_shared(self, variable):
        return any(variable is v for v in self.shared)


class _ReplicaLossScale:
    """The loss scaling of a replica's step (``_round.keras_local_step``'s ``loss_scale``).

    Under a ``LossScaleOptimizer`` the loss is scaled by the replica's own
    dynamic scale (set with :meth:`using` while the step is traced) and the
    gradients are left scaled: Keras's update unscales them, skips a
    non-finite step and grows or halves that scale. Other optimizers:
    ``scale_loss`` (a ``loss_scale_factor``, which their update unscales).
    """

    def __init__(self):
        self.current = None

    @contextlib.contextmanager
    def using(self, scale):
        self.current = scale
        try:
            yield
        finally:
            self.current = None

    def read(self):
        return self.current

    def scale(self, optimizer, loss, scale):
        if scale is None:
            return optimizer.scale_loss(loss)
        return loss * tf.cast(scale, loss.dtype)

    def unscale(self, grads, scale):
        return grads


class _Replicas:
    """Each worker's replica and optimizer state between rounds, on the ps tasks.

    ``kept`` is the model's trainable weights, then the optimizer variables
    a replica has a copy of (``_OptimizerState.kept``). Row ``i`` of
    ``rows[j]`` is worker ``i``'s copy of ``kept[j]``, colocated with it;
    ``since[i]`` counts its local steps since its last exchange (a period
    of ``tau`` steps may span rounds); ``born[i]`` is the generation the row
    belongs to (an older one starts afresh: ``DownpourRuntime.fit_generation``).

    Every round saves its replica to the rows (a killed worker, and a
    backup, resume from them) and also keeps it on the worker
    (``_round.WorkerCopy``): the worker's next round starts from that copy,
    so the replica and its optimizer state cross to the ps once per round
    instead of both ways.
    """

    def __init__(self, strategy, trainable, state, generation):
        self.trainable = trainable
        self.kept = trainable + state.kept
        self.fresh = state.fresh
        self.generation = generation
        self.homes = [_round.home(v) for v in self.kept]
        workers = strategy.num_workers
        self.rows = []
        with strategy.scope():
            self.born = tf.Variable(
                tf.fill([workers], tf.constant(-1, tf.int64)), trainable=False, name="easgd_born"
            )
            with strategy.extended.colocate_vars_with(self.born):
                self.since = tf.Variable(
                    tf.zeros([workers], tf.int64), trainable=False, name="easgd_since"
                )
            for v in self.kept:
                with strategy.extended.colocate_vars_with(v.value):
                    self.rows.append(
                        tf.Variable(
                            tf.zeros([workers, *v.shape], v.dtype),
                            trainable=False,
                            name="easgd_replica",
                        )
                    )
        self.held = _round.WorkerCopy(strategy, self.kept, tf.int32)

    @_staleness.graph_code
    def load(self, worker):
        """``(weights, optimizer state, steps since the last exchange, loaded)``
        of the worker's replica: the copy it held from its last round while
        its row is still that round's save, else its saved row or a fresh
        replica (``loaded``: read from the ps)."""
        index = tf.reshape(tf.cast(worker, tf.int64), [1])
        born = self.born.sparse_read(index)[0]
        generation = self.generation.read_value()
        # Read outside the cond: a per-worker variable is read where the
        # function binds it to the worker's copy.
        held, held_since, held_born = self.held.read()
        # A row of this generation was saved by this worker's rounds (a
        # backup's rows are RESTORED): if the worker holds the same
        # generation's copy, it is the row's latest save.
        holds = tf.logical_and(tf.equal(born, generation), tf.equal(held_born, generation))
        weights, state, since = tf.cond(
            holds,
            lambda: (*self._split(held), held_since),
            lambda: self._row_or_fresh(index, born, generation),
        )
        return weights, state, since, tf.logical_not(holds)

    @_staleness.graph_code
    def _row_or_fresh(self, index, born, generation):
        """The worker's saved row (from the ps), or a fresh replica."""
        fresh = tf.logical_and(tf.not_equal(born, generation), tf.not_equal(born, RESTORED))
        values = []
        for v, rows in zip(self.kept, self.rows):
            with tf.device(v.value.device):
                values.append(
                    tf.cond(
                        fresh,
                        lambda v=v: self.fresh(v),
                        lambda rows=rows: rows.sparse_read(index)[0],
                    )
                )
        since = tf.where(fresh, tf.constant(0, tf.int64), self.since.sparse_read(index)[0])
        weights, state = self._split(_round.one_transfer_per_task(values, self.homes, to_ps=False))
        return weights, state, tf.cast(since, tf.int32)

    @_staleness.graph_code
    def restart(self):
        """``(weights, optimizer state)`` of a fresh replica: the centre's weights."""
        values = []
        for v in self.kept:
            with tf.device(v.value.device):
                values.append(self.fresh(v))
        return self._split(_round.one_transfer_per_task(values, self.homes, to_ps=False))

    @_staleness.graph_code
    def save(self, worker, weights, state, since):
        """Keeps the worker's replica, optimizer state and period for its next round."""
        index = tf.reshape(tf.cast(worker, tf.int64), [1])
        generation = self.generation.read_value()
        ops = [
            self.born.scatter_update(tf.IndexedSlices(generation[None], index)),
            self.since.scatter_update(tf.IndexedSlices(tf.cast(since, tf.int64)[None], index)),
        ]
        values = _round.one_transfer_per_task([*weights, *state], self.homes, to_ps=True)
        for value, rows, v in zip(values, self.rows, self.kept):
            with tf.device(v.value.device):
                ops.append(rows.scatter_update(tf.IndexedSlices(value[None], index)))
        # Held only once saved: a held copy is never ahead of its row.
        with tf.control_dependencies(ops):
            return ops + self.held.keep([*weights, *state], since, generation)

    @_staleness.graph_code
    def exchange(self, weights, alpha):
        """The elastic exchange: the centre moves by ``d``; returns ``d`` on the worker."""
        homes = self.homes[: len(self.trainable)]
        sent = _round.one_transfer_per_task(weights, homes, to_ps=True)
        moves = []
        for x, v in zip(sent, self.trainable):
            with tf.device(v.value.device):
                d = tf.cast(alpha, x.dtype) * (x - v.value.read_value())
                with tf.control_dependencies([v.value.assign_add(d)]):
                    moves.append(tf.identity(d))
        return _round.one_transfer_per_task(moves, homes, to_ps=False)

    def snapshot(self):
        """The rows as NumPy arrays, for a backup: ``row_J`` (``kept[J]``'s),
        ``since``, and ``valid`` (rows of the current generation, or restored
        and not yet continued)."""
        arrays = {f"row_{j}": rows.numpy() for j, rows in enumerate(self.rows)}
        arrays["since"] = self.since.numpy()
        born = self.born.numpy()
        arrays["valid"] = (born == self.generation.numpy()) | (born == RESTORED)
        return arrays

    def assign(self, arrays):
        """Takes :meth:`snapshot`'s ``arrays`` (a backup): each worker's next
        round continues its saved replica (a worker the backup has no row
        for starts afresh)."""
        rows, since, born = fitted(arrays, self.kept, self.since.shape[0])
        for variable, value in zip(self.rows, rows):
            variable.assign(value)
        self.since.assign(since)
        self.born.assign(born)

    def _split(self, values):
        n = len(self.trainable)
        return values[:n], values[n:]


def build_elastic_round(model, strategy, version, generation):
    """The tf.function one worker runs for a round of EASGD.

    Same inputs and outputs as Downpour's round (``_round.build_round``):
    ``round_fn(batches, worker, num_steps, prefetch)`` returns the round's
    counters; ``pushes`` counts exchanges with the centre, ``applied_steps``
    the local steps trained (what ``optimizer.iterations`` counts, as in Keras).
    """
    return tf.function(_ElasticRound(model, strategy, version, generation).run)


class _ElasticRound:
    """A worker's round: local steps of the compiled optimizer on its replica,
    an exchange with the centre at the end of each period of ``tau`` of them.

    As in Downpour's round, only :meth:`run` and :meth:`local_steps` hold
    loops or conds on tensors (autograph converts them); what they call is
    graph code.
    """

    def __init__(self, model, strategy, version, generation):
        self.trainable = list(model.trainable_variables)
        if not self.trainable:
            raise ValueError("ElasticAveragingStrategy: the model has no trainable weights")
        self.strategy, self.version = strategy, version
        self.optimizer = _round._built_optimizer(model, strategy)
        self.state = _OptimizerState(self.optimizer)
        self.loss_scale = _ReplicaLossScale()
        self.step, self.metric_vars = _round.keras_local_step(
            model, self.optimizer, self.loss_scale
        )
        self.replicas = _Replicas(strategy, self.trainable, self.state, generation)
        strategy._new_replicas(model, self.replicas)
        self.tau, self.alpha = strategy.tau, strategy.alpha
        self.param_bytes = sum(_round.nbytes(v) for v in self.trainable)
        self.state_bytes = sum(_round.nbytes(v) for v in self.replicas.kept)

    def local_steps(self, batches, first, count, x, kept, metric_values, shared):
        """Steps ``first..first+count`` of the round: the compiled optimizer's
        updates of the replica ``x`` (and of its state ``kept``), on the worker."""
        state = self.state
        for i in tf.range(count):
            data = _round.batch_of(batches, first + i)
            with self.loss_scale.using(state.scale(kept)):
                grads, metric_values = self.strategy.run(self.step, args=(x, metric_values, data))
            values = state.merge(kept, shared)
            x, values = _integration.stateless_apply(
                self.optimizer, values, grads, x, self.trainable
            )
            kept = state.keep(values)
        return x, kept, metric_values

    @_staleness.graph_code
    def exchange(self, x):
        """The replica after an exchange with the centre, and the server version before it."""
        moves = self.replicas.exchange(x, self.alpha)
        before = self.version.assign_add(1) - 1
        iterations = self.optimizer.iterations.value
        iterations.assign_add(tf.cast(self.tau, iterations.dtype))
        return [w - d for w, d in zip(x, moves)], before

    def run(self, batches, worker, num_steps, prefetch=True):
        """``num_steps`` local steps (``prefetch``: Downpour's; a replica is kept anyway)."""
        metrics_start = [tf.convert_to_tensor(v.value) for v in self.metric_vars]
        metric_values = metrics_start
        x, kept, since, loaded = self.replicas.load(worker)
        seen = self.version.read_value()
        exchanges = rejected = tf.constant(0, tf.int64)
        staleness = tf.TensorArray(tf.int64, size=0, dynamic_size=True)
        done = tf.constant(0, tf.int32)
        while done < num_steps:
            # Blocks end where the replica's period of tau local steps does.
            count = tf.minimum(self.tau - since, num_steps - done)
            # The learning rate is read at each block: a callback may have set it.
            x, kept, metric_values = self.local_steps(
                batches, done, count, x, kept, metric_values, self.state.read_shared()
            )
            done += count
            since += count
            if since == self.tau:
                since = tf.constant(0, tf.int32)
                if tf.reduce_all([tf.reduce_all(tf.math.is_finite(w)) for w in x]):
                    x, before = self.exchange(x)
                    staleness = staleness.write(staleness.size(), before - seen)
                    seen = before + 1
                    exchanges += 1
                else:
                    # A diverged replica does not touch the centre: it restarts there.
                    rejected += 1
                    x, kept = self.replicas.restart()
        writes = self.replicas.save(worker, x, kept, since)
        steps = _round.after_writes(
            tf.cast(num_steps, tf.int64), writes, self.metric_vars, metric_values, metrics_start
        )
        return self.counters(worker, steps, exchanges, rejected, staleness.stack(), loaded)

    @_staleness.graph_code
    def counters(self, worker, steps, exchanges, rejected, staleness, loaded):
        """What a round returns (see ``_round.DownpourRound.counters``)."""
        exchanged = exchanges * self.param_bytes
        saved = exchanged + self.state_bytes  # the round's save
        fetched = exchanged + tf.cast(loaded, tf.int64) * self.state_bytes
        return {
            "worker": worker,
            "steps": steps,
            # Keras counts every training step: so do the centre's iterations,
            # whether a replica has exchanged its latest steps yet or not.
            "applied_steps": steps,
            "pushes": exchanges,
            "fetches": exchanges + tf.cast(loaded, tf.int64),
            # Started from the replica the worker held (Downpour's word for
            # a round that began with no fetch).
            "prefetched": tf.cast(tf.logical_not(loaded), tf.int64),
            "rejected": rejected,
            "staleness": staleness,
            "push_bytes": saved,
            "fetch_bytes": fetched,
        }
