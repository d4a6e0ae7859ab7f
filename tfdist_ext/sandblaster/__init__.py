"""Sandblaster L-BFGS: distributed full-batch optimisation (Dean et al., 2012).

``SandblasterStrategy`` runs ``model.fit`` of a model compiled with
``tfdist_ext.optimizers.LBFGS``; ``minimize`` is the same machinery for a
loss function and variables outside Keras.

Example:
  >>> import keras, tfdist_ext
  >>> with tfdist_ext.LocalCluster(num_workers=2, num_ps=2) as cluster:  # doctest: +SKIP
  ...     strategy = tfdist_ext.SandblasterStrategy(cluster.resolver)
  ...     with strategy.scope():
  ...         model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
  ...         model.compile(optimizer=tfdist_ext.optimizers.LBFGS(),
  ...                       loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  ...     model.fit(x, y, epochs=50)
"""

from tfdist_ext.optimizers._lbfgs import LBFGS
from tfdist_ext.sandblaster._engine import PassReport
from tfdist_ext.sandblaster._lbfgs import OptimizeResult
from tfdist_ext.sandblaster._minimize import minimize
from tfdist_ext.sandblaster._strategy import SandblasterStrategy

__all__ = ["LBFGS", "OptimizeResult", "PassReport", "SandblasterStrategy", "minimize"]
