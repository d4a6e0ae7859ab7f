"""Downpour SGD and elastic averaging: asynchronous parameter-server training for ``model.fit``.

Example:
  >>> import keras, tfdist_ext
  >>> with tfdist_ext.LocalCluster(num_workers=2, num_ps=1) as cluster:  # doctest: +SKIP
  ...     strategy = tfdist_ext.DownpourStrategy(cluster.resolver, n_fetch=5, n_push=5)
  ...     with strategy.scope():
  ...         model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
  ...         model.compile(optimizer=keras.optimizers.Adagrad(0.05),
  ...                       loss="sparse_categorical_crossentropy")
  ...     model.fit(train_ds, epochs=2, steps_per_epoch=100)
"""

from tfdist_ext.downpour._elastic import ElasticAveragingStrategy
from tfdist_ext.downpour._staleness import DelayCompensation
from tfdist_ext.downpour._staleness import StalenessAwareLR
from tfdist_ext.downpour._staleness import StalenessPolicy
from tfdist_ext.downpour._stats import DownpourStats
from tfdist_ext.downpour._strategy import DownpourStrategy

__all__ = [
    "DelayCompensation",
    "DownpourStats",
    "DownpourStrategy",
    "ElasticAveragingStrategy",
    "StalenessAwareLR",
    "StalenessPolicy",
]
