"""A chief process with an isolated (or a loopback) LocalCluster, as
``tests/test_netns.py`` checks it: ``python -m tests.programs.netns_cases CASE``.

Each case imports what it uses itself: the unprivileged ones run with every
capability dropped and need no more than ``tfdist_ext.cluster``.
"""

import sys

from tests.programs import report


def transfer_at_link_rate():
    """Seconds of three reads of a 10 MiB ps variable by an op on the worker, at
    100 Mbit/s links, and of one read of a 4-float one (the overhead)."""
    import time

    import tensorflow as tf

    from tfdist_ext.cluster import LocalCluster
    from tfdist_ext.cluster import connect

    with LocalCluster(num_workers=1, num_ps=1, bandwidth="100mbit") as cluster:
        connect(cluster.resolver)
        with tf.device("/job:ps/task:0"):
            v = tf.Variable(tf.ones([2_621_440]))  # 10 MiB of float32
            small = tf.Variable(tf.ones([4]))

        @tf.function
        def pull(var):
            with tf.device("/job:worker/task:0"):
                return tf.reduce_sum(tf.identity(var))

        pull(small).numpy()
        times = []
        for _ in range(3):
            start = time.monotonic()
            pull(v).numpy()
            times.append(time.monotonic() - start)
        start = time.monotonic()
        pull(small).numpy()
        overhead = time.monotonic() - start
    report({"times": times, "overhead": overhead})


def isolated_ports():
    """Starts an isolated cluster, connects this process's runtime (its own server
    listens on the chief's port), reports the spec and which addresses answered
    from inside, then waits for a line on stdin while the test looks."""
    import socket

    import tensorflow as tf

    from tfdist_ext.cluster import LocalCluster
    from tfdist_ext.cluster import connect

    with LocalCluster(num_workers=2, num_ps=1) as cluster:
        connect(cluster.resolver)
        with tf.device("/job:ps/task:0"):
            variable = tf.Variable(1.0)
        spec = cluster.cluster_spec.as_dict()
        answered = {}
        for addresses in spec.values():
            for a in addresses:
                host, port = a.split(":")
                with socket.create_connection((host, int(port)), timeout=5):
                    answered[a] = True
        report({"spec": spec, "answered": answered})
        sys.stdin.readline()
        del variable  # held on the ps task until the test has looked


def fit_until_killed():
    """Downpour fit on an isolated cluster at 100 Mbit/s links, for ever; at its
    6th batch it reports the task pids and every network namespace the cluster
    holds (the test SIGKILLs this process then)."""
    import os

    import keras

    import tfdist_ext
    from tfdist_ext import datasets
    from tfdist_ext.cluster import LocalCluster

    cluster = LocalCluster(num_workers=2, num_ps=1, bandwidth="100mbit").start()
    namespaces = {os.readlink(f"/proc/{p}/ns/net") for p in cluster.pids()}
    namespaces.add(os.readlink("/proc/thread-self/ns/net"))  # the hub
    strategy = tfdist_ext.DownpourStrategy(cluster.resolver)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)]
        )
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    class Announce(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 5:
                report({"pids": cluster.pids(), "namespaces": sorted(namespaces)})

    ds = datasets.digits("train", flatten=True).batch(32).repeat()
    model.fit(ds, epochs=1000, steps_per_epoch=100, verbose=0, callbacks=[Announce()])


def refusals_without_privileges():
    """Without CAP_NET_ADMIN and CAP_SYS_ADMIN: the errors of an isolated and of a
    rate-limited cluster, and whether the default cluster is isolated."""
    from tfdist_ext.cluster import ClusterError
    from tfdist_ext.cluster import LocalCluster

    refusals = []
    for kwargs in ({"isolated": True}, {"bandwidth": "100mbit"}):
        try:
            LocalCluster(num_workers=1, num_ps=0, **kwargs)
        except ClusterError as e:
            refusals.append(f"{kwargs} {e}")
    default = LocalCluster(num_workers=1, num_ps=0).isolated
    report({"refusals": refusals, "default_isolated": default})


def loopback_warnings():
    """Two loopback clusters in one process, logging to stderr: the first one's port."""
    import logging

    from tfdist_ext.cluster import LocalCluster

    logging.basicConfig(format="LOG %(message)s")
    with LocalCluster(num_workers=1, num_ps=0) as cluster:
        assert not cluster.isolated
        port = cluster.address("worker", 0).split(":")[1]
    with LocalCluster(num_workers=1, num_ps=0):
        pass
    report({"port": port})


def _refusal(**kwargs):
    """The ClusterError of ``LocalCluster(num_workers=1, num_ps=0, **kwargs)``, or None."""
    from tfdist_ext.cluster import ClusterError
    from tfdist_ext.cluster import LocalCluster

    try:
        LocalCluster(num_workers=1, num_ps=0, **kwargs)
    except ClusterError as e:
        return str(e)
    return None


def isolated_then_loopback():
    """An isolated cluster, then a loopback one asked for, then the default one
    (reported from inside its block: it started)."""
    from tfdist_ext.cluster import LocalCluster

    with LocalCluster(num_workers=1, num_ps=0, isolated=True):
        pass
    refused = _refusal(isolated=False)
    with LocalCluster(num_workers=1, num_ps=0):  # the default follows the first
        report({"refused": refused})


def loopback_then_isolated():
    """A loopback cluster, then whether the default is isolated, then a rate-limited one."""
    from tfdist_ext.cluster import LocalCluster

    with LocalCluster(num_workers=1, num_ps=0, isolated=False):
        pass
    default = LocalCluster(num_workers=1, num_ps=0).isolated
    report({"default_isolated": default, "refused": _refusal(bandwidth="10mbit")})


CASES = {
    fn.__name__: fn
    for fn in (
        transfer_at_link_rate,
        isolated_ports,
        fit_until_killed,
        refusals_without_privileges,
        loopback_warnings,
        isolated_then_loopback,
        loopback_then_isolated,
    )
}


def main(argv):
    """``CASE``: runs the case of that name."""
    name, *args = argv
    CASES[name](*args)


if __name__ == "__main__":
    main(sys.argv[1:])
