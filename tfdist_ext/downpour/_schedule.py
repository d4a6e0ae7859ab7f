"""How ``model.fit`` runs Downpour: the chief's side (internal).

Keras 3 has no parameter-server path in ``fit``; ``tfdist_ext._integration``
routes the ``fit`` of a model whose strategy is a ``DownpourStrategy`` to
:func:`downpour_fit`, which sets ``model.train_function`` to a
:class:`TrainFunction`, and routes ``_get_metrics_result_or_logs`` (which
Keras calls right after each epoch's last batch) to :func:`epoch_logs`, which
waits for the epoch's rounds. It then runs Keras's own ``fit`` loop
unchanged (progress bar, callbacks, validation, checkpoints). For every other
model ``fit`` is Keras's, untouched.

Each call of the train function reads the batches Keras's own function
would from Keras's iterator on the chief and schedules them in rounds
(``_round.py``) of at most :func:`dispatch_steps` batches on whichever worker
is free (``ClusterCoordinator``), spread so that no worker idles while
another holds many. As Keras's ``steps_per_execution`` does,
one dispatch runs many steps: the coordinator's per-call cost is paid once
per round, not once per step. At each epoch's end, with no round in flight,
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
from tfdist_ext._ps_strategy import check_compiled_for_workers
from tfdist_ext.cluster._local import ClusterError
from tfdist_ext.cluster._local import ClusterTimeoutError
from tfdist_ext.cluster._local import ping
from tfdist_ext.downpour import _round

# Steps per scheduled round when the model's ``steps_per_execution`` is 1.
DISPATCH_STEPS = 50


def downpour_fit(model, strategy, runtime, keras_fit, args, kwargs):
    """``model.fit(*args, **kwargs)`` under ``strategy`` (Keras's loop, Downpour's step)."""
    _check_custom_train_step(model, strategy)
    check_compiled_for_workers(model, type(strategy).__name__)
    _adopt_optimizer(model, strategy)
    train_function = TrainFunction(model, strategy, runtime)
    model.train_function = train_function
    try:
        # A lost ps fails whatever reads it first (a round, or a callback
        # saving the weights): each failure is explained the same way.
        with train_function.explained_errors():
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


def dispatch_steps(model, strategy):
    """Local steps per scheduled round (one coordinator dispatch) at most.

    The model's ``steps_per_execution`` when it is above 1, otherwise
    ``DISPATCH_STEPS``; always a multiple of ``strategy.round_steps``, so
    that rounds end where a fetch and a push are due.
    """
    steps = model.steps_per_execution
    if steps == 1:
        steps = DISPATCH_STEPS
    lcm = strategy.round_steps
    return max(1, -(-steps // lcm)) * lcm


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
    """``model.train_function`` under Downpour: schedules rounds, returns logs.

    Each call reads the batches Keras's own function would (up to
    ``steps_per_execution``, fewer at the end of the data) from Keras's
    iterator on the chief, and buffers them. Each idle worker gets a share
    of the buffer (whole ``round_steps``, :func:`dispatch_steps` at most);
    while all are busy, full rounds queue for the next free one; at an
    epoch's end the rest is spread over all workers. Keras's data adapters
    and epoch iterator thus decide what is trained, in which order and how
    many steps an epoch has.
    """

    def __init__(self, model, strategy, runtime):
        self.model = model
        self.strategy = strategy
        self.runtime = runtime
        self.round_size = dispatch_steps(model, strategy)
        self.coordinator = strategy.coordinator
        self._round = None
        self._buffer = []  # Keras's batches not yet in a round
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
        if self.steps_since_finish == 0:
            # An epoch starts: what workers kept from the last one (prefetched
            # parameters, replicas) holds only if no one changed the weights
            # since (a callback, set_weights or a load between fit calls).
            self.runtime.check_weights(self.model)
        for batch in self._read(iterator):
            self.steps_since_finish += 1
            self._scheduled_steps += 1
            self._buffer.append(batch)
            if self._scheduled_steps <= self.strategy.warmstart_steps:
                # Warmstart: one replica at a time, in order, each from the
                # server's latest parameters (none prefetched).
                self._schedule(1, prefetch=False)
                self._wait(lambda: not self._inflight)
        self._collect()  # which workers are idle
        self._schedule_due()
        if self.strategy.stats.steps == self._epoch_base["steps"]:
            # Nothing of this epoch has finished yet: wait for its first
            # round so that callbacks never see the reset metrics' zeros.
            if self._buffer and not self._inflight:
                self._schedule(len(self._buffer))
            self._wait(lambda: self.strategy.stats.steps > self._epoch_base["steps"])
            self._read_logs()
        elif time.monotonic() - self._last_read > 0.5:
            self._read_logs()
        return self._logs

    def _read(self, iterator):
        """The batches one call of Keras's own train function would read.

        Keras's function runs ``steps_per_execution`` steps, fewer where the
        data end; with none left it raises, and Keras ends the epoch.
        """
        batches = []
        for _ in range(self.model.steps_per_execution):
            try:
                batches.append(next(iterator))
            except (StopIteration, tf.errors.OutOfRangeError):
                if not batches:
                    raise
                break
        return batches

    def finish_epoch(self):
        """Spreads the buffered steps over the workers, waits for all rounds;
        exact epoch logs."""
        if self._buffer:
            self._spread(len(self._buffer), self.strategy.num_workers)
        self._wait(lambda: not self._inflight)
        self._count_iterations()
        self._read_logs()
        self.runtime.remember_weights(self.model)
        self.steps_since_finish = 0
        self._epoch_base = self.strategy.stats.snapshot()
        return dict(self._logs)

    def close(self):
        self._buffer = []
        try:
            self._wait(lambda: not self._inflight)
        except Exception:  # noqa: BLE001 - fit is already raising its own error
            pass

    # -- scheduling ----------------------------------------------------------

    def _schedule_due(self):
        """Gives each idle worker a share of the buffer (whole ``round_steps``,
        a full round at most); full rounds queue while every worker is busy."""
        lcm = self.strategy.round_steps
        while True:
            idle = self.strategy.num_workers - len(self._inflight)
            ready = len(self._buffer) // lcm * lcm
            if idle > 0 and ready:
                self._spread(min(ready, idle * self.round_size), idle)
            elif len(self._buffer) >= self.round_size:
                self._schedule(self.round_size)
            else:
                return

    def _spread(self, steps, parts):
        """Sends the first ``steps`` buffered batches as up to ``parts`` rounds
        of whole ``round_steps`` (the last takes the rest): the coordinator
        gives each to the next free worker, so that none waits while another
        runs the steps of all."""
        lcm = self.strategy.round_steps
        parts = max(1, min(parts, steps // lcm))
        share = -(-steps // parts)
        share = -(-share // lcm) * lcm
        while steps > 0:
            size = min(share, steps)
            self._schedule(size)
            steps -= size

    def _schedule(self, steps, prefetch=True):
        """Sends the first ``steps`` buffered batches to a worker as one round."""
        batches, self._buffer = self._buffer[:steps], self._buffer[steps:]
        first = self._round is None
        if first:
            self._round = self.runtime.round_for(self.model)
            self._iterations_base = int(self.model.optimizer.iterations.numpy())
        # Keep the coordinator's queue short so that every wait is ours, with
        # a deadline, rather than a blocking schedule() call.
        limit = 2 * self.strategy.num_workers
        self._wait(lambda: len(self._inflight) < limit)
        args = (
            _round.round_input(batches),
            self.runtime.worker_index(),
            tf.constant(steps, tf.int32),
        )
        kwargs = {"prefetch": tf.constant(prefetch)}
        if first:
            self._trace_for_any_round_length(args, kwargs)
        remote = self.coordinator.schedule(self._round, args=args, kwargs=kwargs)
        self._inflight.append((remote, steps))

    def _trace_for_any_round_length(self, args, kwargs):
        """Traces the round once with the batch axis unknown: the coordinator
        then finds that trace for every round length and batch size."""
        specs = _integration.scheduled_arg_specs((args, kwargs))
        with self.strategy.scope():  # where the coordinator traces too
            self._round.get_concrete_function(
                _round.any_round_length(specs[0][0]), *specs[0][1:], **specs[1]
            )

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
    def explained_errors(self):
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
                    f"{type(self.strategy).__name__}: no round finished within {3 * deadline:.0f}s "
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
                    f"{type(self.strategy).__name__}: parameter server ps:{index} at {address} is "
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
