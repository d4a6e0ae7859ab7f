"""How many steps one Downpour dispatch runs, and what a push sends:
``python -m tests.programs.downpour_dispatch_cases CASE``.

Each case (a function below) starts its own cluster, counts the rounds the
coordinator dispatches (:func:`count_rounds`) and prints one ``RESULT``
line for ``tests/test_downpour_dispatch.py`` to check.
"""

import sys

import keras
import numpy as np
import tensorflow as tf

import tfdist_ext
from tests.programs import report
from tests.programs.downpour_common import compiled
from tests.programs.downpour_common import digits_train
from tests.programs.downpour_common import mlp
from tests.programs.downpour_common import op_devices
from tfdist_ext import datasets
from tfdist_ext.cluster import LocalCluster


def count_rounds(strategy):
    """The steps of each Downpour round the coordinator dispatches from now
    on (a list it appends to)."""
    schedule = strategy.coordinator.schedule
    sizes = []

    def counting(fn, args=None, kwargs=None):
        if args and len(args) == 3:
            sizes.append(int(args[2]))
        return schedule(fn, args=args, kwargs=kwargs)

    strategy.coordinator.schedule = counting
    return sizes


def digits_model(steps_per_execution=1, metrics=None):
    model = mlp()
    model.compile(
        optimizer=keras.optimizers.Adagrad(0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=metrics,
        steps_per_execution=steps_per_execution,
    )
    return model


class _Batches(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(batch)


def many_steps_per_dispatch():
    """One worker, two epochs of 120 steps for each (n, steps_per_execution)."""
    keras.utils.set_random_seed(0)
    out = {}
    with LocalCluster(num_workers=1, num_ps=1) as cluster:
        # The background fetch: a round's last block fetches the next round's parameters.
        strategy = tfdist_ext.DownpourStrategy(cluster.resolver, background_fetch=True)
        sizes = count_rounds(strategy)
        for name, n, spe in (
            ("default-n1", 1, 1),
            ("default-n3", 3, 1),
            ("spe10-n1", 1, 10),
            ("spe4-n3", 3, 4),
        ):
            strategy.n_fetch = strategy.n_push = n
            strategy.stats.reset()
            del sizes[:]
            with strategy.scope():
                model = digits_model(spe, metrics=["accuracy"])
            batches = _Batches()
            h = model.fit(
                digits_train(), epochs=2, steps_per_epoch=120, verbose=0, callbacks=[batches]
            )
            s = strategy.stats.summary()
            out[name] = {
                "sizes": list(sizes),
                "batches": len(batches.seen),
                "loss": h.history["loss"],
                "steps": s["steps"],
                "pushes": s["pushes"],
                "fetches": s["fetches"],
                "prefetched": s["prefetched_rounds"],
                "iterations": int(model.optimizer.iterations.numpy()),
            }
        report(out)


class _FirstBatch(keras.callbacks.Callback):
    """The loss the callbacks see at each epoch's first batch."""

    def __init__(self):
        super().__init__()
        self.losses = []

    def on_epoch_begin(self, epoch, logs=None):
        self.marked = False

    def on_train_batch_end(self, batch, logs=None):
        if not self.marked:
            self.losses.append(float(logs["loss"]))
            self.marked = True


def _short_epochs(strategy, sizes, train):
    """Three epochs of 40 steps at n_fetch = n_push = 2 (the default rounds)."""
    with strategy.scope():
        model = compiled(mlp())
    h = model.fit(train, epochs=3, steps_per_epoch=40, verbose=0)
    s = strategy.stats.summary()
    return {
        "sizes": list(sizes),
        "per_worker": strategy.stats.steps_per_worker,
        "pushes": s["pushes"],
        "loss": h.history["loss"],
        "splits": op_devices(strategy, "SplitV"),
        "ps": [v.value.device for v in model.trainable_variables],
        "metric_counts": {
            m.name: float(m.variables[-1].numpy()) for m in model.metrics if m.name in ("loss",)
        },
    }


def short_epochs():
    """2 workers, epochs of 40 steps: default rounds, then steps_per_execution=10."""
    keras.utils.set_random_seed(0)
    with LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = tfdist_ext.DownpourStrategy(cluster.resolver, n_fetch=2, n_push=2)
        sizes = count_rounds(strategy)
        train = datasets.digits("train", flatten=True).shuffle(2048, seed=0)
        train = train.batch(32, drop_remainder=True).repeat()
        first = _short_epochs(strategy, sizes, train)
        # steps_per_execution = 10: a call's batches are shared by the idle
        # workers, and the chief waits for an epoch's first round.
        with strategy.scope():
            model = digits_model(10)
        strategy.stats.reset()
        del sizes[:]
        first_batch = _FirstBatch()
        model.fit(train, epochs=2, steps_per_epoch=40, verbose=0, callbacks=[first_batch])
        report(
            {
                **first,
                "spe_sizes": list(sizes),
                "spe_per_worker": strategy.stats.steps_per_worker,
                "first_batch_losses": first_batch.losses,
                "spe_steps": strategy.stats.summary()["steps"],
                "spe_iterations": int(model.optimizer.iterations.numpy()),
            }
        )


def overlapped_push_and_fetch():
    """One worker, a linear model whose loss is its mean output, for three
    (n_fetch, n_push): the bias, rounds, staleness and counts of each."""
    keras.utils.set_random_seed(0)
    out = {}
    with LocalCluster(num_workers=1, num_ps=1) as cluster:
        # The background fetch: a round's last block fetches the next round's parameters.
        strategy = tfdist_ext.DownpourStrategy(cluster.resolver, background_fetch=True)
        sizes = count_rounds(strategy)
        for n_fetch, n_push in ((1, 1), (2, 3), (4, 2)):
            strategy.n_fetch, strategy.n_push = n_fetch, n_push
            strategy.stats.reset()
            del sizes[:]
            with strategy.scope():
                model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(1)])
                model.compile(
                    optimizer=keras.optimizers.SGD(0.01), loss=lambda y, p: tf.reduce_mean(p)
                )
            model.fit(digits_train(), epochs=2, steps_per_epoch=50, verbose=0)
            s = strategy.stats.summary()
            out[f"{n_fetch},{n_push}"] = {
                "bias": float(model.layers[0].bias.numpy()[0]),
                "sizes": list(sizes),
                "staleness": [int(x) for x in strategy.stats.staleness],
                "pushes": s["pushes"],
                "fetches": s["fetches"],
                "prefetched": s["prefetched_rounds"],
                "iterations": int(model.optimizer.iterations.numpy()),
            }
        report(out)


