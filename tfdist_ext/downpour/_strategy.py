"""DownpourStrategy: asynchronous Downpour SGD for Keras 3 ``model.fit``."""

import math

import keras
import tensorflow as tf

from tfdist_ext import _integration
from tfdist_ext import compression as compression_lib
from tfdist_ext._ps_strategy import ParameterServerBase
from tfdist_ext._ps_strategy import explain_made_before_connecting
from tfdist_ext._ps_strategy import positive_int
from tfdist_ext.downpour import _round
from tfdist_ext.downpour import _schedule
from tfdist_ext.downpour import _staleness
from tfdist_ext.downpour._runtime import DownpourRuntime
from tfdist_ext.downpour._stats import DownpourStats


def _positive_int(name, value, low=1):
    return positive_int("DownpourStrategy", name, value, low)


class DownpourStrategy(ParameterServerBase):
    """Downpour SGD (Dean et al., 2012) as a ``tf.distribute`` strategy.

    Model replicas run asynchronously on the ``worker`` tasks; the parameters
    and the optimizer state live on the ``ps`` tasks, sharded. Each replica
    fetches the parameters every ``n_fetch`` steps and pushes the sum of its
    gradients every ``n_push`` steps; the ``ps`` tasks apply the compiled
    optimizer (Adagrad in the paper) to each push. Build and compile under
    ``scope()``, then ``fit``, ``evaluate``, ``predict`` and ``save`` as
    usual; ``fit`` adds ``staleness_mean``/``staleness_max``, ``pushes``,
    ``rejected_pushes`` and bytes per step to the logs. The guide
    (``docs/api/guides/downpour.rst``) covers rounds, ``train_step``
    overrides, mixed precision, faults and pitfalls.

    Args:
      cluster_resolver: a cluster with ``chief`` (this process), ``worker``
        and ``ps`` jobs, e.g. ``LocalCluster(...).resolver``.
      n_fetch: fetch the parameters every ``n_fetch`` steps.
      n_push: push the summed gradient every ``n_push`` steps.
      warmstart_steps: train the first steps on one replica, in order.
      min_shard_bytes: variables at least this large are split across ``ps`` tasks.
      deadline: seconds any wait on another task may take before it fails.
      compression: a ``tfdist_ext.compression`` compressor, or its name.
      model_devices: devices of one worker task over which each replica's
        model is partitioned (``strategy.plan`` after ``fit`` starts).
      staleness_policy: ``None``, ``tfdist_ext.downpour.StalenessAwareLR()``
        or ``tfdist_ext.downpour.DelayCompensation(lam)``.
      max_staleness: ``None`` or ``s >= 0``: stale synchronous parallel.
      background_fetch: ``False`` (the default): each fetch follows the
        replica's own last push, as the steps of ``ParameterServerStrategy``
        read; one worker takes exactly Keras's sequential steps. ``True``:
        fetch the next parameters while a block of steps computes
        (DistBelief's background fetch), so that fetches hide behind
        compute, at one push of staleness (the replica computes without its
        own last push): for links slow next to compute.

    Example:
      >>> with tfdist_ext.LocalCluster(num_workers=2, num_ps=1) as cluster:  # doctest: +SKIP
      ...     strategy = tfdist_ext.DownpourStrategy(cluster.resolver, n_fetch=5, n_push=5)
      ...     with strategy.scope():
      ...         model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
      ...         model.compile(optimizer=keras.optimizers.Adagrad(0.05),
      ...                       loss="sparse_categorical_crossentropy", metrics=["accuracy"])
      ...     model.fit(train_ds, epochs=5, steps_per_epoch=200)
    """

    _owner = "DownpourStrategy"

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
        staleness_policy=None,
        max_staleness=None,
        background_fetch=False,
    ):
        self.n_fetch = n_fetch
        self.background_fetch = background_fetch
        self.n_push = n_push
        self.warmstart_steps = _positive_int("warmstart_steps", warmstart_steps, 0)
        if compression is not None:
            compression = compression_lib.get(compression)
        self.compression = compression
        self.staleness_policy = _staleness.check_policy(staleness_policy)
        self.max_staleness = _staleness.check_max_staleness(max_staleness)
        if compression is not None and isinstance(
            self.staleness_policy, _staleness.DelayCompensation
        ):
            raise ValueError(
                "DownpourStrategy: DelayCompensation cannot be used with compression: "
                "a compressed (error-feedback) push carries gradients computed from "
                "older parameters than the fetch it follows, so the correction "
                "g*g*(w_now - w_fetched) has no single w_fetched. Use StalenessAwareLR "
                "or max_staleness with compression."
            )
        self._bound = None
        if model_devices is not None:
            if (
                isinstance(model_devices, str)
                or not model_devices
                or not all(isinstance(d, str) and d for d in model_devices)
            ):
                raise ValueError(
                    "DownpourStrategy: model_devices must be a non-empty list of "
                    f"device names of one worker task, got {model_devices!r}"
                )
            model_devices = list(model_devices)
        self.model_devices = model_devices
        super().__init__(cluster_resolver, min_shard_bytes=min_shard_bytes, deadline=deadline)
        self.coordinator = _integration.ClosableClusterCoordinator(self)
        self.stats = DownpourStats()
        self._runtime = DownpourRuntime(self)
        _integration.install_trainer_hooks()
        _integration.install_optimizer_hooks()

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
    def background_fetch(self):
        """Whether fetches overlap the steps before them (settable between ``fit`` calls)."""
        return self._background_fetch

    @background_fetch.setter
    def background_fetch(self, value):
        if not isinstance(value, bool):
            raise ValueError(
                f"DownpourStrategy: background_fetch must be True or False, got {value!r}"
            )
        self._background_fetch = value

    @property
    def round_steps(self):
        """``lcm(n_fetch, n_push)``: every scheduled round is a multiple of it long."""
        return math.lcm(self.n_fetch, self.n_push)

    @property
    def plan(self):
        """The ``model_devices`` partition of the latest model ``fit`` (``None`` without)."""
        return self._runtime.plan

    def clock_bound(self):
        """The SSP clocks of ``max_staleness`` on the ``ps`` tasks (internal)."""
        if self._bound is None:
            self._bound = _staleness.clock_bound(self)
        return self._bound

    def _round_knobs(self):
        """What a traced round depends on besides the model and its optimizer."""
        return (self.n_fetch, self.n_push, id(self.compression), self.background_fetch)

    def _build_round(self, model, version):
        """The tf.function a worker runs for one round (``_round.build_round``)."""
        return _round.build_round(model, self, version, self._runtime.fit_generation())

    def _tfdist_fit(self, model, keras_fit, args, kwargs):
        self._check_open()
        try:
            return _schedule.downpour_fit(model, self, self._runtime, keras_fit, args, kwargs)
        except tf.errors.OpError as e:
            explained = _staleness.explain_timeout(e)
            if explained is e:
                explained = explain_made_before_connecting(self._owner, e)
            if explained is e:
                raise
            raise explained from None

    def _tfdist_apply(self, optimizer, grads, variables, keras_apply):
        collector = _round.GradientCollector.active()
        if collector is None:
            return keras_apply(optimizer, grads, variables)
        return collector.add(optimizer, grads, variables)

    def _tfdist_epoch_logs(self, model, logs, keras_epoch_logs):
        logs = _schedule.epoch_logs(model, logs, keras_epoch_logs)
        if self._bound is not None:
            self.stats.clock_leads = self._bound.lead_histogram()
        return logs

    def _stop_runtime(self):
        """Stops the coordinator's threads; drops the per-worker iterators and rounds."""
        self.coordinator.shutdown()
        self._runtime.clear()
        self._bound = None

    def get_config(self):
        """The strategy's knobs (not the cluster) as a dict (see :meth:`from_config`)."""
        return {
            "n_fetch": self.n_fetch,
            "n_push": self.n_push,
            "warmstart_steps": self.warmstart_steps,
            "min_shard_bytes": self.min_shard_bytes,
            "deadline": self.deadline,
            "compression": (
                None
                if self.compression is None
                else keras.saving.serialize_keras_object(self.compression)
            ),
            "model_devices": self.model_devices,
            "staleness_policy": _staleness.policy_to_config(self.staleness_policy),
            "max_staleness": self.max_staleness,
            "background_fetch": self.background_fetch,
        }

    @classmethod
    def _kwargs_from_config(cls, config):
        kwargs = dict(config)
        if kwargs.get("compression") is not None:
            kwargs["compression"] = compression_lib.get(kwargs["compression"])
        if "staleness_policy" in kwargs:
            kwargs["staleness_policy"] = _staleness.policy_from_config(kwargs["staleness_policy"])
        return kwargs
