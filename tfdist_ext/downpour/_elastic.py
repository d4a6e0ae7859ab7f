"""ElasticAveragingStrategy: asynchronous EASGD for Keras 3 ``model.fit``."""

import numbers

import keras
import tensorflow as tf

from tfdist_ext import _integration
from tfdist_ext.cluster._ps_strategy import positive_int
from tfdist_ext.cluster._ps_strategy import split_paths
from tfdist_ext.downpour import _round
from tfdist_ext.downpour._strategy import DownpourStrategy

# Optimizer settings the local SGD step does not implement; ``fit`` refuses
# them rather than ignore them.
_UNSUPPORTED = ("weight_decay", "clipnorm", "clipvalue", "global_clipnorm", "use_ema")


class ElasticAveragingStrategy(DownpourStrategy):
    """Asynchronous elastic averaging SGD (Zhang, Choromanska, LeCun 2015).

    A centre variable, the model's own weights, lives on the ``ps`` tasks.
    Each ``worker`` task keeps a replica of its own and trains it locally
    with SGD (momentum and Nesterov as in the compiled
    ``keras.optimizers.SGD``: the paper's EASGD and EAMSGD); every ``tau``
    local steps it exchanges the elastic difference with the centre, with
    no other replica waiting::

        d = alpha * (x_i - centre)     # computed on the ps, against its current centre
        x_i    <- x_i - d              # the replica moves toward the centre
        centre <- centre + d           # the centre moves toward the replica

    The replica sends ``x_i`` and gets ``d`` back: per exchange, the model's
    bytes once each way, against Downpour's push and fetch at every
    ``n_push``/``n_fetch`` steps. ``evaluate``, ``predict``, ``save`` and
    checkpoints see the centre, the model the paper evaluates.

    Everything else is Downpour's (this class extends ``DownpourStrategy``):
    ``fit`` schedules rounds of many local steps on whichever worker is free;
    the logs hold ``staleness_mean``/``staleness_max`` (here: the other
    replicas' exchanges with the centre since this replica's previous one),
    ``pushes`` (exchanges) and bytes per step. A killed worker loses only the
    local steps of its current round: each replica's weights (and momentum)
    are kept on the ``ps`` tasks between rounds, so the worker resumes from
    its last round when it is back; the others carry on meanwhile. A replica
    whose weights become NaN or Inf does not exchange (counted in
    ``rejected_pushes``, with a warning) and restarts from the centre. A lost
    ``ps`` task stops ``fit`` with a clear error. Epoch after epoch and
    ``fit`` after ``fit`` continue the replicas; an epoch that starts after
    the centre's weights were set (or loaded) starts each replica from the
    centre.

    ``fit`` refuses, before the first step: an optimizer other than
    ``keras.optimizers.SGD`` (EASGD's local update is SGD; wrap nothing,
    ``mixed_float16``'s ``LossScaleOptimizer`` included), SGD's
    ``weight_decay``/clipping/EMA options, a model that overrides
    ``train_step`` (it would read and update the centre, not the replica),
    and weights split across ``ps`` tasks (raise ``min_shard_bytes``). A
    ``compute_loss`` override is honoured.

    Args:
      cluster_resolver: resolver of a cluster with ``chief`` (this process),
        ``worker`` and ``ps`` jobs, e.g. ``LocalCluster(...).resolver``.
      alpha: the moving rate of one exchange, in ``(0, 1)``; default
        ``0.9 / num_workers`` (the paper's ``beta = num_workers * alpha = 0.9``).
      tau: local steps between exchanges (the communication period).
      min_shard_bytes: as ``DownpourStrategy``'s; EASGD needs every weight
        whole on one ``ps`` task.
      deadline: seconds any wait on another task may take before it fails.

    Example:
      >>> with tfdist_ext.LocalCluster(num_workers=2, num_ps=1) as cluster:  # doctest: +SKIP
      ...     strategy = tfdist_ext.ElasticAveragingStrategy(cluster.resolver, tau=10)
      ...     with strategy.scope():
      ...         model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
      ...         model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
      ...                       loss="sparse_categorical_crossentropy", metrics=["accuracy"])
      ...     model.fit(train_ds, epochs=5, steps_per_epoch=200)
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

    @property
    def tau(self):
        """Local steps between exchanges with the centre (settable between ``fit`` calls)."""
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
        return super()._tfdist_fit(model, keras_fit, args, kwargs)

    def get_config(self):
        """The strategy's knobs (not the cluster) as a dict."""
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
    """Refuses, before the first step, what EASGD's local SGD cannot train."""
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
    if type(optimizer) is not keras.optimizers.SGD:
        raise ValueError(
            f"{name}: each replica's local update is SGD (EASGD; EAMSGD with momentum), "
            f"so compile with keras.optimizers.SGD(learning_rate, momentum=...); got "
            f"{type(optimizer).__name__}. (mixed_float16 wraps it in a LossScaleOptimizer, "
            "which is not supported either.)"
        )
    config = optimizer.get_config()
    used = [key for key in _UNSUPPORTED if config.get(key) not in (None, False)]
    if used:
        raise ValueError(
            f"{name}: the local SGD step does not implement {', '.join(used)} of the "
            "compiled optimizer; compile keras.optimizers.SGD without them"
        )
    split = split_paths(model.trainable_variables)
    if split:
        raise ValueError(
            f"{name}: every replica's copy is kept next to its weight on the ps; "
            f"{', '.join(split)} are split across ps tasks (min_shard_bytes). Raise "
            "min_shard_bytes above the largest weight's size."
        )