class _SetAtSecondEpoch(keras.callbacks.Callback):
    def __init__(self, set_all):
        super().__init__()
        self.set_all = set_all

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:
            self.set_all(0.02)


def prefetched_until_weights_are_set():
    """One worker, 2 ps (the hidden kernel split), five fits of 2 epochs of 60
    steps; weights set before the third and at the fifth's second epoch."""
    with LocalCluster(num_workers=1, num_ps=2) as cluster:
        strategy = tfdist_ext.DownpourStrategy(
            cluster.resolver, min_shard_bytes=1024, background_fetch=True
        )
        data = digits_train()
        with strategy.scope():
            model = keras.Sequential(
                [keras.Input((64,)), keras.layers.Dense(64), keras.layers.Dense(1)]
            )
            model.compile(
                optimizer=keras.optimizers.SGD(0.01),
                loss=lambda y, p: tf.reduce_mean(p),
                steps_per_execution=20,
            )
        split = isinstance(model.layers[0].kernel.value, tfdist_ext._integration.ShardedVariable)

        def set_all(value):
            model.set_weights([np.full(w.shape, value, "float32") for w in model.get_weights()])

        out = []
        for what in ("first", "again", "set", "again", "callback"):
            if what == "set":
                set_all(0.01)
            bias = 0.02 if what == "callback" else float(model.layers[1].bias.numpy()[0])
            strategy.stats.reset()
            callbacks = [_SetAtSecondEpoch(set_all)] if what == "callback" else []
            model.fit(data, epochs=2, steps_per_epoch=60, verbose=0, callbacks=callbacks)
            s = strategy.stats.summary()
            out.append(
                {
                    "what": what,
                    "fetches": s["fetches"],
                    "prefetched": s["prefetched_rounds"],
                    "rounds": s["rounds"],
                    "staleness": list(strategy.stats.staleness),
                    "bias_before": bias,
                    "bias": float(model.layers[1].bias.numpy()[0]),
                }
            )
    report({"out": out, "split": split})


CASES = {
    fn.__name__: fn
    for fn in (
        many_steps_per_dispatch,
        short_epochs,
        overlapped_push_and_fetch,
        prefetched_until_weights_are_set,
    )
}


def main(argv):
    """``CASE [ARGS]``: runs the case of that name with ARGS."""
    name, *args = argv
    CASES[name](*args)


if __name__ == "__main__":
    main(sys.argv[1:])
