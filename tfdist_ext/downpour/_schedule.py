"""How ``model.fit`` runs Downpour: the chief's side (internal).

Keras 3 has no parameter-server path in ``fit``; ``tfdist_ext._integration``
routes the ``fit`` of a model whose strategy is a ``DownpourStrategy`` to
:func:`downpour_fit`, which sets ``model.train_function`` to a
:class:`TrainFunction`, and routes ``_get_metrics_result_or_logs`` (which
Keras calls right after each epoch's last batch) to :func:`epoch_logs`, which
waits for the epoch's rounds. It then runs Keras's own ``fit`` loop
unchanged (progress bar, callbacks, validation, checkpoints). For every other
model ``fit`` is Keras's, untouched.

Each call of the train function counts steps; every :func:`dispatch_steps`
steps it schedules one round (``_round.py``) on whichever worker is free
(``ClusterCoordinator``). As Keras's ``steps_per_execution`` does, one
dispatch runs many steps: the coordinator's per-call cost (about 20 ms on
loopback, several times a step's compute) is paid once per round, not once
per step. At each epoch's end, with no round in flight,
``optimizer.iterations`` is set to the exact number of training steps whose
gradients the server applied (concurrent pushes may overlap in Keras's own
read-then-write increment during the epoch).
"""

import contextlib
import time
import warnings

import keras
import tensorflow as tf

from tfdist_ext import _integration
from tfdist_ext.cluster._local import ClusterError
from tfdist_ext.cluster._local import ClusterTimeoutError
from tfdist_ext.cluster._local import ping
from tfdist_ext.cluster._ps_strategy import check_compiled_for_workers

# Steps per scheduled round when the model's ``steps_per_execution`` is 1.
DISPATCH_STEPS = 50


def downpour_fit(model, strategy, runtime, keras_fit, args, kwargs):
    """``model.fit(*args, **kwargs)`` under ``strategy`` (Keras's loop, Downpour's step)."""
    _check_custom_train_step(model, strategy)
    check_compiled_for_workers(model, type(strategy).__name__)
    _adopt_optimizer(model, strategy)
    train_function = TrainFunction(model, strategy, runtime, _epoch_steps(args, kwargs))
    model.train_function = train_function
    try:
        return keras_fit(model, *args, **kwargs)
    finally:
        model.train_function = None
        train_function.close()


def epoch_logs(model, logs, keras_epoch_logs):
    """Keras calls this right after an epoch's last batch (also when the loop
    broke early), and at the end of ``evaluate``: after training steps it is
    the epoch's end, so wait for every round and report exact values;
    otherwise it is evaluate's and stays Keras's."""
    train_function = model.train_function
    if isinstance(train_function, TrainFunction) and train_function.steps_since_finish:
        return train_function.finish_epoch()
    return keras_epoch_logs(model, logs)