class _Replicas:
    """Each worker's replica (and SGD momentum) between rounds, on the ps tasks.

    Row ``i`` of ``weights[j]`` is worker ``i``'s copy of trainable weight
    ``j``, colocated with the weight; ``born[i]`` is the generation
    that row belongs to (an older one restarts from the centre: see
    ``DownpourRuntime.fit_generation``).
    """

    def __init__(self, strategy, trainable, momentum, generation):
        self.trainable = trainable
        self.generation = generation
        self.homes = [_round.home(v) for v in trainable]
        workers = strategy.num_workers
        self.weights, self.velocities = [], []
        with strategy.scope():
            self.born = tf.Variable(
                tf.fill([workers], tf.constant(-1, tf.int64)), trainable=False, name="easgd_born"
            )
            for v in trainable:
                with strategy.extended.colocate_vars_with(v.value):
                    shape = [workers, *v.shape]
                    self.weights.append(
                        tf.Variable(tf.zeros(shape, v.dtype), trainable=False, name="easgd_replica")
                    )
                    if momentum:
                        self.velocities.append(
                            tf.Variable(
                                tf.zeros(shape, v.dtype), trainable=False, name="easgd_velocity"
                            )
                        )

    def load(self, worker):
        """The worker's replica and momentum: its saved row, or the centre and zeros."""
        index = tf.reshape(tf.cast(worker, tf.int64), [1])
        fresh = tf.not_equal(self.born.sparse_read(index)[0], self.generation.read_value())
        weights = []
        for v, rows in zip(self.trainable, self.weights):
            with tf.device(v.value.device):
                weights.append(
                    tf.cond(
                        fresh,
                        lambda v=v: tf.convert_to_tensor(v.value.read_value()),
                        lambda rows=rows: rows.sparse_read(index)[0],
                    )
                )
        velocities = []
        for v, rows in zip(self.trainable, self.velocities):
            with tf.device(v.value.device):
                velocities.append(
                    tf.cond(
                        fresh,
                        lambda v=v: tf.zeros(v.shape, v.dtype),
                        lambda rows=rows: rows.sparse_read(index)[0],
                    )
                )
        weights = _round.one_transfer_per_task(weights, self.homes, to_ps=False)
        velocities = _round.one_transfer_per_task(
            velocities, self.homes[: len(velocities)], to_ps=False
        )
        return weights, velocities

    def save(self, worker, weights, velocities):
        """Keeps the worker's replica and momentum for its next round."""
        index = tf.reshape(tf.cast(worker, tf.int64), [1])
        ops = [
            self.born.scatter_update(tf.IndexedSlices(self.generation.read_value()[None], index))
        ]
        for values, rows in ((weights, self.weights), (velocities, self.velocities)):
            values = _round.one_transfer_per_task(values, self.homes[: len(values)], to_ps=True)
            for value, row_var, v in zip(values, rows, self.trainable):
                with tf.device(v.value.device):
                    ops.append(row_var.scatter_update(tf.IndexedSlices(value[None], index)))
        return ops

    def exchange(self, weights, alpha):
        """The elastic exchange: the centre moves by ``d``; returns ``d`` on the worker."""
        sent = _round.one_transfer_per_task(weights, self.homes, to_ps=True)
        moves = []
        for x, v in zip(sent, self.trainable):
            with tf.device(v.value.device):
                d = tf.cast(alpha, x.dtype) * (x - v.value.read_value())
                with tf.control_dependencies([v.value.assign_add(d)]):
                    moves.append(tf.identity(d))
        return _round.one_transfer_per_task(moves, self.homes, to_ps=False)


