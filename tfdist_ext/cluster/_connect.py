"""Connecting this process to a cluster as its coordinator (internal)."""

import os

from tfdist_ext.cluster._local import ClusterError
from tfdist_ext.cluster._local import ping


def connect(cluster_resolver, *, job_name="chief", timeout=60.0, require_jobs=()):
    """Connects this process to the cluster as its coordinating ``chief``.

    First asks every task for its status over gRPC with a deadline, so an
    unreachable task is a clear error within ``timeout`` seconds instead of a
    hang inside TensorFlow's context creation. Then connects TensorFlow's
    eager runtime with device filters (workers see only ``ps`` and the chief,
    ``ps`` tasks see only workers and the chief), as TensorFlow's
    parameter-server strategy does: without them, every task tries to reach
    every other task at start-up and a loopback cluster can stall.

    Args:
      cluster_resolver: a ``tf.distribute.cluster_resolver.ClusterResolver``.
      job_name: the job of this process in the cluster spec.
      timeout: seconds each task has to answer.
      require_jobs: jobs that must be present, e.g. ``("ps", "worker")``.

    Raises:
      ValueError: a required job is missing.
      ClusterTimeoutError: a task did not answer within ``timeout``.

    Example:
      >>> with LocalCluster(num_workers=2, num_ps=1) as cluster:  # doctest: +SKIP
      ...     connect(cluster.resolver)
      ...     with tf.device("/job:ps/task:0"):
      ...         v = tf.Variable(1.0)
    """
    # TensorFlow loads only when used: the CLI, launchers and cluster start without it.
    import tensorflow as tf

    from tfdist_ext import _integration

    spec = cluster_resolver.cluster_spec().as_dict()
    _check_jobs(spec, require_jobs)
    for job, addresses in spec.items():
        if job != job_name:
            for address in addresses:
                ping(address, timeout=timeout)
    filters = _device_filters(_integration.server_lib.ClusterDeviceFilters(), spec, job_name)
    os.environ.setdefault("TF_ENABLE_EAGER_CLIENT_STREAMING_ENQUEUE", "False")
    try:
        tf.config.experimental_connect_to_cluster(
            cluster_resolver.cluster_spec(),
            job_name=job_name,
            protocol=cluster_resolver.rpc_layer or "grpc",
            cluster_device_filters=filters,
        )
        _integration.eager_context.ensure_initialized()
    except tf.errors.OpError as e:
        raise ClusterError(f"could not connect to the cluster: {e.message}") from None


def _check_jobs(spec, require_jobs):
    for job in require_jobs:
        if not spec.get(job):
            raise ValueError(
                f"the cluster has no {job!r} job (jobs: {', '.join(sorted(spec)) or 'none'})"
            )


def _device_filters(filters, spec, job_name):
    """``filters`` (TensorFlow's ``ClusterDeviceFilters``) set so workers see
    only ``ps`` and the chief, and ``ps`` tasks only workers and the chief."""
    for i in range(len(spec.get("worker", ()))):
        filters.set_device_filters("worker", i, ["/job:ps", f"/job:{job_name}"])
    for i in range(len(spec.get("ps", ()))):
        filters.set_device_filters("ps", i, ["/job:worker", f"/job:{job_name}"])
    return filters
