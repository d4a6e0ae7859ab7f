"""Downpour's per-worker data (internal).

The user's dataset lives on the chief. ``fit`` ships its graph to every
worker, where it is rebuilt and sharded (``dataset.shard(num_workers, i)``,
repeated), so each replica reads its own part without the chief in the way.
"""

import tensorflow as tf

from tfdist_ext import _integration


class SourceDataset:
    """What ``DownpourStrategy.experimental_distribute_dataset`` returns.

    Iterating it gives an ordinary ``tf.data`` iterator on the chief (Keras
    ``evaluate``/``predict`` use it as is); the strategy's runtime remembers
    which dataset each iterator came from so that ``fit`` can build
    per-worker shards of it.
    """

    def __init__(self, dataset, runtime):
        self.dataset = dataset
        self._runtime = runtime

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
        self._runtime.remember_source(iterator, self.dataset)
        return iterator

    @property
    def element_spec(self):
        return self.dataset.element_spec


def per_worker_iterator(strategy, dataset):
    """An iterator on every worker over that worker's shard of ``dataset``."""
    num_workers = strategy.num_workers
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    # The dataset lives on the chief; ship its graph, not its handle, and
    # rebuild it on each worker (as tf.data's own `replicate` does).
    graph_def = _integration.serialized_dataset_graph(dataset)
    element_spec = dataset.element_spec

    # graph_def is an argument, not a captured constant: grappler would fold
    # a constant DatasetFromGraph into a variant that cannot cross processes.
    @tf.function
    def make_iterator(index, graph_def):
        rebuilt = _integration.RemoteDataset(graph_def, "", element_spec)
        shard = rebuilt.shard(num_workers, index).repeat().with_options(options)
        return iter(shard)

    spec = _integration.get_iterator_spec_from_dataset(strategy, dataset)
    workers = _integration.coordinator_workers(strategy.coordinator)
    return _integration.PerWorkerDistributedIterator(
        tuple(
            _integration.per_worker_resource(
                worker, make_iterator, (tf.constant(index, tf.int64), tf.constant(graph_def)), spec
            )
            for index, worker in enumerate(workers)
        )
    )


def per_worker_index(strategy):
    """Each worker's task index, as a value resolved on that worker."""

    @tf.function
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
