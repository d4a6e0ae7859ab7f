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

__all__ = ["LocalCluster", "cluster", "datasets", "__version__"]
