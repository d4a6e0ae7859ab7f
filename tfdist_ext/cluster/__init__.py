"""Cluster plumbing: a real local TensorFlow cluster, ``TF_CONFIG`` and devices.

``LocalCluster`` runs each task in its own OS process; as root it also gives
each task its own network namespace (unreachable from the host's network) and,
with ``bandwidth=``, a rate-limited link. See SECURITY.md for the trust model.

Example:
  >>> from tfdist_ext.cluster import LocalCluster
  >>> with LocalCluster(num_workers=2, num_ps=1, bandwidth="100mbit") as cluster:  # doctest: +SKIP
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
