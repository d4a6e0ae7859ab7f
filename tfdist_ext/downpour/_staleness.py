"""Staleness policies of Downpour: corrections of stale pushes and bounded staleness.

The public objects are configuration: :class:`StalenessAwareLR` and
:class:`DelayCompensation` (``DownpourStrategy(staleness_policy=...)``) say
how the ``ps`` tasks apply a stale push, and ``max_staleness`` bounds how far
replicas drift apart (stale synchronous parallel). What runs on the cluster is
built per traced round by :func:`server_side` (the fetch and the apply of a
push, on the ``ps`` tasks) and :func:`clock_bound` (the SSP clocks), both
called from ``_round.py`` at one point each: before a fetch (only when one
is due), the fetch (reads on the ``ps``, in every block; they cross only
when due), the apply, and the start and end of each push block.

Staleness ``tau`` of a push is the server version (the ``ps`` update counter
that ``DownpourStats.staleness`` is measured in) when the ``ps`` starts
applying it, minus the version the replica fetched the parameters at that
the push's gradients were computed from. ``stats.staleness`` records the
counter when the push's update is counted, just after the apply: when another
replica's push is applied between the two reads, the recorded value is larger
than the ``tau`` the policy used by the number of such pushes.
"""

import math

import keras
import tensorflow as tf

from tfdist_ext import _integration
from tfdist_ext._ps_strategy import split_paths
from tfdist_ext.cluster._local import ClusterTimeoutError

_SSP_TIMEOUT = "DownpourStrategy max_staleness:"

# What the round calls is written as graph code (tf.while_loop, no Python
# control flow on tensors): autograph need not, and must not, convert it.
graph_code = tf.autograph.experimental.do_not_convert


class StalenessPolicy:
    """Base class of Downpour's staleness policies (how a stale push is applied).

    Configuration only (``get_config``/``from_config``, compared by
    config); what runs on the ``ps`` tasks is built per traced round.

    Example:
      >>> import tfdist_ext
      >>> isinstance(tfdist_ext.downpour.StalenessAwareLR(), tfdist_ext.downpour.StalenessPolicy)
      True
    """

    def get_config(self):
        return {}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other):
        return type(self) is type(other) and self.get_config() == other.get_config()

    def __hash__(self):
        return hash((type(self), tuple(sorted(self.get_config().items()))))


@keras.saving.register_keras_serializable(package="tfdist_ext")
class StalenessAwareLR(StalenessPolicy):
    """Staleness-dependent learning rate (Zhang, Gupta, Lian and Liu, 2016).

    The ``ps`` applies a push of staleness ``tau`` with the learning rate
    ``lr / max(tau, 1)``, where ``tau`` is the server version when the ``ps``
    starts the apply minus the version the push's gradients were computed
    from (the fetch the push's block computed on; the latest of them when a
    push spans several), in the units of
    ``strategy.stats.staleness``.

    It is the learning rate of that one apply that is divided, not the
    gradient: the optimizer is applied with the gradient as pushed and a rate
    of ``lr / max(tau, 1)`` (its current rate: a variable or a
    ``LearningRateSchedule``). For SGD the two are the same; for Adagrad, Adam
    or RMSprop, dividing the gradient would also shrink what their
    accumulators see (Adagrad's sum of squares would grow by ``g**2 / tau**2``
    and later updates would be larger), so only the rate is the paper's rule.
    Weight decay, which Keras scales by the rate, is divided likewise.

    Example:
      >>> import tfdist_ext
      >>> policy = tfdist_ext.downpour.StalenessAwareLR()
      >>> strategy = tfdist_ext.DownpourStrategy(  # doctest: +SKIP
      ...     cluster.resolver, staleness_policy=policy)
    """

    @staticmethod
    def rate_factor(staleness):
        """``1 / max(staleness, 1)`` as a float32 tensor (the factor on the rate)."""
        tau = tf.cast(staleness, tf.float32)
        return 1.0 / tf.maximum(tau, 1.0)


