"""``TF_CONFIG`` for a task, from where the cluster manager started it (internal).

Every launcher ends in the same place: a process whose ``TF_CONFIG`` names
the cluster and its own task, which is all a strategy reads. The tasks are
ordered as TensorFlow's ``SlurmClusterResolver`` orders them, by job name:
``chief`` (one, when there are ``ps`` tasks), then ``ps``, then ``worker``.
With no ``ps`` tasks every task is a ``worker`` (``MultiWorkerMirroredStrategy``).

* ``TF_CONFIG`` already set: used as it is.
* Slurm (``SLURM_PROCID`` set, e.g. under ``srun``): TensorFlow's
  ``SlurmClusterResolver`` reads ``SLURM_STEP_NODELIST`` and
  ``SLURM_STEP_TASKS_PER_NODE``; the ports count up from ``port`` on a node.
* Kubernetes indexed Job (``JOB_COMPLETION_INDEX`` set): the task is that
  index; ``TFDIST_NUM_TASKS`` is the Job's ``completions`` and
  ``TFDIST_HOST_PATTERN`` the pods' names with ``{index}``
  (``train-{index}.train`` for a Job ``train`` whose headless Service is
  ``train``).
"""

import json
import os


class ClusterEnvironmentError(ValueError):
    """The environment does not describe a cluster task."""


def jobs(num_tasks, num_ps):
    """``{job: count}`` for ``num_tasks`` tasks of which ``num_ps`` are ``ps``."""
    if num_ps < 0 or num_tasks < 1:
        raise ClusterEnvironmentError(
            f"need at least one task and num_ps >= 0, got {num_tasks}, {num_ps}"
        )
    if not num_ps:
        return {"worker": num_tasks}
    if num_tasks < num_ps + 2:
        raise ClusterEnvironmentError(
            f"{num_tasks} tasks cannot hold a chief, {num_ps} ps and at least one worker"
        )
    return {"chief": 1, "ps": num_ps, "worker": num_tasks - 1 - num_ps}


def from_addresses(addresses, rank, num_ps):
    """The ``TF_CONFIG`` dict of task ``rank`` of a cluster at ``addresses``."""
    cluster, start = {}, 0
    for job, count in sorted(jobs(len(addresses), num_ps).items()):
        cluster[job] = list(addresses[start : start + count])
        if start <= rank < start + count:
            task = {"type": job, "index": rank - start}
        start += count
    if not 0 <= rank < len(addresses):
        raise ClusterEnvironmentError(f"task {rank} is not one of the {len(addresses)} tasks")
    return {"cluster": cluster, "task": task}


def tf_config(env, num_ps=0, port=2222):
    """The task's ``TF_CONFIG`` dict from ``env`` (an environment mapping)."""
    if env.get("TF_CONFIG"):
        return json.loads(env["TF_CONFIG"])
    if "SLURM_PROCID" in env:
        return _slurm(env, num_ps, port)
    if "JOB_COMPLETION_INDEX" in env:
        return _kubernetes(env, num_ps, port)
    raise ClusterEnvironmentError(
        "no cluster in the environment: set TF_CONFIG, or start the task with srun "
        "(SLURM_PROCID) or as a Kubernetes indexed Job (JOB_COMPLETION_INDEX)"
    )


def _kubernetes(env, num_ps, port):
    missing = [name for name in ("TFDIST_NUM_TASKS", "TFDIST_HOST_PATTERN") if not env.get(name)]
    if missing:
        raise ClusterEnvironmentError(
            f"a Kubernetes indexed Job's pod needs {' and '.join(missing)} in its environment "
            "(see deploy/kubernetes.yaml)"
        )
    count, pattern = int(env["TFDIST_NUM_TASKS"]), env["TFDIST_HOST_PATTERN"]
    if "{index}" not in pattern:
        raise ClusterEnvironmentError(
            f"TFDIST_HOST_PATTERN must contain {{index}}, got {pattern!r}"
        )
    addresses = [f"{pattern.format(index=i)}:{port}" for i in range(count)]
    return from_addresses(addresses, int(env["JOB_COMPLETION_INDEX"]), num_ps)


def _slurm(env, num_ps, port):
    # Only for Slurm (TensorFlow's SlurmClusterResolver): the other environments need none.
    import tensorflow as tf

    saved = dict(os.environ)
    os.environ.update(env)  # TensorFlow's resolver reads os.environ
    try:
        count = int(env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"])
        visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
        resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(
            jobs=jobs(count, num_ps),
            port_base=port,
            # Without GPUs, TensorFlow's per-task GPU split would run nvidia-smi
            # and place one task per node; a count this large places them all.
            gpus_per_node=len(visible) or 1024,
            gpus_per_task=None if visible else 1,
            auto_set_gpu=bool(visible),
        )
        cluster = resolver.cluster_spec().as_dict()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return {"cluster": cluster, "task": {"type": resolver.task_type, "index": resolver.task_id}}


def runs_command(config):
    """Whether the task runs the user's program (the chief, or a worker of a
    cluster without ``ps``), not ``tfdist-ext server``."""
    kind = config["task"]["type"]
    return kind == "chief" or (kind == "worker" and "ps" not in config["cluster"])
