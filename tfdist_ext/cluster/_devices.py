"""Logical CPU devices for single-machine data and model parallelism (internal)."""


def logical_cpus(n, threads_per_device=None):
    """Makes sure there are at least ``n`` logical CPU devices; returns ``n`` names.

    Before TensorFlow initialises its devices (before the first op or
    strategy) this splits the physical CPU into exactly ``n`` logical devices.
    Afterwards it succeeds when at least ``n`` logical CPUs already exist (so a
    library and its caller, or a test suite that set up more, can both ask) and
    raises otherwise.

    Args:
      n: number of logical CPU devices (>= 1).
      threads_per_device: if set, caps TensorFlow's intra-op thread pool, which
        all logical CPU devices share, to this many threads times ``n``.

    Returns:
      ``["/device:CPU:0", ..., f"/device:CPU:{n-1}"]``.

    Raises:
      ValueError: ``n`` is not a positive integer.
      RuntimeError: TensorFlow is already initialised with fewer than ``n``.

    Example:
      >>> import tfdist_ext
      >>> devices = tfdist_ext.cluster.logical_cpus(2)   # doctest: +SKIP
      >>> strategy = tf.distribute.MirroredStrategy(devices)  # doctest: +SKIP
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"logical_cpus: n must be a positive integer, got {n!r}")
    # TensorFlow loads only when used: the CLI, launchers and cluster start without it.
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    if current is None or len(current) < n:
        try:
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)]
            )
            if threads_per_device:
                tf.config.threading.set_intra_op_parallelism_threads(threads_per_device * n)
        except RuntimeError as e:
            existing = len(tf.config.list_logical_devices("CPU"))
            if existing < n:
                raise RuntimeError(
                    f"logical_cpus({n}): TensorFlow is already initialised with "
                    f"{existing} CPU device(s); call logical_cpus before any "
                    "TensorFlow op runs"
                ) from e
    return [f"/device:CPU:{i}" for i in range(n)]
