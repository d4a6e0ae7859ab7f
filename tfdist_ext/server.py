"""Runs one task of a TensorFlow cluster: ``python -m tfdist_ext.server``.

The task is described by ``TF_CONFIG`` exactly as TensorFlow documents it::

    TF_CONFIG='{"cluster": {"worker": ["127.0.0.1:2222"], "ps": ["127.0.0.1:2223"]},
                "task": {"type": "ps", "index": 0}}' python -m tfdist_ext.server

The process starts a ``tf.distribute.Server`` (gRPC) for that task, prints
one warning naming its unauthenticated port (see SECURITY.md; ``--no-warning``
omits it), then ``READY <job>:<index> <address>`` on standard output, and
serves until SIGTERM or Ctrl-C (SIGINT, one line, no traceback). TensorFlow's
start-up notices (the absl pre-init warning, the oneDNN line) are dropped;
every other line reaches standard error. A malformed ``TF_CONFIG`` prints one
line naming the field and exits with status 2. The same entry point is the console script
``tfdist-ext server``; :class:`tfdist_ext.cluster.LocalCluster` starts every
task of a local cluster through it.
"""

import argparse
import os
import select
import signal
import sys
import threading
import time

from tfdist_ext._stderr import TF_START_UP_NOISE
from tfdist_ext._stderr import native_log_without
from tfdist_ext.cluster._process import PORT_TAKEN_LOG
from tfdist_ext.cluster._process import port_taken
from tfdist_ext.cluster._tf_config import PARENT_PID_ENV
from tfdist_ext.cluster._tf_config import TFConfigError
from tfdist_ext.cluster._tf_config import parse_tf_config
from tfdist_ext.cluster._tf_config import set_task_env_defaults


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