@keras.saving.register_keras_serializable(package="tfdist_ext")
class DelayCompensation(StalenessPolicy):
    """Delay-compensated asynchronous SGD, DC-ASGD (Zheng et al., 2017).

    The ``ps`` corrects a stale gradient with the first-order Taylor term of
    the parameters' drift, approximating the Hessian by ``g ⊙ g``::

        g_corrected = g + lam * g ⊙ g ⊙ (w_now - w_fetched)

    where ``g`` is the pushed gradient (the sum of the push's ``n_push`` local
    gradients, as pushed), ``w_now`` the parameters when the ``ps`` applies it
    and ``w_fetched`` those the replica computed ``g`` from. The optimizer is
    then applied to ``g_corrected`` as usual. As in the paper, ``w_fetched``
    is kept on the ``ps`` tasks (two backup copies of the model per worker, no
    extra network bytes). It is refused with ``compression``, a model that
    overrides ``train_step`` and weights split across ``ps`` tasks. The guide
    (``docs/api/guides/downpour.rst``) covers the backups and their cost.

    Args:
      lam: the variance-control parameter ``lambda`` of the paper (finite,
        ``>= 0``; ``0`` is plain Downpour).

    Example:
      >>> import tfdist_ext
      >>> policy = tfdist_ext.downpour.DelayCompensation(lam=0.04)
      >>> policy.get_config()
      {'lam': 0.04}
      >>> strategy = tfdist_ext.DownpourStrategy(  # doctest: +SKIP
      ...     cluster.resolver, staleness_policy=policy)
    """

    def __init__(self, lam=0.04):
        try:
            ok = isinstance(lam, (int, float)) and not isinstance(lam, bool)
            ok = ok and math.isfinite(lam) and lam >= 0
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"DelayCompensation: lam must be a finite number >= 0, got {lam!r}")
        self.lam = float(lam)

    def get_config(self):
        return {"lam": self.lam}

    def correct(self, grad, w_now, w_fetched):
        """``grad + lam * grad * grad * (w_now - w_fetched)`` (elementwise)."""
        lam = tf.cast(self.lam, grad.dtype)
        return grad + lam * grad * grad * (w_now - w_fetched)


def check_policy(policy):
    """``policy`` if it is ``None`` or a staleness policy; a clear error otherwise."""
    if policy is None or isinstance(policy, StalenessPolicy):
        return policy
    raise ValueError(
        "DownpourStrategy: staleness_policy must be None, "
        "tfdist_ext.downpour.StalenessAwareLR() or "
        f"tfdist_ext.downpour.DelayCompensation(lam=...), got {policy!r}"
    )


def check_max_staleness(value):
    """``value`` if it is ``None`` or an int ``>= 0``; a clear error otherwise."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value
    raise ValueError(f"DownpourStrategy: max_staleness must be None or an int >= 0, got {value!r}")


def policy_to_config(policy):
    return None if policy is None else keras.saving.serialize_keras_object(policy)


def policy_from_config(config):
    return None if config is None else keras.saving.deserialize_keras_object(config)


# -- the server side of a round ------------------------------------------------


def server_side(strategy, trainable, version, custom_step=False):
    """The fetch and the apply of a push for ``strategy.staleness_policy``."""
    policy = strategy.staleness_policy
    if custom_step and strategy.max_staleness is not None:
        raise ValueError(
            "DownpourStrategy: max_staleness waits before each fetch of the "
            "parameters; a model that overrides train_step reads the server's "
            "variables itself, with no fetch to wait before. Use a compute_loss "
            "override instead of train_step, or max_staleness=None."
        )
    if isinstance(policy, DelayCompensation):
        return _DelayCompensated(strategy, policy, trainable, version, custom_step)
    if isinstance(policy, StalenessAwareLR):
        return _StalenessScaled(trainable, version)
    return _Plain(trainable)


def _read_on(variable):
    """``variable``'s value, read on its own device.

    For a piece of a split variable: without the scope, ``read_value``'s
    identity is placed on the worker, so the raw read crosses, and
    ``_round.pack``'s copy on the ps sends it back and forth again.
    """
    with tf.device(variable.device):
        return variable.read_value()


def read_pieces(trainable):
    """Each variable of ``trainable`` read on the ``ps``: a split one as the
    list of its pieces, each read on its own task."""
    return [
        [_read_on(piece) for piece in v.value.variables]
        if isinstance(v.value, _integration.ShardedVariable)
        else tf.convert_to_tensor(v.value)
        for v in trainable
    ]


class _Plain:
    """Plain Downpour: the worker reads the parameters; the push is applied as is."""

    # A fetch only reads: it may happen at any time, a round early too.
    fetch_is_a_read = True

    def __init__(self, trainable):
        self.trainable = trainable

    @graph_code
    def before_fetch(self, worker, slot):
        """The ps side's work before a fetch (run only when one is due); an op to wait for."""
        return tf.no_op()

    @graph_code
    def fetch(self, worker, slot):
        """The worker's local copy of the parameters: reads on the ps, nothing else.

        A variable split across the ps tasks is read as its pieces (a list),
        each on its task.
        """
        return read_pieces(self.trainable)

    @graph_code
    def apply(self, optimizer, grads, worker, fetched, slot):
        """Applies a push of ``grads`` computed by ``worker`` from version ``fetched``.

        ``slot``: the backup slot of that fetch (see ``DelayCompensation``).
        """
        optimizer.apply_gradients(zip(grads, self.trainable))


