"""README-style scripts on a LocalCluster, as ``tests/test_lifecycle.py`` runs
them: ``python -m tests.programs.lifecycle_cases CASE [ARGS]``.

What the tests check is how the process ends: its exit status, how long it
takes to end after the ``with LocalCluster`` block (each case prints
:data:`LEFT` and the time on leaving it, and again as its last line when it
goes on after it), stderr, and the model after the block. So, as a script's
globals do, what a case returns (its cluster, strategy and model) stays
referenced until the interpreter exits.
"""

import sys
import time

import keras
import numpy as np

import tfdist_ext
from tests.programs import report
from tfdist_ext import datasets

LEFT = "LEFT_CLUSTER_BLOCK"


class KillWorker(keras.callbacks.Callback):
    """Kills worker 1 at the end of epoch ``epoch`` (None: never), announcing its address."""

    def __init__(self, cluster, epoch):
        super().__init__()
        self.cluster, self.epoch = cluster, epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            print("KILLED", self.cluster.address("worker", 1), flush=True)
            self.cluster.kill("worker", 1)


def left_block():
    """Marks leaving the cluster block: on stdout with the time, and on stderr."""
    print(LEFT, time.time(), flush=True)
    print(LEFT, file=sys.stderr, flush=True)


def final_state(model, x_test, y_test):
    """What a user's model is at the end of fit, read while the cluster still runs."""
    return {
        "weights": model.get_weights(),
        "eval": model.evaluate(x_test, y_test, verbose=0),
        "logits": model.predict(x_test, verbose=0),
    }


def check_after_block(model, final, x_test, y_test, path):
    """After the block, in plain single-process mode: the model against its
    ``final_state``, saved to ``path`` and loaded, and trained once more."""
    weights = model.get_weights()
    logits = model.predict(x_test, verbose=0)
    evaluated = model.evaluate(x_test, y_test, verbose=0)
    model.save(path)
    reloaded = keras.models.load_model(path)
    try:
        model.fit(x_test[:8], np.zeros(8), epochs=1, verbose=0)
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    report(
        {
            "same_weights": all(np.array_equal(a, b) for a, b in zip(weights, final["weights"])),
            "n_weights": [len(weights), len(final["weights"])],
            "logits_diff": float(np.abs(logits - final["logits"]).max()),
            "evaluated": evaluated,
            "final_eval": final["eval"],
            "reloaded_diff": float(np.abs(reloaded.predict(x_test, verbose=0) - logits).max()),
            "refused": refused,
        }
    )
    print(LEFT, time.time(), flush=True)


def _downpour_fit(cluster, kill):
    strategy = tfdist_ext.DownpourStrategy(cluster.resolver, n_fetch=2, n_push=2)
    train = datasets.digits("train", flatten=True).shuffle(2048, seed=0).batch(32).repeat()
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]
        )
        model.compile(
            optimizer=keras.optimizers.Adagrad(0.05),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    callbacks = [KillWorker(cluster, 0 if kill else None)]
    model.fit(train, epochs=3, steps_per_epoch=25, verbose=0, callbacks=callbacks)
    return strategy, model


def downpour(variant, path=None):
    """Downpour fit; ``variant`` ``worker_killed`` kills worker 1 after epoch 0,
    ``plain`` goes on after the block (checks, saving to ``path``)."""
    kill = variant == "worker_killed"
    x_test, y_test = datasets.digits("test", flatten=True, as_numpy=True)
    keras.utils.set_random_seed(0)
    with tfdist_ext.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy, model = _downpour_fit(cluster, kill)
        final = None if kill else final_state(model, x_test, y_test)
    left_block()
    if not kill:
        check_after_block(model, final, x_test, y_test, path)
    return cluster, strategy, model


def downpour_lost_ps():
    """Downpour fit, then the parameter server killed and the cluster stopped."""
    keras.utils.set_random_seed(0)
    with tfdist_ext.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy, model = _downpour_fit(cluster, kill=False)
        cluster.kill("ps", 0)
        try:
            cluster.stop()
            error = None
        except tfdist_ext.cluster.ClusterError as e:
            error = str(e)
        report({"stop_error": error})
    left_block()
    return cluster, strategy, model


def sandblaster(variant, path=None):
    """Sandblaster L-BFGS fit; ``variant`` ``worker_killed`` kills worker 1 after
    epoch 2, ``plain`` goes on after the block (checks, saving to ``path``)."""
    kill = variant == "worker_killed"
    x_test, y_test = datasets.digits("test", flatten=True, as_numpy=True)
    x, y = datasets.digits("train", flatten=True, as_numpy=True)
    with tfdist_ext.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = tfdist_ext.SandblasterStrategy(cluster.resolver, slices_per_worker=4)
        with strategy.scope():
            model = keras.Sequential(
                [
                    keras.Input((64,)),
                    keras.layers.Dense(10, kernel_regularizer=keras.regularizers.L2(1e-3)),
                ]
            )
            model.compile(
                optimizer=tfdist_ext.optimizers.LBFGS(memory=10),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
            )
        model.fit(x, y, epochs=6, verbose=0, callbacks=[KillWorker(cluster, 2 if kill else None)])
        final = None if kill else final_state(model, x_test, y_test)
    left_block()
    if not kill:
        check_after_block(model, final, x_test, y_test, path)
    return cluster, strategy, model


def connected(ending):
    """connect()'s own example, no strategy: a ps variable read on a worker.
    ``ending`` ``with_block``: in a ``with LocalCluster`` block;
    ``left_to_exit``: a started cluster the script never stops."""
    import tensorflow as tf

    from tfdist_ext.cluster import LocalCluster
    from tfdist_ext.cluster import connect

    def read_on_a_worker(cluster):
        connect(cluster.resolver)
        with tf.device("/job:ps/task:0"):
            v = tf.Variable(1.0)

        @tf.function
        def f():
            with tf.device("/job:worker/task:0"):
                return v.read_value() * 2.0

        report({"value": float(f())})
        return v, f

    if ending == "with_block":
        with LocalCluster(num_workers=1, num_ps=1) as cluster:
            kept = read_on_a_worker(cluster)
    else:
        cluster = LocalCluster(num_workers=1, num_ps=1).start()
        kept = read_on_a_worker(cluster)
    print(LEFT, time.time(), flush=True)
    return cluster, kept


CASES = {fn.__name__: fn for fn in (downpour, downpour_lost_ps, sandblaster, connected)}


def main(argv):
    """``CASE [ARGS]``: runs the case of that name with ARGS; what it returns."""
    name, *args = argv
    return CASES[name](*args)


if __name__ == "__main__":
    kept = main(sys.argv[1:])  # referenced until the interpreter exits, as a script's globals
