"""tfdist_ext: classic distributed deep learning for TensorFlow 2.21 and Keras 3.

Example:
  >>> import tfdist_ext
  >>> with tfdist_ext.cluster.LocalCluster(num_workers=2, num_ps=1) as c:  # doctest: +SKIP
  ...     print(c.ping())
"""

__version__ = "0.1.0"

from tfdist_ext import cluster
from tfdist_ext import datasets
from tfdist_ext.cluster import LocalCluster


def __getattr__(name):
    # Strategies import TensorFlow: load them on first use so that
    # `tfdist-ext server` can report a bad TF_CONFIG without that cost.
    if name == "DownpourStrategy":
        from tfdist_ext.downpour import DownpourStrategy

        return DownpourStrategy
    if name == "downpour":
        import importlib

        return importlib.import_module("tfdist_ext.downpour")
    raise AttributeError(f"module 'tfdist_ext' has no attribute {name!r}")


__all__ = ["DownpourStrategy", "LocalCluster", "cluster", "datasets", "downpour", "__version__"]
