"""Downpour's runtime state, with one owner (internal).

A ``DownpourStrategy`` creates one :class:`DownpourRuntime`; everything
Downpour keeps between ``fit`` calls lives there and is changed only through
its methods: each worker's index, the server's update counter, the traced round functions and
the ``model_devices`` partition plans.
"""

import weakref

import tensorflow as tf

from tfdist_ext import _integration
from tfdist_ext._ps_strategy import components
from tfdist_ext.downpour import _round


class DownpourRuntime:
    """The caches and server-side counter of one ``DownpourStrategy``."""

    def __init__(self, strategy):
        self._strategy = strategy
        self._rounds = {}  # key -> (weakref(model), round function)
        self._plans = {}  # id(model) -> (weakref(model), plan)
        self._worker_index = None
        self._version = None
        self._generation = None
        self._weights_left = {}  # id(model) -> _WeightsLeft
        self.plan = None  # the latest model_devices plan

    def worker_index(self):
        """Each worker's task index, resolved on that worker."""
        if self._worker_index is None:
            self._worker_index = _per_worker_index(self._strategy)
        return self._worker_index

    # -- rounds ----------------------------------------------------------------

    def server_version(self):
        """The server's update counter (a variable on a ``ps`` task)."""
        if self._version is None:
            with self._strategy.scope():
                self._version = tf.Variable(
                    tf.constant(0, tf.int64), trainable=False, name="downpour_server_version"
                )
        return self._version

    def fit_generation(self):
        """A counter on a ``ps`` task: the generation of what workers keep between rounds.

        What a worker keeps for its next round (Downpour's prefetched
        parameters, an elastic replica) holds while the generation it was
        written in is current. :meth:`check_weights`, at the start of each
        epoch of ``fit``, advances it unless the server's weights are
        exactly those the model's last epoch left (:meth:`remember_weights`):
        weights set or loaded between epochs or ``fit`` calls (a callback,
        ``set_weights``, a checkpoint) start every worker afresh from the
        server, while epoch after epoch and ``fit`` after ``fit``
        (evaluating between them) continue.
        """
        if self._generation is None:
            with self._strategy.scope():
                self._generation = tf.Variable(
                    tf.constant(0, tf.int64), trainable=False, name="downpour_fit_generation"
                )
        return self._generation

    def check_weights(self, model):
        """An epoch of ``model`` starts: a new generation unless its weights are as left."""
        entry = self._weights_left.get(id(model))
        if entry is None or not entry.covers(model) or not entry.unchanged():
            self.fit_generation().assign_add(1)

    def remember_weights(self, model):
        """Every round of an epoch of ``model`` finished: remembers its weights as they are."""
        self._weights_left = {k: e for k, e in self._weights_left.items() if e.model() is not None}
        entry = self._weights_left.get(id(model))
        new = entry is None or not entry.covers(model)
        if new:
            entry = _WeightsLeft(model)
            self._weights_left[id(model)] = entry
        entry.remember()
        if new:
            # Traced and set up on the ps now, at the end of the first epoch,
            # not at the next one's start, whose time a short fit that
            # follows would otherwise pay.
            entry.unchanged()

    def round_for(self, model):
        """The traced round of ``model``: one per model, optimizer and round knobs
        (``strategy._round_knobs()``: n_fetch, n_push, compression, ...)."""
        strategy = self._strategy
        self._partition(model)
        key = (id(model), id(model.optimizer), *strategy._round_knobs())
        entry = self._rounds.get(key)
        if entry is None or entry[0]() is not model:
            entry = (weakref.ref(model), strategy._build_round(model, self.server_version()))
            self._rounds[key] = entry
        return entry[1]

    def round_functions(self):
        """The traced round functions of live models (for inspection)."""
        return [fn for ref, fn in self._rounds.values() if ref() is not None]

    def clear(self):
        """Drops every per-worker resource and traced round (the strategy is closing)."""
        self._rounds.clear()
        self._worker_index = None
        self._version = None
        self._generation = None
        self._weights_left.clear()

    def _partition(self, model):
        entry = self._plans.get(id(model))
        if entry is not None and entry[0]() is model:
            return
        plan = _round.partition(model, self._strategy)
        if plan is not None:
            self._plans[id(model)] = (weakref.ref(model), plan)
            self.plan = plan


class _WeightsLeft:
    """A copy, on the ``ps`` tasks, of a model's weights as its last epoch left them.

    One copy of each trainable weight (of each piece of a split one), next
    to it; comparing and copying run where the weights live, and only a
    boolean crosses to the chief.
    """

    def __init__(self, model):
        self.model = weakref.ref(model)
        self.weights = list(model.trainable_variables)
        self.pieces = [p for v in self.weights for p in components(v)]
        self.copies = []
        for piece in self.pieces:
            with tf.device(piece.device):
                self.copies.append(tf.Variable(tf.zeros(piece.shape, piece.dtype), trainable=False))
        self._remember = tf.function(self._copy, autograph=False)
        self._unchanged = tf.function(self._compare, autograph=False)

    def covers(self, model):
        """Whether this copy is of ``model`` and its current trainable weights."""
        return self.model() is model and [id(v) for v in model.trainable_variables] == [
            id(v) for v in self.weights
        ]

    def remember(self):
        self._remember()

    def unchanged(self):
        """Whether every weight equals the copy (NaN counts as changed)."""
        return bool(self._unchanged())

    def _copy(self):
        for piece, copy in zip(self.pieces, self.copies):
            with tf.device(piece.device):
                copy.assign(piece.read_value())

    def _compare(self):
        same = []
        for piece, copy in zip(self.pieces, self.copies):
            with tf.device(piece.device):
                same.append(tf.reduce_all(tf.equal(piece.read_value(), copy.read_value())))
        return tf.reduce_all(same)


def _per_worker_index(strategy):
    """Each worker's task index, as a value resolved on that worker."""

    @tf.function(autograph=False)
    def identity(index):
        return tf.identity(index)

    workers = _integration.coordinator_workers(strategy.coordinator)
    return _integration.PerWorkerValues(
        tuple(
            _integration.per_worker_resource(
                worker, identity, (tf.constant(index, tf.int64),), None
            )
            for index, worker in enumerate(workers)
        )
    )
