"""Linear learning-rate scaling with warm-up (Goyal et al., 2017) (internal)."""

from collections.abc import Callable
from collections.abc import Sequence
from typing import Literal

import keras
from keras import ops

from tfdist_ext.schedules import _validate


@keras.saving.register_keras_serializable(package="tfdist_ext")
class LinearScaling(keras.optimizers.schedules.LearningRateSchedule):
    """The linear scaling rule with warm-up of Goyal et al. (2017), as a schedule.

    The rate after warm-up is ``k * after(step)`` (or ``k * base_learning_rate``
    without ``after``), with ``k = batch_size / base_batch_size``. During the
    first ``warmup_epochs * steps_per_epoch`` steps it is

    * ``"gradual"``: a straight line from ``base_learning_rate`` at step 0 to
      the scaled rate at the end of warm-up (the paper's recipe, Sec. 2.2);
    * ``"constant"``: ``base_learning_rate`` (the paper's constant warm-up).

    The guide (``docs/api/guides/large_batch.rst``) says what a step is and how it saves.

    Args:
      base_learning_rate: the rate ``eta`` tuned for ``base_batch_size``.
      base_batch_size: the reference total batch (the paper's 256).
      batch_size: the total batch actually used (all replicas together).
      warmup_epochs: length of the warm-up in epochs (may be fractional; 0 = none).
      steps_per_epoch: global steps per epoch; required when ``warmup_epochs > 0``.
      warmup: ``"gradual"`` or ``"constant"``.
      after: optional schedule written for ``base_batch_size`` (e.g.
        :class:`StepDecay`); it is multiplied by ``k``.
      total_epochs: optional; if given, a warm-up longer than training raises.

    Raises:
      ValueError: on a non-positive rate or batch size, an unknown ``warmup``,
        a missing ``steps_per_epoch``, or ``warmup_epochs > total_epochs``.

    Example:
      >>> from tfdist_ext.schedules import LinearScaling, StepDecay
      >>> lr = LinearScaling(0.1, base_batch_size=256, batch_size=8192,
      ...                    warmup_epochs=5, steps_per_epoch=156,
      ...                    after=StepDecay(0.1, (30, 60, 80), steps_per_epoch=156))
      >>> import keras
      >>> opt = keras.optimizers.SGD(lr, momentum=0.9)
      >>> round(float(lr(5 * 156)), 4)   # 32 x 0.1 once warm-up is over
      3.2
    """

    def __init__(
        self,
        base_learning_rate: float,
        base_batch_size: int,
        batch_size: int,
        *,
        warmup_epochs: float = 5,
        steps_per_epoch: int | None = None,
        warmup: Literal["gradual", "constant"] = "gradual",
        after: Callable | None = None,
        total_epochs: float | None = None,
    ):
        owner = "LinearScaling"
        self.base_learning_rate = _validate.positive_number(
            owner, "base_learning_rate", base_learning_rate
        )
        self.base_batch_size = _validate.positive_int(owner, "base_batch_size", base_batch_size)
        self.batch_size = _validate.positive_int(owner, "batch_size", batch_size)
        self.warmup_epochs = _validate.non_negative_number(owner, "warmup_epochs", warmup_epochs)
        self.warmup = _validate.warmup_kind(owner, warmup)
        self.steps_per_epoch = _validate.positive_int(
            owner, "steps_per_epoch", steps_per_epoch, allow_none=True
        )
        if self.warmup_epochs > 0 and self.steps_per_epoch is None:
            raise ValueError(
                f"{owner}: steps_per_epoch is required when warmup_epochs > 0 "
                f"(got warmup_epochs={warmup_epochs!r}, steps_per_epoch=None)"
            )
        if total_epochs is not None:
            total_epochs = _validate.positive_number(owner, "total_epochs", total_epochs)
        _validate.warmup_fits(owner, self.warmup_epochs, total_epochs)
        self.total_epochs = total_epochs
        if after is not None and not callable(after):
            raise ValueError(
                f"{owner}: after must be a LearningRateSchedule or a callable of "
                f"the step, got {after!r}"
            )
        self.after = after

    @property
    def scale(self):
        """``k = batch_size / base_batch_size``."""
        return self.batch_size / self.base_batch_size

    @property
    def warmup_steps(self):
        """Number of warm-up steps (0 without warm-up)."""
        if self.warmup_epochs == 0:
            return 0
        return int(round(self.warmup_epochs * self.steps_per_epoch))

    def target(self, step):
        """The scaled rate at ``step`` ignoring warm-up: ``k * after(step)``."""
        if self.after is None:
            reference = ops.convert_to_tensor(self.base_learning_rate, "float32")
        else:
            reference = ops.cast(self.after(step), "float32")
        return reference * self.scale

    def __call__(self, step):
        step = ops.cast(step, "float32")
        target = self.target(step)
        warmup_steps = self.warmup_steps
        if warmup_steps == 0:
            return target
        base = ops.convert_to_tensor(self.base_learning_rate, "float32")
        if self.warmup == "constant":
            return ops.where(step < warmup_steps, base, target)
        fraction = ops.minimum(step / float(warmup_steps), 1.0)
        return base + (target - base) * fraction

    def get_config(self):
        return {
            "base_learning_rate": self.base_learning_rate,
            "base_batch_size": self.base_batch_size,
            "batch_size": self.batch_size,
            "warmup_epochs": self.warmup_epochs,
            "steps_per_epoch": self.steps_per_epoch,
            "warmup": self.warmup,
            "after": (
                None if self.after is None else keras.saving.serialize_keras_object(self.after)
            ),
            "total_epochs": self.total_epochs,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if config.get("after") is not None:
            config["after"] = keras.saving.deserialize_keras_object(config["after"])
        return cls(**config)


@keras.saving.register_keras_serializable(package="tfdist_ext")
class StepDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Step decay by epochs: ``rate * factor ** (number of boundaries passed)``.

    The paper's schedule divides the rate by 10 at epochs 30, 60 and 80; use it
    as the ``after`` of :class:`LinearScaling`.

    Args:
      base_learning_rate: the rate before the first boundary.
      boundaries: increasing epochs (numbers > 0) at which the rate drops.
      steps_per_epoch: global steps per epoch.
      factor: multiplier applied at each boundary (in (0, 1]).

    Example:
      >>> s = StepDecay(0.1, (30, 60, 80), steps_per_epoch=100)
      >>> round(float(s(6000)), 6)   # epoch 60: two drops
      0.001
    """

    def __init__(
        self,
        base_learning_rate: float,
        boundaries: Sequence[float],
        *,
        steps_per_epoch: int,
        factor: float = 0.1,
    ):
        owner = "StepDecay"
        self.base_learning_rate = _validate.positive_number(
            owner, "base_learning_rate", base_learning_rate
        )
        self.steps_per_epoch = _validate.positive_int(owner, "steps_per_epoch", steps_per_epoch)
        try:
            boundaries = [float(b) for b in boundaries]
        except TypeError as e:
            raise ValueError(
                f"{owner}: boundaries must be a sequence of epochs, got {boundaries!r}"
            ) from e
        if any(b <= 0 for b in boundaries) or boundaries != sorted(set(boundaries)):
            raise ValueError(
                f"{owner}: boundaries must be strictly increasing epochs > 0, got {boundaries!r}"
            )
        self.boundaries = boundaries
        factor = _validate.positive_number(owner, "factor", factor)
        if factor > 1:
            raise ValueError(f"{owner}: factor must be in (0, 1], got {factor!r}")
        self.factor = factor

    def __call__(self, step):
        epoch = ops.cast(step, "float32") / float(self.steps_per_epoch)
        drops = ops.convert_to_tensor(0.0, "float32")
        for boundary in self.boundaries:
            drops = drops + ops.cast(epoch >= boundary, "float32")
        return self.base_learning_rate * ops.power(
            ops.convert_to_tensor(self.factor, "float32"), drops
        )

    def get_config(self):
        return {
            "base_learning_rate": self.base_learning_rate,
            "boundaries": list(self.boundaries),
            "steps_per_epoch": self.steps_per_epoch,
            "factor": self.factor,
        }
