"""Layers for large-minibatch training.

* :class:`IndependentBatchNormalization` -- batch-norm statistics over fixed
  groups of ``n`` examples, whatever the per-replica batch and the number of
  replicas (Goyal et al., 2017).
* Synchronised batch norm (statistics over the global batch, all replicas) is
  Keras's own ``keras.layers.BatchNormalization(synchronized=True)``: with the
  TensorFlow backend it all-reduces sums under any ``tf.distribute`` strategy
  (tested under ``MirroredStrategy``), so this package does not duplicate it.

Example:
  >>> from tfdist_ext.layers import IndependentBatchNormalization
  >>> bn = IndependentBatchNormalization(virtual_batch_size=32)
"""

from tfdist_ext.layers._batch_norm import IndependentBatchNormalization

__all__ = ["IndependentBatchNormalization"]
