"""Cluster plumbing: a real local TensorFlow cluster, ``TF_CONFIG`` and devices.

Example:
  >>> from tfdist_ext.cluster import LocalCluster
  >>> with LocalCluster(num_workers=2, num_ps=1) as cluster:  # doctest: +SKIP
  ...     cluster.ping()
  ...     strategy = tfdist_ext.DownpourStrategy(cluster.resolver)
"""

from tfdist_ext.cluster._connect import connect
from tfdist_ext.cluster._devices import logical_cpus
from tfdist_ext.cluster._local import ClusterError
from tfdist_ext.cluster._local import ClusterTimeoutError
from tfdist_ext.cluster._local import LocalCluster
from tfdist_ext.cluster._local import free_port
from tfdist_ext.cluster._local import ping
from tfdist_ext.cluster._tf_config import TFConfigError
from tfdist_ext.cluster._tf_config import parse_tf_config

__all__ = [
    "ClusterError",
    "ClusterTimeoutError",
    "LocalCluster",
    "TFConfigError",
    "connect",
    "free_port",
    "logical_cpus",
    "parse_tf_config",
    "ping",
]
