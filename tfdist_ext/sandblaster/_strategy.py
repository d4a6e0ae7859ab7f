"""SandblasterStrategy: Sandblaster L-BFGS (Dean et al., 2012) for Keras 3 ``model.fit``."""

import weakref

import numpy as np
import tensorflow as tf

from tfdist_ext import _integration
from tfdist_ext._ps_strategy import ParameterServerBase
from tfdist_ext._ps_strategy import components
from tfdist_ext._ps_strategy import explain_made_before_connecting
from tfdist_ext._ps_strategy import positive_int
from tfdist_ext.sandblaster import _fit
from tfdist_ext.sandblaster._engine import Evaluator
from tfdist_ext.sandblaster._vectors import ShardedVectors


class SandblasterStrategy(ParameterServerBase):
    """Sandblaster L-BFGS (Dean et al., 2012) as a ``tf.distribute`` strategy.

    A coordinator (this ``chief`` process) runs L-BFGS; the parameters and the
    L-BFGS state live on the ``ps`` tasks, which do the vector algebra on the
    shard that owns each piece, so only scalars reach the coordinator. Each
    function evaluation is one pass over the whole training set, in slices
    that free workers take in turn, with backup copies of the last slices on
    idle workers. Build and compile under ``scope()`` with
    ``tfdist_ext.optimizers.LBFGS``, then ``fit`` on in-memory data: each
    ``fit`` step is one L-BFGS iteration. The guide
    (``docs/api/guides/sandblaster.rst``) covers the logs, faults and what
    ``fit`` refuses.

    Args:
      cluster_resolver: a cluster with ``chief`` (this process), ``worker``
        and ``ps`` jobs, e.g. ``LocalCluster(...).resolver``.
      slices_per_worker: slices per worker in each pass.
      backup_tasks: run backup copies of unfinished slices on idle workers.
      max_copies: copies of one slice that may run at once (with backups).
      min_shard_bytes: variables at least this large are split across ``ps`` tasks.
      deadline: seconds a pass may go without any slice finishing before it fails.

    Example:
      >>> with tfdist_ext.LocalCluster(num_workers=2, num_ps=1) as cluster:  # doctest: +SKIP
      ...     strategy = tfdist_ext.SandblasterStrategy(cluster.resolver)
      ...     with strategy.scope():
      ...         model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(
      ...             10, kernel_regularizer=keras.regularizers.L2(1e-3))])
      ...         model.compile(optimizer=tfdist_ext.optimizers.LBFGS(memory=10),
      ...                       loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      ...                       metrics=["accuracy"])
      ...     history = model.fit(x, y, epochs=100)
      ...     print(model.optimizer.result.message)
    """

    _owner = "SandblasterStrategy"

    def __init__(
        self,
        cluster_resolver: tf.distribute.cluster_resolver.ClusterResolver,
        *,
        slices_per_worker: int = 10,
        backup_tasks: bool = True,
        max_copies: int = 2,
        min_shard_bytes: int = 256 << 10,
        deadline: float = 60.0,
    ):
        self.slices_per_worker = positive_int(self._owner, "slices_per_worker", slices_per_worker)
        if not isinstance(backup_tasks, bool):
            raise ValueError(
                f"SandblasterStrategy: backup_tasks must be True or False, got {backup_tasks!r}"
            )
        self.backup_tasks = backup_tasks
        self.max_copies = positive_int(self._owner, "max_copies", max_copies, 2)
        super().__init__(cluster_resolver, min_shard_bytes=min_shard_bytes, deadline=deadline)
        self.passes = []  # PassReport of every pass, in order
        self._evaluators = {}
        _integration.install_trainer_hooks()

    def _tfdist_fit(self, model, keras_fit, args, kwargs):
        self._check_open()
        try:
            return _fit.sandblaster_fit(model, self, keras_fit, args, kwargs)
        except tf.errors.OpError as e:
            explained = explain_made_before_connecting(self._owner, e)
            if explained is e:
                raise
            raise explained from None

    def _tfdist_train_on_batch(self, model, keras_method, args, kwargs):
        raise ValueError(
            "SandblasterStrategy: train_on_batch is not supported: L-BFGS minimises the "
            "loss over the whole training set, not one batch at a time. Call fit (each "
            "step is one L-BFGS iteration over all the data you pass)."
        )

    def _stop_runtime(self):
        """Stops every pass's worker threads and drops the data sent to the workers."""
        for _, _, evaluator in self._evaluators.values():
            evaluator.close()
        self._evaluators.clear()

    def _evaluator(self, key, owner, variables, loss_fn, data, memory):
        """The pass machinery for ``key``: built once per (variables, data arrays, memory).

        Building it sends the data to every worker and creates the L-BFGS
        vectors on the ``ps`` tasks; later runs on the same arrays reuse it.
        """
        self._check_open()
        signature = (
            tuple(id(v) for v in variables),
            memory,
            tuple((id(a), np.shape(a)) for a in tf.nest.flatten(data)),
        )
        entry = self._evaluators.get(key)
        if entry is not None and entry[0]() is owner and entry[1] == signature:
            return entry[2]
        if entry is not None:
            entry[2].close()
        parameters = [components(v) for v in variables]
        for v, group in zip(variables, parameters):
            for piece in group:
                if "/job:ps/" not in piece.device:
                    raise ValueError(
                        f"SandblasterStrategy: variable {getattr(v, 'path', v.name)!r} is on "
                        f"{piece.device or 'this process'}, not on a 'ps' task; create it "
                        "under `strategy.scope()`"
                    )
        blocks = [piece for group in parameters for piece in group]
        vectors = ShardedVectors(blocks, memory, self.num_workers)
        evaluator = Evaluator(self, parameters, vectors, loss_fn, data)
        self._evaluators[key] = (weakref.ref(owner), signature, evaluator)
        return evaluator

    def get_config(self):
        """The strategy's knobs (not the cluster) as a dict (see :meth:`from_config`)."""
        return {
            "slices_per_worker": self.slices_per_worker,
            "backup_tasks": self.backup_tasks,
            "max_copies": self.max_copies,
            "min_shard_bytes": self.min_shard_bytes,
            "deadline": self.deadline,
        }