class _StalenessScaled(_Plain):
    def __init__(self, trainable, version):
        super().__init__(trainable)
        self.version = version

    @graph_code
    def apply(self, optimizer, grads, worker, fetched, slot):
        factor = StalenessAwareLR.rate_factor(self.version.read_value() - fetched)
        with _integration.scaled_learning_rate(optimizer, factor):
            optimizer.apply_gradients(zip(grads, self.trainable))


class _DelayCompensated(_Plain):
    # A fetch fills a backup slot that the pushes computed from it use.
    fetch_is_a_read = False

    def __init__(self, strategy, policy, trainable, version, custom_step):
        super().__init__(trainable)
        if custom_step:
            raise ValueError(
                "DownpourStrategy: DelayCompensation needs the parameters each push "
                "was computed from, backed up on the ps when the worker fetches them; "
                "a model that overrides train_step reads the server's variables itself "
                "(no fetch). Use StalenessAwareLR, or a compute_loss override instead "
                "of train_step."
            )
        split = split_paths(trainable)
        if split:
            raise ValueError(
                "DownpourStrategy: DelayCompensation keeps each worker's fetched copy "
                f"next to its parameter on the ps; {', '.join(split)} are split across "
                "ps tasks (min_shard_bytes). Raise min_shard_bytes above the largest "
                "weight's size."
            )
        self.policy = policy
        num_workers = strategy.num_workers
        self.backups = []
        with strategy.scope():
            for v in trainable:
                with strategy.extended.colocate_vars_with(v.value):
                    self.backups.append(
                        tf.Variable(  # slot s of worker i: row 2 * i + s
                            tf.zeros([2 * num_workers, *v.shape], v.dtype),
                            trainable=False,
                            name="downpour_dc_backup",
                        )
                    )

    @staticmethod
    def _row(worker, slot):
        return tf.reshape(2 * tf.cast(worker, tf.int64) + tf.cast(slot, tf.int64), [1])

    @graph_code
    def before_fetch(self, worker, slot):
        """Copies the parameters into ``worker``'s backup ``slot`` (on the ps)."""
        index = self._row(worker, slot)
        copies = []
        for v, backup in zip(self.trainable, self.backups):
            with tf.device(v.value.device):
                copies.append(
                    backup.scatter_update(tf.IndexedSlices(v.value.read_value()[None], index))
                )
        return tf.group(copies)

    @graph_code
    def fetch(self, worker, slot):
        """The worker reads its backup ``slot``: what ``before_fetch`` copied."""
        index = self._row(worker, slot)
        params = []
        for v, backup in zip(self.trainable, self.backups):
            with tf.device(v.value.device):
                params.append(backup.sparse_read(index)[0])
        return params

    @graph_code
    def apply(self, optimizer, grads, worker, fetched, slot):
        index = self._row(worker, slot)
        corrected = []
        for g, v, backup in zip(grads, self.trainable, self.backups):
            with tf.device(v.value.device):
                w_fetched = backup.sparse_read(index)[0]
                corrected.append(self.policy.correct(g, v.value.read_value(), w_fetched))
        optimizer.apply_gradients(zip(corrected, self.trainable))


