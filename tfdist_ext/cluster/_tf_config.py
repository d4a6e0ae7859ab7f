"""Parsing and validation of ``TF_CONFIG`` (internal).

``TF_CONFIG`` is the JSON document TensorFlow documents for multi-process
training::

    {"cluster": {"chief": ["host:port"], "worker": [...], "ps": [...]},
     "task": {"type": "worker", "index": 0}}

Every problem is reported as a :class:`TFConfigError` whose message names the
offending field, so that the ``tfdist-ext server`` command can print one line
and exit with status 2.
"""

import json
import os

KNOWN_JOBS = ("chief", "worker", "ps", "evaluator")

# Set by LocalCluster for its task processes: a task exits when this process
# is gone, so that a crashed or killed parent never leaves orphans behind.
PARENT_PID_ENV = "TFDIST_EXT_PARENT_PID"

# Environment a task process gets unless the user set the variable (internal):
# TensorFlow's C++ logging quiet, and TensorFlow's own BFC allocator on the
# CPU, a pool that reuses freed blocks. The default CPU allocator takes each
# large tensor from malloc, which maps it fresh (glibc maps blocks above
# 32 MB) and pays a page fault on every 4 KB of it, every step; the pool
# does not (docs/architecture.md, "Memory allocation"). Both are
# read when TensorFlow starts, so they must be in the environment before
# ``import tensorflow``.
TASK_ENV_DEFAULTS = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_CPU_ALLOCATOR_USE_BFC": "true"}


def set_task_env_defaults(env):
    """Adds :data:`TASK_ENV_DEFAULTS` to ``env`` (a dict or ``os.environ``), keeping set values."""
    for name, value in TASK_ENV_DEFAULTS.items():
        env.setdefault(name, value)
    return env


class TFConfigError(ValueError):
    """A malformed ``TF_CONFIG``; the message names the offending field."""


def _check_address(job, index, address):
    field = f"cluster.{job}[{index}]"
    if not isinstance(address, str) or address.count(":") != 1:
        raise TFConfigError(f"TF_CONFIG field {field}: expected 'host:port', got {address!r}")
    host, port = address.split(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise TFConfigError(
            f"TF_CONFIG field {field}: expected 'host:port' with a port in "
            f"1..65535, got {address!r}"
        )


def parse_tf_config(text=None, *, require_jobs=()):
    """Parses and validates a ``TF_CONFIG`` JSON string.

    Args:
      text: the JSON text; defaults to the ``TF_CONFIG`` environment variable.
      require_jobs: job names that must be present and non-empty (for example
        ``("ps", "worker")`` for a parameter-server strategy).

    Returns:
      ``(cluster, task_type, task_index)`` where ``cluster`` maps job name to a
      list of addresses.

    Raises:
      TFConfigError: naming the field that is wrong.
    """
    config = _load(text)
    cluster = config.get("cluster")
    _check_cluster(cluster, require_jobs)
    task_type, index = _check_task(config.get("task"), cluster)
    return cluster, task_type, index


def _load(text):
    if text is None:
        text = os.environ.get("TF_CONFIG")
        if text is None:
            raise TFConfigError("TF_CONFIG is not set")
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise TFConfigError(f"TF_CONFIG is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise TFConfigError("TF_CONFIG must be a JSON object")
    return config


def _check_cluster(cluster, require_jobs):
    if not isinstance(cluster, dict) or not cluster:
        raise TFConfigError(
            "TF_CONFIG field cluster: expected a non-empty object mapping "
            "job names to address lists"
        )
    seen = {}  # address -> the field that named it first
    for job, addresses in cluster.items():
        if job not in KNOWN_JOBS:
            raise TFConfigError(
                f"TF_CONFIG field cluster.{job}: unknown job {job!r} "
                f"(expected one of {', '.join(KNOWN_JOBS)})"
            )
        if not isinstance(addresses, list) or not addresses:
            raise TFConfigError(
                f"TF_CONFIG field cluster.{job}: expected a non-empty list of 'host:port' addresses"
            )
        for i, address in enumerate(addresses):
            _check_address(job, i, address)
            if address in seen:
                raise TFConfigError(
                    f"TF_CONFIG field cluster.{job}[{i}]: {address!r} is also "
                    f"{seen[address]}; every task needs its own host:port"
                )
            seen[address] = f"cluster.{job}[{i}]"
    if len(cluster.get("chief", ())) > 1:
        raise TFConfigError(
            f"TF_CONFIG field cluster.chief: a cluster has one chief, got "
            f"{len(cluster['chief'])}; make the others workers"
        )
    for job in require_jobs:
        if job not in cluster:
            raise TFConfigError(
                f"TF_CONFIG field cluster.{job}: missing; this strategy needs a {job!r} job"
            )


def _check_task(task, cluster):
    if not isinstance(task, dict):
        raise TFConfigError("TF_CONFIG field task: expected an object with 'type' and 'index'")
    task_type = task.get("type")
    if task_type not in cluster:
        raise TFConfigError(
            f"TF_CONFIG field task.type: {task_type!r} is not a job of the "
            f"cluster (jobs: {', '.join(sorted(cluster))})"
        )
    index = task.get("index", 0)
    if isinstance(index, bool) or not isinstance(index, int):
        raise TFConfigError(f"TF_CONFIG field task.index: expected an integer, got {index!r}")
    if not 0 <= index < len(cluster[task_type]):
        raise TFConfigError(
            f"TF_CONFIG field task.index: {index} is out of range for job "
            f"{task_type!r} with {len(cluster[task_type])} task(s)"
        )
    return task_type, index