def dispatch_steps(model, strategy, epoch_steps=None):
    """Local steps per scheduled round (one coordinator dispatch).

    The model's ``steps_per_execution`` when it is above 1; otherwise about
    ``DISPATCH_STEPS``, but no more than an epoch's share of one worker (so
    that every worker gets rounds of a short epoch). Always a multiple of
    ``strategy.round_steps``, so rounds end where a fetch and a push are due.
    """
    steps = model.steps_per_execution
    if steps == 1:
        steps = DISPATCH_STEPS
        if epoch_steps:
            steps = min(steps, -(-epoch_steps // strategy.num_workers))
    lcm = strategy.round_steps
    return max(1, -(-steps // lcm)) * lcm


def _epoch_steps(args, kwargs):
    """Batches per epoch of a ``fit(*args, **kwargs)`` call, if known before it starts."""
    if kwargs.get("steps_per_epoch"):
        return int(kwargs["steps_per_epoch"])
    x = kwargs.get("x", args[0] if args else None)
    if isinstance(x, tf.data.Dataset):
        cardinality = int(x.cardinality())
        return cardinality if cardinality > 0 else None
    if hasattr(x, "shape") and len(x.shape):
        batch_size = kwargs.get("batch_size") or 32
        return -(-int(x.shape[0]) // batch_size)
    return None


def _check_custom_train_step(model, strategy):
    """A user's ``train_step`` runs on the workers reading the server's variables."""
    owner = _integration.overridden_step(model, "train_step")
    if owner is not None and strategy.n_fetch != 1:
        raise ValueError(
            f"DownpourStrategy: {owner.__name__} overrides train_step, which runs on the "
            "workers reading the model's variables where they live, on the parameter "
            f"servers, at every step; it cannot keep a local copy for n_fetch="
            f"{strategy.n_fetch} steps. Set n_fetch=1 (n_push may stay "
            f"{strategy.n_push}), or put the custom loss in a compute_loss override "
            "instead of train_step (Downpour's own step then keeps the local copy)."
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


class TrainFunction:
    """``model.train_function`` under Downpour: schedules rounds, returns logs."""

    def __init__(self, model, strategy, runtime, epoch_steps=None):
        self.model = model
        self.strategy = strategy
        self.runtime = runtime
        self.epoch_steps = epoch_steps
        self.round_size = dispatch_steps(model, strategy, epoch_steps)
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
        self._iterations_base = None
        self._applied_steps = 0
        self._ps_addresses = strategy.cluster_resolver.cluster_spec().as_dict()["ps"]
        self._last_ps_check = time.monotonic()

    # -- Keras-facing --------------------------------------------------------

    def __call__(self, iterator):
        with self._explained_errors():
            return self._call(iterator)

    def _call(self, iterator):
        if self.steps_since_finish == 0:
            # An epoch starts: what workers kept from the last one (prefetched
            # parameters, replicas) holds only if no one changed the weights
            # since (a callback, set_weights or a load between fit calls).
            self.runtime.check_weights(self.model)
        dataset = self.runtime.source_of(iterator)
        self._current = self.runtime.per_worker_iterator(dataset)
        for _ in range(self.model.steps_per_execution):
            self.steps_since_finish += 1
            if self._ahead:
                self._ahead -= 1  # already scheduled by an early round
                continue
            self._scheduled_steps += 1
            if self._scheduled_steps <= self.strategy.warmstart_steps:
                # Warmstart: one replica at a time, in order, each from the
                # server's latest parameters (none prefetched).
                self._schedule(1, prefetch=False)
                self._wait(lambda: not self._inflight)
            else:
                self._pending += 1
                if self._pending == self.round_size:
                    self._schedule(self._pending)
        self._collect()
        if self.strategy.stats.steps == self._epoch_base["steps"]:
            # Nothing of this epoch has finished yet: wait for its first
            # round so that callbacks never see the reset metrics' zeros,
            # with every other worker given a round of its own meanwhile.
            if self._pending and not self._inflight:
                self._schedule_ahead()
            self._occupy_idle_workers()
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
            self._count_iterations()
            self._read_logs()
            self.runtime.remember_weights(self.model)
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

    def _schedule_ahead(self):
        """Schedules the epoch's first round now, a ``round_steps`` multiple
        long (short, so that callbacks soon see this epoch's metrics; the
        rounds after it are ``round_size`` long); its later steps are counted
        off as Keras calls for them."""
        lcm = self.strategy.round_steps
        size = -(-self._pending // lcm) * lcm
        if self.epoch_steps is not None:
            left = self.epoch_steps - self.steps_since_finish + self._pending
            size = max(self._pending, min(size, left))
        self._ahead = size - self._pending
        self._scheduled_steps += self._ahead
        self._schedule(size)

    def _occupy_idle_workers(self):
        """Schedules rounds of the epoch's later steps ahead, up to one a worker.

        While the chief waits for an epoch's first round, Keras asks for no
        more steps, so without this the other workers would idle through
        that whole round (with ``steps_per_execution`` rounds, a third of
        a 2-worker ``fit`` of four rounds). Only steps the epoch is known to
        have (``steps_per_epoch`` or a sized dataset) are scheduled; they are
        counted off as Keras asks for them.
        """
        if self.epoch_steps is None or self._pending:
            return
        if self._scheduled_steps < self.strategy.warmstart_steps:
            return
        while len(self._inflight) < self.strategy.num_workers:
            left = self.epoch_steps - self.steps_since_finish - self._ahead
            size = min(self.round_size, left)
            if size <= 0:
                return
            self._ahead += size
            self._scheduled_steps += size
            self._schedule(size)

    def _schedule(self, steps, prefetch=True):
        self._pending = 0
        if steps <= 0:
            return
        if self._round is None:
            self._round = self.runtime.round_for(self.model)
            self._iterations_base = int(self.model.optimizer.iterations.numpy())
        # Keep the coordinator's queue short so that every wait is ours, with
        # a deadline, rather than a blocking schedule() call.
        limit = 2 * self.strategy.num_workers
        self._wait(lambda: len(self._inflight) < limit)
        remote = self.coordinator.schedule(
            self._round,
            args=(self._current, self.runtime.worker_index(), tf.constant(steps, tf.int32)),
            kwargs={"prefetch": tf.constant(prefetch)},
        )
        self._inflight.append((remote, steps))

    def _count_iterations(self):
        """``optimizer.iterations``: the training steps the server applied in this ``fit``."""
        if self._iterations_base is not None:
            self.model.optimizer.iterations.assign(self._iterations_base + self._applied_steps)

    def _collect(self):
        still = []
        for remote, steps in self._inflight:
            status = _integration.remote_value_status(remote)
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
                    self._applied_steps += steps
                    continue
                self._record(out)
            elif status == _integration.RemoteValueStatus.ABORTED:
                remote.fetch()  # raises the round's error
            else:
                still.append((remote, steps))
        self._inflight = still
        if self.coordinator.done():  # raises a failed round's error, if any
            pass

    def _record(self, out):
        stats = self.strategy.stats
        rejected = int(out["rejected"])
        self._applied_steps += int(out["applied_steps"])
        stats.record(
            steps=int(out["steps"]),
            pushes=int(out["pushes"]),
            fetches=int(out["fetches"]),
            rejected=rejected,
            push_bytes=int(out["push_bytes"]),
            fetch_bytes=int(out["fetch_bytes"]),
            staleness=out["staleness"],
            worker=int(out["worker"]),
            prefetched=int(out.get("prefetched", 0)),
        )
        # Under loss scaling an overflowing push is routine: the server
        # skips it and halves the scale, silently, as Keras does.
        if rejected and not isinstance(self.model.optimizer, keras.optimizers.LossScaleOptimizer):
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

    # -- logs ----------------------------------------------------------------

    def _read_logs(self):
        logs = {}
        for key, value in self.model.get_metrics_result().items():
            try:
                logs[key] = float(value)
            except (TypeError, ValueError):
                logs[key] = value
        summary = self.strategy.stats.summary(since=self._epoch_base)
        for key in (
            "staleness_mean",
            "staleness_max",
            "pushes",
            "rejected_pushes",
            "push_bytes_per_step",
            "fetch_bytes_per_step",
        ):
            logs[key] = float(summary[key])
        self._logs = logs
        self._last_read = time.monotonic()