# -- bounded staleness (stale synchronous parallel) ----------------------------


def clock_bound(strategy):
    """The SSP clocks of ``strategy.max_staleness`` (a no-op without it)."""
    if strategy.max_staleness is None:
        return _Unbounded()
    return _ClockBound(strategy)


class _Unbounded:
    """No bound: nothing waits, nothing is recorded."""

    s = None

    @graph_code
    def start(self, worker):
        return tf.constant(0, tf.int64)

    @graph_code
    def before_fetch(self, worker):
        return tf.constant(0, tf.int64)

    @graph_code
    def stop(self, worker):
        return tf.constant(0, tf.int64)

    def lead_histogram(self):
        return None


class _ClockBound:
    """Stale synchronous parallel (Ho et al., 2013) over Downpour's fetch blocks.

    A worker's clock counts the fetch blocks (``n_fetch`` local steps, each
    starting with a fetch) it has started. Before a fetch a worker waits while
    its clock is more than ``s`` ahead of the slowest live, active worker's,
    then its clock advances and it reads the parameters: the fastest worker
    is at most ``s`` blocks ahead of the slowest (``s = 0`` is bulk
    synchronous), and it reads parameters holding every block the others
    started up to ``s`` blocks before. The wait polls the clocks on the ``ps``
    every millisecond. Active: inside a round (an idle worker, one the chief
    has no round for, holds no one back, and a worker starting a round joins
    at no less than the slowest active worker's clock). Live: it wrote its
    heartbeat (at each fetch and while waiting) within ``lost_after`` seconds,
    so a killed worker leaves the bound. A wait of more than
    ``strategy.deadline`` seconds fails the round, and ``fit`` raises
    ``ClusterTimeoutError`` naming the workers waited for. Each accepted wait
    adds the worker's lead (its clock minus the slowest's, ``0..s``) to a
    histogram on the ``ps`` (``strategy.stats.clock_leads``).
    """

    def __init__(self, strategy):
        self.s = strategy.max_staleness
        self.deadline = float(strategy.deadline)
        self.lost_after = max(1.0, min(10.0, self.deadline / 6))
        n = strategy.num_workers
        with strategy.scope():
            self.clocks = tf.Variable(tf.zeros([n], tf.int64), trainable=False, name="ssp_clocks")
            with strategy.extended.colocate_vars_with(self.clocks):
                self.active = tf.Variable(tf.zeros([n], tf.int64), trainable=False)
                self.heartbeat = tf.Variable(tf.zeros([n], tf.float64), trainable=False)
                self.leads = tf.Variable(tf.zeros([self.s + 1], tf.int64), trainable=False)

    @staticmethod
    def _set(variable, worker, value):
        index = tf.reshape(tf.cast(worker, tf.int64), [1])
        return variable.scatter_update(tf.IndexedSlices(tf.reshape(value, [1]), index))

    def _beat(self, worker):
        return self._set(self.heartbeat, worker, tf.timestamp())

    def _live(self):
        return tf.logical_and(
            tf.timestamp() - self.heartbeat.read_value() < self.lost_after,
            self.active.read_value() > 0,
        )

    def _state(self, worker):
        """(this worker's lead over the slowest live active worker, live mask, clocks)."""
        live = self._live()
        clocks = self.clocks.read_value()
        mine = tf.gather(clocks, worker)
        slowest = tf.reduce_min(tf.where(live, clocks, tf.fill(tf.shape(clocks), mine)))
        return mine - slowest, live, clocks

    @graph_code
    def start(self, worker):
        """The worker enters a round: alive, active, its clock raised to the slowest other's."""
        with tf.control_dependencies([self._beat(worker)]):
            clocks = self.clocks.read_value()
            others = tf.logical_and(
                self._live(), tf.range(tf.size(clocks, out_type=tf.int64)) != worker
            )
            slowest = tf.reduce_min(
                tf.where(others, clocks, tf.fill(tf.shape(clocks), clocks.dtype.max))
            )
            mine = tf.gather(clocks, worker)
            joined = tf.where(tf.reduce_any(others), tf.maximum(mine, slowest), mine)
            with tf.control_dependencies([self._set(self.clocks, worker, joined)]):
                return tf.identity(
                    self._set(self.active, worker, tf.constant(1, tf.int64)).read_value()[0]
                )

    @graph_code
    def before_fetch(self, worker):
        """Waits while ``worker`` is more than ``s`` blocks ahead, then advances its clock."""
        begin = tf.timestamp()

        # The lead the loop stopped on is the one checked and counted: a
        # second reading could find a worker alive again that the loop's
        # reading had found lost, and fail a wait that ended in time.
        def waiting(lead):
            return tf.logical_and(lead > self.s, tf.timestamp() - begin < self.deadline)

        def poll(_):
            with tf.control_dependencies([self._beat(worker)]):
                slept = _sleep(1000)
            with tf.control_dependencies(slept):
                return (self._state(worker)[0],)

        (lead,) = tf.while_loop(waiting, poll, (self._state(worker)[0],))
        with tf.control_dependencies([lead]):
            _, live, clocks = self._state(worker)  # for the message only
        behind = tf.where(tf.logical_and(live, clocks < tf.gather(clocks, worker) - self.s))
        check = tf.debugging.Assert(
            lead <= self.s,
            [
                f"{_SSP_TIMEOUT} worker",
                worker,
                f"waited {self.deadline:g}s (the deadline) for worker(s)",
                tf.reshape(behind, [-1]),
                f"to come within max_staleness={self.s} fetch blocks; they are alive "
                "but not advancing",
            ],
            summarize=64,
        )
        with tf.control_dependencies([check, self._beat(worker)]):
            counted = self.leads.scatter_add(
                tf.IndexedSlices(tf.ones([1], tf.int64), tf.reshape(lead, [1]))
            )
            ticked = self.clocks.scatter_add(
                tf.IndexedSlices(tf.ones([1], tf.int64), tf.reshape(tf.cast(worker, tf.int64), [1]))
            )
        with tf.control_dependencies([counted.read_value(), ticked.read_value()]):
            return tf.identity(lead)

    @graph_code
    def stop(self, worker):
        """The worker leaves its round (an idle worker holds no one back)."""
        return tf.identity(self._set(self.active, worker, tf.constant(0, tf.int64)).read_value()[0])

    def lead_histogram(self):
        """How many fetches started at each lead ``0..s`` (read on the chief)."""
        return self.leads.numpy()


def _sleep(microseconds):
    """Sleeps on the current device inside a graph (``tf.data``'s sleep transformation)."""
    ds = tf.data.experimental.to_variant(tf.data.Dataset.from_tensors(tf.constant(0, tf.int64)))
    slept = tf.raw_ops.SleepDataset(
        input_dataset=ds,
        sleep_microseconds=tf.constant(microseconds, tf.int64),
        output_types=[tf.int64],
        output_shapes=[[]],
    )
    return tf.raw_ops.DatasetToSingleElement(
        dataset=slept, output_types=[tf.int64], output_shapes=[[]]
    )


def explain_timeout(error):
    """A round that failed its SSP wait, as ``ClusterTimeoutError``; other errors unchanged."""
    message = getattr(error, "message", str(error))
    if _SSP_TIMEOUT not in message:
        return error
    start = message.index(_SSP_TIMEOUT)
    text = message[start:].split("\n")[0].replace("] [", " ").replace("[", "").replace("]", "")
    return ClusterTimeoutError(text)