def build_elastic_round(model, strategy, version, generation):
    """The tf.function one worker runs for a round of EASGD (``tau``-step blocks).

    Same inputs and outputs as Downpour's round (``_round.build_round``):
    ``round_fn(iterator, worker, num_steps, prefetch)`` returns the round's counters;
    ``pushes`` counts exchanges with the centre.
    """
    trainable = list(model.trainable_variables)
    if not trainable:
        raise ValueError("ElasticAveragingStrategy: the model has no trainable weights")
    optimizer = _round._built_optimizer(model, strategy)
    step, metric_vars = _round.keras_local_step(model, optimizer, _round.LossScale())
    momentum, nesterov = float(optimizer.momentum), bool(optimizer.nesterov)
    replicas = _Replicas(strategy, trainable, momentum, generation)
    tau, alpha = strategy.tau, strategy.alpha
    param_bytes = sum(_round.nbytes(v) for v in trainable)
    state_bytes = param_bytes * (2 if momentum else 1)
    iterations = optimizer.iterations.value

    def sgd(x, velocity, grads, lr):
        """Keras SGD's update of one replica, on local tensors."""
        if not momentum:
            return [w - tf.cast(lr, w.dtype) * g for w, g in zip(x, grads)], velocity
        velocity = [momentum * m - tf.cast(lr, m.dtype) * g for m, g in zip(velocity, grads)]
        if nesterov:
            x = [w + momentum * m - tf.cast(lr, w.dtype) * g for w, m, g in zip(x, velocity, grads)]
        else:
            x = [w + m for w, m in zip(x, velocity)]
        return x, velocity

    def local_steps(iterator, count, x, velocity, metric_values, lr):
        for _ in tf.range(count):
            grads, metric_values = strategy.run(step, args=(x, metric_values, next(iterator)))
            x, velocity = sgd(x, velocity, grads, lr)
        return x, velocity, metric_values

    @tf.function
    def round_fn(iterator, worker, num_steps, prefetch=True):
        """``num_steps`` local steps (``prefetch``: Downpour's; a replica is kept anyway)."""
        metrics_start = [tf.convert_to_tensor(v.value) for v in metric_vars]
        metric_values = metrics_start
        x, velocity = replicas.load(worker)
        seen = version.read_value()
        exchanges = tf.constant(0, tf.int64)
        rejected = tf.constant(0, tf.int64)
        applied = tf.constant(0, tf.int64)
        staleness = tf.TensorArray(tf.int64, size=0, dynamic_size=True)
        done = tf.constant(0, tf.int32)
        while done < num_steps:
            count = tf.minimum(tau, num_steps - done)
            lr = tf.convert_to_tensor(optimizer.learning_rate)
            x, velocity, metric_values = local_steps(
                iterator, count, x, velocity, metric_values, lr
            )
            done += count
            finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(w)) for w in x])
            if finite:
                moves = replicas.exchange(x, alpha)
                x = [w - d for w, d in zip(x, moves)]
                before = version.assign_add(1) - 1
                staleness = staleness.write(staleness.size(), before - seen)
                seen = before + 1
                iterations.assign_add(tf.cast(count, iterations.dtype))
                exchanges += 1
                applied += tf.cast(count, tf.int64)
            else:
                # A diverged replica does not touch the centre: it restarts there.
                rejected += 1
                x = _round.one_transfer_per_task(
                    [tf.convert_to_tensor(v.value.read_value()) for v in trainable],
                    replicas.homes,
                    to_ps=False,
                )
                velocity = [tf.zeros_like(m) for m in velocity]
        steps = _round.after_writes(
            tf.cast(num_steps, tf.int64),
            replicas.save(worker, x, velocity),
            metric_vars,
            metric_values,
            metrics_start,
        )
        return {
            "worker": worker,
            "steps": steps,
            "applied_steps": applied,
            "pushes": exchanges,
            "fetches": exchanges + 1,
            "rejected": rejected,
            "staleness": staleness.stack(),
            "push_bytes": exchanges * param_bytes + state_bytes,
            "fetch_bytes": exchanges * param_bytes + state_bytes,
        }

    return round_fn
