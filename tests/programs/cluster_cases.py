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


CASES = {fn.__name__: fn for fn in (hold_cluster, talk_to_tasks, server_wait)}


def main(argv):
    """``CASE [ARGS]``: runs the case of that name with ARGS."""
    name, *args = argv
    CASES[name](*args)


if __name__ == "__main__":
    main(sys.argv[1:])
