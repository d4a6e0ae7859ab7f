"""A process that starts a LocalCluster, or the ``tfdist-ext server``'s wait, as
``tests/test_cluster.py`` checks them: ``python -m tests.programs.cluster_cases
CASE [ARGS]``.

Each case imports what it uses itself: ``server_wait`` must not load more
than the server module does.
"""

import sys
import time

from tests.programs import report


def hold_cluster():
    """Starts a cluster, reports its task pids and hangs (the test SIGKILLs this process)."""
    from tfdist_ext.cluster import LocalCluster

    cluster = LocalCluster(num_workers=2, num_ps=1).start()
    report({"pids": cluster.pids()})
    time.sleep(600)


def talk_to_tasks():
    """Connects TensorFlow's runtime to a cluster and runs an op on every task:
    ``"JOB INDEX DEVICE VALUES"`` for each."""
    import tensorflow as tf

    from tfdist_ext.cluster import LocalCluster
    from tfdist_ext.cluster import connect

    seen = []
    with LocalCluster(num_workers=2, num_ps=1) as cluster:
        connect(cluster.resolver)
        for job, n in (("worker", 2), ("ps", 1)):
            for i in range(n):
                with tf.device(f"/job:{job}/replica:0/task:{i}/device:CPU:0"):
                    x = tf.constant([1.0, 2.0]) * (i + 1)
                seen.append(f"{job} {i} {x.device} {x.numpy().tolist()}")
    report({"seen": seen})


def server_wait(byte):
    """A SIGINT that one of the process's other threads took before the server's
    wait started; where the KeyboardInterrupt was raised.

    A thread parked in a read (restarted after the handler, so it never needs
    the GIL: a native thread) takes the SIGINT while the main thread holds the
    GIL; then the server's wait starts. ``byte`` ``written``: the wakeup pipe
    (set up before READY) has the handler's byte; ``lost``: no byte (a signal
    before the pipe existed), the poll ends it.
    """
    import os
    import signal
    import threading
    import traceback

    from tfdist_ext import server

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.siginterrupt(signal.SIGINT, False)
    idle, _ = os.pipe()
    taker = threading.Thread(target=os.read, args=(idle, 1), daemon=True)
    taker.start()
    time.sleep(0.2)
    wakeup = server._signal_wakeup()
    if byte == "lost":
        signal.set_wakeup_fd(-1)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    # On a loaded machine the main thread may run the handler before the
    # wait starts (the scenario did not happen): try again, at most 3 times.
    for attempt in range(3):
        try:
            signal.pthread_kill(taker.ident, signal.SIGINT)
            end = time.monotonic() + 0.3
            while time.monotonic() < end:  # holds the GIL
                pass
            # "written" can only end by the byte (a poll past the deadline).
            poll = 600 if byte == "written" else 0.5
            server._wait_for_a_signal(object(), wakeup, poll_seconds=poll)
        except KeyboardInterrupt:
            where = traceback.extract_tb(sys.exc_info()[2])[-1].name
            if where == "_wait_for_a_signal" or attempt == 2:
                report({"interrupted_in": where})
                return


def chief(spec_json, sign, stop_file):
    """A Downpour chief on the cluster ``spec_json`` fitting ``y = sign * sum(x)``.

    Prints ``TRAINING`` after each epoch and trains on, for 20 epochs at least,
    until ``stop_file`` exists; reports its final kernel, or the type and text of its error.
    """
    import json
    import os

    import keras
    import numpy as np
    import tensorflow as tf

    from tfdist_ext import DownpourStrategy

    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(json.loads(spec_json)), task_type="chief", task_id=0
    )

    def until_told(epoch, logs):
        print("TRAINING", flush=True)
        model.stop_training = epoch >= 19 and os.path.exists(stop_file)

    x = np.random.RandomState(0).randn(256, 4).astype("float32")
    y = float(sign) * x.sum(axis=1, keepdims=True)
    try:
        strategy = DownpourStrategy(resolver, deadline=20)
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(keras.optimizers.SGD(0.05), "mse")
        model.fit(
            x,
            y,
            batch_size=32,
            epochs=10_000,
            verbose=0,
            callbacks=[keras.callbacks.LambdaCallback(on_epoch_end=until_told)],
        )
        strategy.close()
    except Exception as e:  # noqa: BLE001 -- the test reads which error
        report({"error": type(e).__name__, "message": str(e)})
        return
    report({"error": None, "kernel": model.get_weights()[0].ravel().tolist()})


def second_chief(stop_file):
    """A first chief trains on a LocalCluster; a second chief (another address)
    starts meanwhile; a third starts after the first has ended. Reports each
    chief's RESULT (see :func:`chief`) and the first's exit code."""
    import json
    import pathlib
    import subprocess

    from tests.programs import program_command
    from tests.programs import result_of
    from tfdist_ext.cluster import LocalCluster
    from tfdist_ext.cluster import free_port

    def run(spec, sign):
        command = program_command("cluster_cases", "chief", json.dumps(spec), sign, stop_file)
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        return result_of(done.stdout)

    # The chiefs start from this thread: with an isolated cluster it is in its network.
    with LocalCluster(num_workers=1, num_ps=1, verbose=0) as cluster:
        spec = cluster.cluster_spec.as_dict()
        host = spec["chief"][0].rsplit(":", 1)[0]
        other = dict(spec, chief=[f"{host}:{free_port()}"])
        command = program_command("cluster_cases", "chief", json.dumps(spec), 1, stop_file)
        first = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        try:
            training = "TRAINING" in first.stdout.readline()
            second = run(other, -1)
            pathlib.Path(stop_file).touch()
            out, _ = first.communicate(timeout=120)
        finally:
            first.kill()
        third = run(other, -1)
    report(
        {
            "first_chief": spec["chief"][0],
            "training": training,
            "first": result_of(out),
            "first_exit": first.returncode,
            "second": second,
            "third": third,
        }
    )


CASES = {fn.__name__: fn for fn in (hold_cluster, talk_to_tasks, server_wait, chief, second_chief)}


def main(argv):
    """``CASE [ARGS]``: runs the case of that name with ARGS."""
    name, *args = argv
    CASES[name](*args)


if __name__ == "__main__":
    main(sys.argv[1:])
