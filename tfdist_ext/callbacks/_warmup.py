"""The linear scaling rule with warm-up as a Keras callback, and momentum correction (internal)."""

from typing import Literal

import keras
import numpy as np
import tensorflow as tf

from tfdist_ext import _integration
from tfdist_ext.schedules import _validate
from tfdist_ext.schedules._linear_scaling import LinearScaling


def _current_rate(optimizer):
    return float(np.asarray(keras.ops.convert_to_numpy(optimizer.learning_rate)))


def _momentum_slots(optimizer, owner):
    slots = getattr(optimizer, "momentums", None)
    if not isinstance(optimizer, keras.optimizers.SGD) or not getattr(optimizer, "momentum", 0):
        raise ValueError(
            f"{owner}: momentum correction needs keras.optimizers.SGD with "
            f"momentum > 0, got {type(optimizer).__name__}"
            f"(momentum={getattr(optimizer, 'momentum', None)!r})"
        )
    return slots or []


def _scale_momentum(optimizer, ratio):
    for slot in optimizer.momentums:
        slot.assign(slot * ratio)


class MomentumCorrection(keras.callbacks.Callback):
    """Momentum correction of Goyal et al. (2017, Sec. 2.1) for Keras SGD.

    Keras's SGD keeps the rate inside the velocity (``v <- m v - lr g``,
    ``w <- w + v``), the paper's Eq. (10) form. When the rate changes from
    ``lr_old`` to ``lr_new`` the paper corrects the velocity by
    ``lr_new / lr_old`` so that the update is the same as with the rate
    outside the velocity; this callback does exactly that before each
    training step whose rate differs from the previous step's, whoever
    changed it (a schedule, :class:`LinearScalingWarmup`,
    ``ReduceLROnPlateau``...). Put it after callbacks that set the rate.

    Raises:
      ValueError: (at the start of training) the optimizer is not
        ``keras.optimizers.SGD`` with ``momentum > 0``.

    Example:
      >>> import keras, numpy as np
      >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
      >>> model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "mse")
      >>> x, y = np.ones((64, 4), "float32"), np.ones((64, 1), "float32")
      >>> _ = model.fit(x, y, verbose=0, callbacks=[MomentumCorrection()])
    """

    def __init__(self):
        super().__init__()
        self._previous = None
        self.corrections = 0

    def on_train_begin(self, logs=None):
        _momentum_slots(self.model.optimizer, "MomentumCorrection")
        self._previous = None

    def on_train_batch_begin(self, batch, logs=None):
        self._previous = correct_momentum(self.model.optimizer, self._previous, self)


def correct_momentum(optimizer, previous, counter=None):
    """Scales SGD velocities by ``rate / previous`` if the rate changed; returns the rate."""
    rate = _current_rate(optimizer)
    # Before the first step there is no velocity to correct.
    stepped = optimizer.built and int(optimizer.iterations.numpy()) > 0
    if previous and rate != previous and stepped:
        _scale_momentum(optimizer, rate / previous)
        if counter is not None:
            counter.corrections += 1
    return rate


