"""Batch normalisation over fixed groups of n examples (Goyal et al., 2017) (internal)."""

import numbers

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="tfdist_ext")
class IndependentBatchNormalization(keras.layers.BatchNormalization):
    """Batch normalisation whose statistics come from groups of exactly n examples.

    In training mode the per-replica batch is cut, in order, into groups of
    ``virtual_batch_size`` consecutive examples and each group is normalised
    with its own mean and variance -- the paper's "BN statistics over a fixed
    per-worker batch n". The result depends on ``n`` only: one replica with a
    batch of ``4n`` computes exactly what 4 replicas with ``n`` each compute
    (``tf.distribute`` hands replica ``i`` the ``i``-th contiguous slice of the
    global batch), and training with a total batch ``k * n`` on one device
    reproduces ``k`` workers with BN over ``n`` each.

    Moving statistics are updated with the average of the groups' means and
    (biased) variances and live in variables with ``aggregation="mean"``, so
    under ``tf.distribute`` the replicas' updates are averaged and every copy
    stays identical. (Plain ``keras.layers.BatchNormalization`` in Keras 3 creates
    them with ``aggregation="none"``; under ``MirroredStrategy`` each replica
    then keeps its own diverging copy and only replica 0's is saved.)

    Inference (``training=False``) uses the moving statistics and accepts any
    batch size. In training the per-replica batch must be a multiple of
    ``virtual_batch_size`` (batch with ``drop_remainder=True``).

    Args:
      virtual_batch_size: n, the number of examples per statistics group.
      **kwargs: every argument of ``keras.layers.BatchNormalization`` except
        ``synchronized=True`` and ``renorm=True`` (which contradict fixed
        groups); ``axis`` must be a single axis other than the batch axis.

    Raises:
      ValueError: ``virtual_batch_size`` is not a positive integer, or a
        contradicting argument is given; at call time, a static batch that
        is not a multiple of ``virtual_batch_size`` (a dynamic one fails with
        ``tf.errors.InvalidArgumentError`` carrying the same message).

    Example:
      >>> from tfdist_ext.layers import IndependentBatchNormalization
      >>> bn = IndependentBatchNormalization(virtual_batch_size=32, momentum=0.9)
      >>> y = bn(keras.random.normal((128, 10)), training=True)  # 4 groups of 32
    """

    def __init__(self, virtual_batch_size: int, **kwargs):
        name = "IndependentBatchNormalization"
        if (
            isinstance(virtual_batch_size, bool)
            or not isinstance(virtual_batch_size, numbers.Integral)
            or virtual_batch_size < 1
        ):
            raise ValueError(
                f"{name}: virtual_batch_size must be a positive integer, got {virtual_batch_size!r}"
            )
        if kwargs.get("synchronized"):
            raise ValueError(
                f"{name}: synchronized=True (statistics over the global batch) "
                "contradicts virtual_batch_size; use "
                "keras.layers.BatchNormalization(synchronized=True) for that"
            )
        if kwargs.get("renorm"):
            raise ValueError(f"{name}: renorm=True is not supported")
        axis = kwargs.get("axis", -1)
        if isinstance(axis, (list, tuple)) or axis == 0:
            raise ValueError(
                f"{name}: axis must be one feature axis (not the batch axis 0), got {axis!r}"
            )
        super().__init__(**kwargs)
        self.virtual_batch_size = int(virtual_batch_size)

    def add_weight(self, *args, **kwargs):
        # Moving statistics: averaged over replicas, so all copies agree.
        if str(kwargs.get("name", "")).startswith("moving_"):
            kwargs["aggregation"] = "mean"
        return super().add_weight(*args, **kwargs)

    def build(self, input_shape):
        if self.axis < 0:
            self.axis = len(input_shape) + self.axis
        super().build(input_shape)

    def call(self, inputs, training=None, mask=None):
        if not (training and self.trainable):
            return super().call(inputs, training=training, mask=mask)
        if mask is not None:
            raise ValueError(f"{self.__class__.__name__} '{self.name}': masks are not supported")
        compute_dtype = keras.backend.result_type(inputs.dtype, "float32")
        x = self._grouped(ops.cast(inputs, compute_dtype))
        # Keras's reduction axes (every input axis but the feature axis), moved
        # past the group axis, less the batch axis: statistics per group.
        axes = [1] + [a + 1 for a in range(1, len(inputs.shape)) if a != self.axis]
        mean, variance = ops.moments(x, axes=axes, keepdims=True)
        outputs = (x - mean) * ops.rsqrt(variance + self.epsilon)
        shape = [1] * len(x.shape)
        shape[self.axis + 1] = -1
        if self.scale:
            outputs = outputs * ops.reshape(ops.cast(self.gamma, compute_dtype), shape)
        if self.center:
            outputs = outputs + ops.reshape(ops.cast(self.beta, compute_dtype), shape)
        self._update_moving(mean, variance)
        outputs = ops.reshape(outputs, ops.shape(inputs))
        return ops.cast(outputs, self.compute_dtype)

    def _grouped(self, x):
        """Reshapes ``(B, ...)`` to ``(B // n, n, ...)``, checking B % n == 0."""
        n = self.virtual_batch_size
        batch = x.shape[0]
        message = (
            f"{self.__class__.__name__} '{self.name}': the per-replica batch must be "
            f"a multiple of virtual_batch_size={n} in training; batch the data "
            "with drop_remainder=True and a per-replica batch divisible by it"
        )
        if batch is not None:
            if batch % n:
                raise ValueError(f"{message} (got a batch of {batch})")
        elif keras.backend.backend() == "tensorflow":
            # Only on the TensorFlow backend: the layer itself is backend-neutral.
            import tensorflow as tf

            with tf.control_dependencies(
                [tf.debugging.assert_equal(tf.shape(x)[0] % n, 0, message=message)]
            ):
                x = tf.identity(x)
        shape = ops.shape(x)
        return ops.reshape(x, (-1, n, *shape[1:]))

    def _update_moving(self, mean, variance):
        axes = [a for a in range(len(mean.shape)) if a != self.axis + 1]
        mean = ops.mean(mean, axis=axes)
        variance = ops.mean(variance, axis=axes)
        moving_mean = ops.cast(self.moving_mean, mean.dtype)
        moving_variance = ops.cast(self.moving_variance, mean.dtype)
        self.moving_mean.assign(moving_mean * self.momentum + mean * (1.0 - self.momentum))
        self.moving_variance.assign(
            moving_variance * self.momentum + variance * (1.0 - self.momentum)
        )

    def get_config(self):
        config = super().get_config()
        config.pop("synchronized", None)
        config.pop("renorm", None)
        config.pop("renorm_clipping", None)
        config.pop("renorm_momentum", None)
        config["virtual_batch_size"] = self.virtual_batch_size
        return config