_SECURITY_WARNING = (
    "tfdist-ext server: WARNING: port {port} accepts unauthenticated gRPC from anyone "
    "who can reach it on any interface, and runs any graph sent to it (file reads, "
    "writes and code execution on this host); run it only on a trusted private "
    "network. See SECURITY.md."
)
_EPILOG = """\
TF_CONFIG (required) is the JSON TensorFlow documents for multi-worker training:
  {"cluster": {"worker": ["host1:2222", "host2:2222"], "ps": ["host3:2222"]},
   "task": {"type": "worker", "index": 0}}
The task listens on the port of its own address, on every interface, and
prints "READY <job>:<index> <address>" once it serves. It runs until SIGTERM or
Ctrl-C (SIGINT). Its gRPC port is unauthenticated: see SECURITY.md.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tfdist-ext server",
        description="Run the one TensorFlow cluster task (a tf.distribute.Server) "
        "that the TF_CONFIG environment variable describes.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--intra-op-threads",
        type=int,
        default=0,
        help="threads for one op (0: TensorFlow's default)",
    )
    parser.add_argument(
        "--inter-op-threads",
        type=int,
        default=0,
        help="ops run at once (0: number of workers + 1)",
    )
    parser.add_argument(
        "--cpu-devices",
        type=int,
        default=1,
        help="CPU devices the task exposes (for model parallelism inside a task)",
    )
    parser.add_argument(
        "--strategy",
        choices=("any", "ps"),
        default="any",
        help="'ps' requires the cluster to have 'ps' and 'worker' jobs",
    )
    parser.add_argument(
        "--no-warning",
        action="store_true",
        help="do not print the security warning (LocalCluster gives its own)",
    )
    return parser


def _serve(args):
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
            print(f"tfdist-ext server: error: {name} must be >= {low}", file=sys.stderr)
            return 2

    parent = os.environ.get(PARENT_PID_ENV)
    if parent:
        _watch_parent(int(parent))
    # Before anyone can know the task is up (READY), so no signal sent after
    # it can arrive before the wakeup fd exists.
    wakeup = _signal_wakeup()

    set_task_env_defaults(os.environ)
    _skip_tensorflows_keras_import()
    # A port another process holds is said in one line below, not in gRPC's two.
    with native_log_without(TF_START_UP_NOISE + PORT_TAKEN_LOG):
        # After the task's environment is set: TensorFlow reads it when it loads.
        import tensorflow as tf

        inter_op = args.inter_op_threads or len(cluster.get("worker", ())) + 1
        config = tf.compat.v1.ConfigProto(
            inter_op_parallelism_threads=inter_op,
            intra_op_parallelism_threads=args.intra_op_threads,
            device_count={"CPU": args.cpu_devices},
        )
        address = cluster[task_type][task_index]
        server = _start_server(tf, cluster, task_type, task_index, config)
    if server is None:
        return 2
    if not args.no_warning:
        print(
            _SECURITY_WARNING.format(port=address.rsplit(":", 1)[-1]), file=sys.stderr, flush=True
        )
    print(f"READY {task_type}:{task_index} {address}", flush=True)
    _wait_for_a_signal(server, wakeup)


def _start_server(tf, cluster, task_type, task_index, config):
    """The task's started ``tf.distribute.Server``, or None (said in one line)
    when another process holds its address."""
    try:
        return tf.distribute.Server(
            tf.train.ClusterSpec(cluster),
            job_name=task_type,
            task_index=task_index,
            protocol="grpc",
            config=config,
            start=True,
        )
    except tf.errors.UnknownError as e:
        if not port_taken(e):
            raise
        print(
            f"tfdist-ext server: error: task {task_type}:{task_index} cannot listen on "
            f"{cluster[task_type][task_index]}: another process holds that port (two "
            "tasks given the same TF_CONFIG task index?)",
            file=sys.stderr,
        )
        return None


def _skip_tensorflows_keras_import():
    """Lets ``import tensorflow`` in this process skip importing Keras.

    TensorFlow's ``__init__`` imports Keras's optimizers eagerly (so that they
    register for SavedModel loading), inside a ``try`` that passes over an
    ``ImportError``; with ``TF_USE_LEGACY_KERAS=1`` it looks for ``tf_keras``
    instead. A task only runs the graphs the chief sends and never builds or
    loads a Keras object, so when ``tf_keras`` is not installed, setting that
    public switch here (this process only) saves the import of all of Keras:
    about 2 s of a task's start on a 2-core machine. ``tf.keras`` is then
    unusable in the task, and nothing in it uses it; ``import keras`` works
    as usual. A value the user set is left alone.
    """
    # Only when the task starts: importing tfdist_ext.server stays cheap.
    import importlib.util

    if "TF_USE_LEGACY_KERAS" not in os.environ and importlib.util.find_spec("tf_keras") is None:
        os.environ["TF_USE_LEGACY_KERAS"] = "1"


def _signal_wakeup():
    """Returns the read end of a pipe that gets a byte whenever a signal arrives.

    The byte is written by CPython's C-level handler in whichever thread the
    kernel gave the signal to (``signal.set_wakeup_fd``); set it up before the
    task reports itself ready.
    """
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end)
    return read_end


def _wait_for_a_signal(server, wakeup, poll_seconds=1.0):
    """Serves (keeps ``server`` referenced) until a signal's Python handler runs here.

    The kernel may deliver SIGINT to any of TensorFlow's threads. CPython's
    C handler then only marks the signal pending; the main thread notices it
    when it next takes the GIL, and not while blocked in a read or a sleep.
    The wakeup pipe (:func:`_signal_wakeup`) ends the wait at once, and a
    ``poll_seconds`` timeout bounds it even for a signal that came before
    the pipe existed (no byte written): each return retakes the GIL, and the
    pending handler then raises here.
    """
    while server is not None:
        readable, _, _ = select.select([wakeup], [], [], poll_seconds)
        if readable:
            os.read(wakeup, 64)


def main(argv: list[str] | None = None) -> int:
    """Runs the task; Ctrl-C (SIGINT) stops it like SIGTERM, with one line."""
    args = build_parser().parse_args(argv)
    # Also when started with SIGINT ignored (as `cmd &` does in a script).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return _serve(args)
    except KeyboardInterrupt:
        print("tfdist-ext server: interrupted, stopping", file=sys.stderr, flush=True)
        # A gRPC server has no clean stop; end the way SIGTERM does (a full
        # interpreter shutdown with the server running takes seconds).
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 130


if __name__ == "__main__":
    sys.exit(main())
