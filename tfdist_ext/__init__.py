"""tfdist_ext: classic distributed deep learning for TensorFlow 2.21 and Keras 3.

Strategies (``MultiWorkerMirroredStrategy`` and ``MirroredStrategy``: TensorFlow's,
made to work under Keras 3, optionally compressed; ``DownpourStrategy``,
``ElasticAveragingStrategy``, ``SandblasterStrategy``, ``ModelParallelStrategy``) and the
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
import importlib.util
import sys

__version__ = "0.1.0"

# TensorFlow is an extra, not a hard requirement (a GPU user keeps their own
# wheel): say which one to install before anything needs it. find_spec does
# not import TensorFlow, so `tfdist-ext server` stays fast to fail.
if importlib.util.find_spec("tensorflow") is None:
    raise ImportError(
        "tfdist_ext needs TensorFlow 2.21, which is not installed. Install it "
        "with one of: pip install 'tfdist_ext[cpu]' (CPU-only wheel), "
        "pip install 'tfdist_ext[and-cuda]' (NVIDIA GPUs), or "
        "pip install 'tfdist_ext[tensorflow]' (the plain tensorflow wheel)."
    )

from tfdist_ext import cluster
from tfdist_ext import datasets
from tfdist_ext.cluster import LocalCluster

_SUBPACKAGES = (
    "callbacks",
    "compression",
    "downpour",
    "layers",
    "model_parallel",
    "optimizers",
    "recipes",
    "sandblaster",
    "schedules",
)
_NAMES = {
    "DownpourStrategy": "tfdist_ext.downpour",
    "ElasticAveragingStrategy": "tfdist_ext.downpour",
    "SandblasterStrategy": "tfdist_ext.sandblaster",
    "MirroredStrategy": "tfdist_ext.compression",
    "MultiWorkerMirroredStrategy": "tfdist_ext.compression",
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


def _register_keras_objects():
    """Imports the subpackages: their modules register the Keras-serializable classes."""
    for name in _SUBPACKAGES:
        importlib.import_module(f"tfdist_ext.{name}")


# keras.models.load_model finds a class a .keras file names (the LBFGS or LARS
# optimizer, a schedule, a layer, a compressor) only once its module has
# registered it. Where Keras is loaded already (it is imported before
# tfdist_ext in any script that uses both), `import tfdist_ext` registers them;
# otherwise the package stays light (`tfdist-ext server` imports no Keras).
if "keras" in sys.modules:
    try:
        _register_keras_objects()
    except ImportError:
        pass  # an untested Keras: the same error comes, whole, where a strategy is used


def __dir__():
    return sorted(set(globals()) | set(_SUBPACKAGES) | set(_NAMES))


__all__ = ["LocalCluster", "cluster", "datasets", "__version__", *_SUBPACKAGES, *_NAMES]
