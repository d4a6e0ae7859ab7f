"""Keras callbacks of tfdist_ext.

Example:
  >>> from tfdist_ext.callbacks import LinearScalingWarmup
  >>> cb = LinearScalingWarmup(0.1, base_batch_size=256, batch_size=2048, warmup_epochs=5)
"""

from tfdist_ext.callbacks._compression import CompressionLogger
from tfdist_ext.callbacks._warmup import LinearScalingWarmup
from tfdist_ext.callbacks._warmup import MomentumCorrection
from tfdist_ext.compression._backup import CompressedBackupAndRestore

__all__ = [
    "CompressedBackupAndRestore",
    "CompressionLogger",
    "LinearScalingWarmup",
    "MomentumCorrection",
]
