"""tfdist_ext: classic distributed deep learning for TensorFlow 2.21 and Keras 3.

Strategies (``DownpourStrategy``, ``SandblasterStrategy``, ``CompressedMirroredStrategy``,
``CompressedMultiWorkerMirroredStrategy``, ``ModelParallelStrategy``) and the
subpackages ``downpour``, ``sandblaster``, ``optimizers``, ``compression``,
``schedules``, ``callbacks``, ``layers``, ``recipes`` and ``model_parallel``
import TensorFlow, so they are
loaded on first use; ``tfdist_ext.cluster`` and ``tfdist_ext.datasets`` are
light.

Example:
  >>> import tfdist_ext
  >>> with tfdist_ext.LocalCluster(num_workers=2, num_ps=1) as c:  # doctest: +SKIP
  ...     strategy = tfdist_ext.DownpourStrategy(c.resolver, n_fetch=5, n_push=5)
"""

import importlib

__version__ = "0.1.0"

from tfdist_ext import cluster
from tfdist_ext import datasets
from tfdist_ext.cluster import LocalCluster

_SUBPACKAGES = ("callbacks", "compression", "downpour", "layers", "model_parallel",
                "optimizers", "recipes", "sandblaster", "schedules")
_NAMES = {
    "DownpourStrategy": "tfdist_ext.downpour",
    "SandblasterStrategy": "tfdist_ext.sandblaster",
    "CompressedMirroredStrategy": "tfdist_ext.compression",
    "CompressedMultiWorkerMirroredStrategy": "tfdist_ext.compression",
    "ModelParallelStrategy": "tfdist_ext.model_parallel",
    "LinearScaling": "tfdist_ext.schedules",
    "LinearScalingWarmup": "tfdist_ext.callbacks",
    "IndependentBatchNormalization": "tfdist_ext.layers",
    "apply_goyal_recipe": "tfdist_ext.recipes",
}


def __getattr__(name):
    # Lazy: `tfdist-ext server` must report a bad TF_CONFIG without first
    # paying for a TensorFlow import.
    if name in _SUBPACKAGES:
        return importlib.import_module(f"tfdist_ext.{name}")
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'tfdist_ext' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_SUBPACKAGES) | set(_NAMES))


__all__ = ["LocalCluster", "cluster", "datasets", "__version__", *_SUBPACKAGES, *_NAMES]
