"""A ``Dense`` layer whose kernel is split column-wise across devices (internal)."""

from collections.abc import Callable
from collections.abc import Sequence

import keras
import tensorflow as tf

from tfdist_ext.model_parallel._devices import on_device


def column_sizes(units, num_shards):
    """Output units of each column shard: as equal as possible, larger ones first."""
    return [units // num_shards + (1 if i < units % num_shards else 0) for i in range(num_shards)]


@keras.saving.register_keras_serializable(package="tfdist_ext")
class ColumnParallelDense(keras.layers.Layer):
    """``Dense`` with its kernel (and bias) split column-wise into shards.

    Shard ``i`` holds output units ``[start_i, end_i)``; its variables and its
    matmul (forward and, in traced steps, backward) live on ``devices[i]`` (by
    default the planner's choice: each shard on the device holding the fewest
    shard bytes so far, distinct devices first); only the input (broadcast) and
    the shard outputs (concatenated) cross devices. Numerically it equals a
    ``Dense`` whose kernel is the shards concatenated along columns. Use it for
    a layer too big for one device. With a per-device budget,
    :class:`ModelParallelStrategy` and :func:`plan_partition` make one from a
    too-large ``Dense`` by themselves (``split_large_layers=True``).

    Args:
      units: output units (>= num_shards).
      num_shards: number of column shards (>= 1).
      activation, use_bias, kernel_initializer, bias_initializer: as ``Dense``.
      devices: optional explicit device per shard; if ``None`` the planner
        assigns them (round-robin over the plan's devices).

    Example:
      >>> with strategy.scope():                          # doctest: +SKIP
      ...     model = keras.Sequential([keras.Input((784,)),
      ...         ColumnParallelDense(4096, num_shards=2, activation="relu"),
      ...         keras.layers.Dense(10)])
    """

    def __init__(
        self,
        units: int,
        num_shards: int = 2,
        activation: str | Callable | None = None,
        use_bias: bool = True,
        kernel_initializer: str | keras.initializers.Initializer = "glorot_uniform",
        bias_initializer: str | keras.initializers.Initializer = "zeros",
        devices: Sequence[str] | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if isinstance(units, bool) or not isinstance(units, int) or units < 1:
            raise ValueError(f"ColumnParallelDense: units must be a positive int, got {units!r}")
        if (
            isinstance(num_shards, bool)
            or not isinstance(num_shards, int)
            or not 1 <= num_shards <= units
        ):
            raise ValueError(
                f"ColumnParallelDense: num_shards must be an int in [1, units={units}], "
                f"got {num_shards!r}"
            )
        if devices is not None and len(devices) != num_shards:
            raise ValueError(
                f"ColumnParallelDense: {len(devices)} devices given for {num_shards} shards"
            )
        self.units = units
        self.num_shards = num_shards
        self.activation = keras.activations.get(activation)
        self.use_bias = use_bias
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.devices = list(devices) if devices is not None else None
        self._shard_placement = None  # set by apply_plan
        self.shard_sizes = column_sizes(units, num_shards)

    def build(self, input_shape):
        in_dim = int(input_shape[-1])
        self.kernels, self.biases = [], []
        # Shards whose devices are already known are created there directly.
        devices = self._shard_placement or self.devices or [None] * self.num_shards
        for i, (size, device) in enumerate(zip(self.shard_sizes, devices)):
            with on_device(device):
                self.kernels.append(
                    self.add_weight(
                        name=f"kernel_shard_{i}",
                        shape=(in_dim, size),
                        initializer=self.kernel_initializer,
                    )
                )
                if self.use_bias:
                    self.biases.append(
                        self.add_weight(
                            name=f"bias_shard_{i}", shape=(size,), initializer=self.bias_initializer
                        )
                    )

    def shard_variables(self):
        """``[[kernel_i, bias_i], ...]``: the variables of each shard."""
        if self.use_bias:
            return [[k, b] for k, b in zip(self.kernels, self.biases)]
        return [[k] for k in self.kernels]

    def call(self, inputs):
        devices = self._shard_placement or [None] * self.num_shards
        outs = []
        for i, device in enumerate(devices):
            with tf.device(device):
                y = keras.ops.matmul(inputs, self.kernels[i])
                if self.use_bias:
                    y = y + self.biases[i]
                outs.append(y)
        y = keras.ops.concatenate(outs, axis=-1)
        return self.activation(y) if self.activation is not None else y

    def compute_output_shape(self, input_shape):
        return (*input_shape[:-1], self.units)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "units": self.units,
                "num_shards": self.num_shards,
                "activation": keras.activations.serialize(self.activation),
                "use_bias": self.use_bias,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer),
                "devices": self.devices,
            }
        )
        return config
