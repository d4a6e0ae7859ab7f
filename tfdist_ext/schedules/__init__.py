"""Learning-rate schedules for large-minibatch training (Goyal et al., 2017).

Example:
  >>> import keras
  >>> from tfdist_ext.schedules import LinearScaling
  >>> lr = LinearScaling(0.1, base_batch_size=256, batch_size=2048,
  ...                    warmup_epochs=5, steps_per_epoch=50)
  >>> opt = keras.optimizers.SGD(lr, momentum=0.9)
"""

from tfdist_ext.schedules._linear_scaling import LinearScaling
from tfdist_ext.schedules._linear_scaling import StepDecay

__all__ = ["LinearScaling", "StepDecay"]
