"""Runs one task of a TensorFlow cluster: ``python -m tfdist_ext.server``.

The task is described by ``TF_CONFIG`` exactly as TensorFlow documents it::

    TF_CONFIG='{"cluster": {"worker": ["127.0.0.1:2222"], "ps": ["127.0.0.1:2223"]},
                "task": {"type": "ps", "index": 0}}' python -m tfdist_ext.server

The process starts a ``tf.distribute.Server`` (gRPC) for that task, prints
``READY <job>:<index> <address>`` on standard output and serves until it is
killed. A malformed ``TF_CONFIG`` prints one line naming the field and exits
with status 2. The same entry point is the console script
``tfdist-ext server``; :class:`tfdist_ext.cluster.LocalCluster` starts every
task of a local cluster through it.
"""

import argparse
import os
import signal
import sys
import threading
import time

from tfdist_ext.cluster._tf_config import PARENT_PID_ENV
from tfdist_ext.cluster._tf_config import TFConfigError
from tfdist_ext.cluster._tf_config import parse_tf_config


def _watch_parent(parent_pid, interval=0.5):
    """Stops this task once its parent is gone (this process was re-parented).

    The task is stopped the way ``LocalCluster.stop`` stops it, with SIGTERM:
    a gRPC ``tf.distribute.Server`` has no clean stop of its own, and a full
    interpreter shutdown with the server running takes seconds.
    """
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(interval)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def build_parser():
    parser = argparse.ArgumentParser(
        prog="tfdist-ext server",
        description="Run the TensorFlow task that TF_CONFIG describes.",
    )
    parser.add_argument(
        "--intra-op-threads", type=int, default=0,
        help="threads for one op (0: TensorFlow's default)",
    )
    parser.add_argument(
        "--inter-op-threads", type=int, default=0,
        help="ops run at once (0: number of workers + 1)",
    )
    parser.add_argument(
        "--cpu-devices", type=int, default=1,
        help="CPU devices the task exposes (for model parallelism inside a task)",
    )
    parser.add_argument(
        "--strategy", choices=("any", "ps"), default="any",
        help="'ps' requires the cluster to have 'ps' and 'worker' jobs",
    )
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    require = ("ps", "worker") if args.strategy == "ps" else ()
    try:
        cluster, task_type, task_index = parse_tf_config(require_jobs=require)
    except TFConfigError as e:
        print(f"tfdist-ext server: error: {e}", file=sys.stderr)
        return 2
    for name, value in (
        ("--intra-op-threads", args.intra_op_threads),
        ("--inter-op-threads", args.inter_op_threads),
        ("--cpu-devices", args.cpu_devices - 1),
    ):
        if value < 0:
            low = 1 if name == "--cpu-devices" else 0
            print(f"tfdist-ext server: error: {name} must be >= {low}",
                  file=sys.stderr)
            return 2

    parent = os.environ.get(PARENT_PID_ENV)
    if parent:
        _watch_parent(int(parent))

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    inter_op = args.inter_op_threads or len(cluster.get("worker", ())) + 1
    config = tf.compat.v1.ConfigProto(
        inter_op_parallelism_threads=inter_op,
        intra_op_parallelism_threads=args.intra_op_threads,
        device_count={"CPU": args.cpu_devices},
    )
    server = tf.distribute.Server(
        tf.train.ClusterSpec(cluster),
        job_name=task_type,
        task_index=task_index,
        protocol="grpc",
        config=config,
        start=True,
    )
    address = cluster[task_type][task_index]
    print(f"READY {task_type}:{task_index} {address}", flush=True)
    server.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