class LinearScalingWarmup(keras.callbacks.Callback):
    """The linear scaling rule with warm-up for an optimizer with a float rate.

    During warm-up it sets the optimizer's rate before every training step to
    that of :class:`tfdist_ext.schedules.LinearScaling`, with ``k = global
    batch / base_batch_size``; at its end it sets ``k * base_learning_rate``
    and leaves the rate to other callbacks. It logs ``logs["learning_rate"]``
    and keeps ``self.history`` (``[(epoch, rate)]``). What it reads at the
    start of ``fit`` is in ``docs/api/guides/large_batch.rst``.

    Args:
      base_learning_rate: rate tuned for ``base_batch_size``.
      base_batch_size: reference total batch.
      batch_size: the global batch (one of the three batch sources).
      per_replica_batch_size: one replica's batch, times the replica count.
      data: a ``tf.data.Dataset`` with a static batch size; give exactly one.
      warmup_epochs: warm-up length in epochs (> 0).
      warmup: ``"gradual"`` or ``"constant"``.
      steps_per_epoch: optional override of ``fit``'s step count.
      momentum_correction: also apply :class:`MomentumCorrection` (SGD with
        momentum only).
      verbose: 1 prints the rate at each epoch end.

    Raises:
      ValueError: a bad argument or batch source; at the start of ``fit``, a
        warm-up longer than training, a scheduled rate or unknown steps.

    Example:
      >>> import keras, numpy as np
      >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
      >>> model.compile(keras.optimizers.SGD(0.1), "mse")
      >>> x, y = np.ones((256, 4), "float32"), np.ones((256, 1), "float32")
      >>> cb = LinearScalingWarmup(0.1, base_batch_size=32, per_replica_batch_size=64,
      ...                          warmup_epochs=2)
      >>> _ = model.fit(x, y, batch_size=64, epochs=3, verbose=0, callbacks=[cb])
      >>> round(float(model.optimizer.learning_rate), 4)   # 0.1 x 64 / 32 after warm-up
      0.2
    """

    def __init__(
        self,
        base_learning_rate: float,
        base_batch_size: int,
        *,
        batch_size: int | None = None,
        per_replica_batch_size: int | None = None,
        data: tf.data.Dataset | None = None,
        warmup_epochs: float = 5,
        warmup: Literal["gradual", "constant"] = "gradual",
        steps_per_epoch: int | None = None,
        momentum_correction: bool = False,
        verbose: int = 0,
    ):
        super().__init__()
        owner = "LinearScalingWarmup"
        self.base_learning_rate = _validate.positive_number(
            owner, "base_learning_rate", base_learning_rate
        )
        self.base_batch_size = _validate.positive_int(owner, "base_batch_size", base_batch_size)
        sources = [
            s
            for s, v in (
                ("batch_size", batch_size),
                ("per_replica_batch_size", per_replica_batch_size),
                ("data", data),
            )
            if v is not None
        ]
        if len(sources) != 1:
            raise ValueError(
                f"{owner}: give exactly one of batch_size, per_replica_batch_size "
                f"or data to tell the global batch; got {sources or 'none'}"
            )
        self.batch_size = _validate.positive_int(owner, "batch_size", batch_size, allow_none=True)
        self.per_replica_batch_size = _validate.positive_int(
            owner, "per_replica_batch_size", per_replica_batch_size, allow_none=True
        )
        self.data_batch_size = None if data is None else _static_batch(owner, data)
        self.warmup_epochs = _validate.positive_number(owner, "warmup_epochs", warmup_epochs)
        self.warmup = _validate.warmup_kind(owner, warmup)
        self.steps_per_epoch = _validate.positive_int(
            owner, "steps_per_epoch", steps_per_epoch, allow_none=True
        )
        self.momentum_correction = bool(momentum_correction)
        self.verbose = verbose
        self.schedule = None
        self.global_batch_size = None
        self.history = []
        self.corrections = 0
        self._factor = 1.0
        self._last_set = None
        self._previous_rate = None
        self._done = False

    def _global_batch(self):
        if self.batch_size is not None:
            return self.batch_size
        if self.data_batch_size is not None:
            return self.data_batch_size
        replicas = self.model.distribute_strategy.num_replicas_in_sync
        return self.per_replica_batch_size * replicas

    def on_train_begin(self, logs=None):
        owner = "LinearScalingWarmup"
        optimizer = self.model.optimizer
        rate = _integration.given_learning_rate(optimizer)
        if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
            raise ValueError(
                f"{owner}: the optimizer's rate is a LearningRateSchedule; use "
                "tfdist_ext.schedules.LinearScaling as the schedule instead"
            )
        if self.momentum_correction:
            _momentum_slots(optimizer, owner)
        steps = self.steps_per_epoch or (self.params or {}).get("steps")
        if not steps:
            raise ValueError(
                f"{owner}: fit does not know the steps per epoch (infinite or "
                "unknown-size data); pass steps_per_epoch="
            )
        epochs = (self.params or {}).get("epochs")
        self.global_batch_size = self._global_batch()
        self.schedule = LinearScaling(
            self.base_learning_rate,
            self.base_batch_size,
            self.global_batch_size,
            warmup_epochs=self.warmup_epochs,
            steps_per_epoch=int(steps),
            warmup=self.warmup,
            total_epochs=epochs,
        )
        self._factor, self._last_set, self._previous_rate = 1.0, None, None
        self._done = int(optimizer.iterations.numpy()) > self.schedule.warmup_steps

    def on_train_batch_begin(self, batch, logs=None):
        optimizer = self.model.optimizer
        if self.momentum_correction and self._previous_rate is None:
            # The rate the velocity was made with: in a fit resumed by
            # BackupAndRestore, the rate restored with the optimizer.
            self._previous_rate = _current_rate(optimizer)
        if not self._done:
            self._set_rate(optimizer)
        if self.momentum_correction:
            self._previous_rate = correct_momentum(optimizer, self._previous_rate, self)

    def _set_rate(self, optimizer):
        step = int(optimizer.iterations.numpy())
        if self._last_set is not None:
            current = _current_rate(optimizer)
            if not np.isclose(current, self._last_set, rtol=1e-6, atol=0.0):
                self._factor *= current / self._last_set  # someone else changed it
        rate = float(self.schedule(step)) * self._factor
        optimizer.learning_rate = rate
        self._last_set = _current_rate(optimizer)
        self._done = step >= self.schedule.warmup_steps

    def on_epoch_end(self, epoch, logs=None):
        rate = _current_rate(self.model.optimizer)
        self.history.append((epoch, rate))
        if logs is not None:
            logs["learning_rate"] = rate
        if self.verbose:
            print(
                f"\nEpoch {epoch + 1}: LinearScalingWarmup learning rate {rate:.6g} "
                f"(global batch {self.global_batch_size}, "
                f"k = {self.schedule.scale:g})"
            )


def _static_batch(owner, data):
    spec = getattr(data, "element_spec", None)
    if spec is None:
        raise ValueError(
            f"{owner}: data must be a batched tf.data.Dataset, got {type(data).__name__}"
        )
    first = spec[0] if isinstance(spec, (tuple, list)) else spec
    while isinstance(first, (tuple, list)):
        first = first[0]
    if isinstance(first, dict):
        first = next(iter(first.values()))
    shape = getattr(first, "shape", None)
    if shape is None or len(shape) == 0 or shape[0] is None:
        raise ValueError(
            f"{owner}: the batch size of data is not static (batch it with "
            "drop_remainder=True) -- or pass batch_size= / per_replica_batch_size="
        )
    return int(shape[0])
