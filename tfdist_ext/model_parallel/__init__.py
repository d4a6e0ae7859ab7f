"""Model parallelism by device placement: one model's layers over several devices.

DistBelief-style model parallelism for Keras 3 on TensorFlow: a model is cut
into contiguous stages of layers, each stage's variables and computation are
placed on one device with ``tf.device``, and only activations cross stage
boundaries. Optional GPipe micro-batching keeps the devices busy at the same
time; :class:`ColumnParallelDense` splits one large ``Dense`` column-wise.

Public API:

* :class:`ModelParallelStrategy` -- a ``tf.distribute.Strategy``; build and
  compile under ``strategy.scope()``, then ``fit``/``evaluate``/``predict``/
  save/load as usual; ``strategy.plan`` reports the partition.
* :func:`plan_partition` and :func:`apply_plan` -- the placement engine on its
  own, for composing with other strategies (e.g. one Downpour replica spread
  over the devices of one worker).
* :class:`Plan`, :class:`Stage`, :func:`layer_costs`, :func:`placement_report`.
* :class:`ColumnParallelDense` -- a ``Dense`` whose kernel is split into
  column shards on different devices; with a per-device budget
  (``device_budget_bytes``) the planner makes one from a too-large ``Dense``.
* :func:`microbatch_gradients` -- the pipelined loss/gradient computation.
* :func:`stage_gradients` -- puts the gradient ops created inside on their
  forward ops' devices (for custom steps over a placed model).

Example:
  >>> import keras, tfdist_ext
  >>> devices = tfdist_ext.cluster.logical_cpus(2)          # doctest: +SKIP
  >>> from tfdist_ext.model_parallel import ModelParallelStrategy
  >>> strategy = ModelParallelStrategy(devices, microbatches=4)  # doctest: +SKIP
  >>> with strategy.scope():                                # doctest: +SKIP
  ...     model = keras.Sequential([keras.Input((64,)),
  ...         keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])
  ...     model.compile("sgd", "sparse_categorical_crossentropy")
  >>> model.fit(x, y, epochs=1)                             # doctest: +SKIP
  >>> print(strategy.plan)                                  # doctest: +SKIP
"""

from tfdist_ext.model_parallel._layers import ColumnParallelDense
from tfdist_ext.model_parallel._pipeline import microbatch_gradients
from tfdist_ext.model_parallel._pipeline import pipeline_problem
from tfdist_ext.model_parallel._placement import apply_plan
from tfdist_ext.model_parallel._placement import placement_report
from tfdist_ext.model_parallel._placement import stage_gradients
from tfdist_ext.model_parallel._plan import LayerCost
from tfdist_ext.model_parallel._plan import Plan
from tfdist_ext.model_parallel._plan import Stage
from tfdist_ext.model_parallel._plan import layer_costs
from tfdist_ext.model_parallel._plan import plan_partition
from tfdist_ext.model_parallel._strategy import ModelParallelStrategy

__all__ = [
    "ColumnParallelDense",
    "LayerCost",
    "ModelParallelStrategy",
    "Plan",
    "Stage",
    "apply_plan",
    "layer_costs",
    "microbatch_gradients",
    "pipeline_problem",
    "placement_report",
    "plan_partition",
    "stage_gradients",
]
