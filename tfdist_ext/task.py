"""``tfdist-ext task -- COMMAND``: run one task of a job where a cluster manager started it.

The same line runs on every task (under ``srun``, in a Kubernetes indexed
Job's pods, or as ``tfdist-ext launch`` starts it): it finds the task's
``TF_CONFIG`` (already set, or derived from Slurm's or Kubernetes's
environment, see :mod:`tfdist_ext.cluster._environments`), then becomes
COMMAND (the chief, or every worker when there is no ``ps`` job) or
``tfdist-ext server`` (the ``ps`` tasks and the workers of a parameter-server
job), with ``TF_CONFIG`` set. The user's program is unchanged: it reads
``TF_CONFIG`` as TensorFlow's strategies do.

Example (Slurm, 1 chief, 1 ps, 2 workers)::

    srun --ntasks 4 tfdist-ext task --ps 1 -- python train.py
"""

import argparse
import json
import os
import sys

from tfdist_ext import launch
from tfdist_ext.cluster import _environments
from tfdist_ext.cluster._tf_config import set_task_env_defaults


def build_parser():
    parser = argparse.ArgumentParser(
        prog="tfdist-ext task",
        usage="%(prog)s [--ps N] [--port P] -- COMMAND [ARGS...]",
        description="Run this task of a job: COMMAND, or a tfdist-ext server, with TF_CONFIG "
        "set from TF_CONFIG, Slurm's SLURM_* or a Kubernetes indexed Job's environment.",
    )
    launch.add_job_options(parser)
    return parser


def main(argv=None):
    args, command = launch.parse_args(build_parser(), argv)
    try:
        config = _environments.tf_config(os.environ, args.ps, args.port)
    except (_environments.ClusterEnvironmentError, ValueError, KeyError) as e:
        print(f"tfdist-ext task: error: {e}", file=sys.stderr)
        return 2
    env = dict(os.environ, TF_CONFIG=json.dumps(config))
    set_task_env_defaults(env)  # TensorFlow's start-up notices off, as in LocalCluster
    if not _environments.runs_command(config):
        command = [sys.executable, "-m", "tfdist_ext.server"]
    elif not command:
        return launch.no_command("tfdist-ext task")
    sys.stdout.flush()
    os.execvpe(command[0], command, env)


if __name__ == "__main__":
    sys.exit(main())
