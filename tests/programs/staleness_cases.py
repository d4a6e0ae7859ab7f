"""Downpour's staleness policies and bounded staleness (SSP) on a real local
cluster: ``python -m tests.programs.staleness_cases CASE [ARGS]``.

Each case (a function below) starts its own cluster and prints one
``RESULT`` line for ``tests/test_downpour_staleness.py``, which computes in
NumPy what the weights must be.
"""

import sys
import time

import keras
import numpy as np
import tensorflow as tf

import tfdist_ext
from tests.programs import report
from tfdist_ext import datasets
from tfdist_ext.cluster import LocalCluster
from tfdist_ext.downpour import DelayCompensation
from tfdist_ext.downpour import StalenessAwareLR

#: The policies ``known_staleness`` runs, by name: (policy, optimizer, whether
#: to try a custom train_step, which the policy refuses).
POLICIES = {
    "lr_over_tau": (StalenessAwareLR, lambda: keras.optimizers.Adagrad(0.1), False),
    "delay_compensation": (
        lambda: DelayCompensation(lam=2.0),
        lambda: keras.optimizers.SGD(0.1),
        True,
    ),
}


def digits_train():
    return datasets.digits("train", flatten=True).shuffle(2048, seed=0).batch(32).repeat()


def digits_mlp(steps_per_execution=1):
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adagrad(0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=steps_per_execution,
    )
    return model


def fit_and_reload(strategy, path, during=None, steps_per_execution=1, **fit_kwargs):
    """A digits MLP trained with the strategy: its losses, and whether the
    saved and reloaded model predicts the same.

    With ``during`` (a context, e.g. a throttle): a first unmeasured fit
    traces the round, then the measured one runs within ``during`` (tracing
    and registering functions on a throttled worker would only slow the
    measured fit).
    """
    with strategy.scope():
        model = digits_mlp(steps_per_execution)
    train = digits_train()
    if during is not None:
        model.fit(train, epochs=1, steps_per_epoch=20, verbose=0)
        strategy.stats.reset()
        with during:
            h = model.fit(train, verbose=0, **fit_kwargs)
    else:
        h = model.fit(train, verbose=0, **fit_kwargs)
    x = next(iter(datasets.digits("test", flatten=True).batch(50)))[0]
    model.save(path)
    same = bool(
        np.allclose(
            keras.saving.load_model(path).predict(x, verbose=0),
            model.predict(x, verbose=0),
            atol=1e-5,
        )
    )
    return h.history["loss"], same


def one_batch():
    """The batch every step of the known-staleness cases trains on."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 3)).astype("float32")
    y = rng.normal(size=(8, 2)).astype("float32")
    return tf.data.Dataset.from_tensors((x, y)).repeat()


def weights(model):
    return [w.numpy().tolist() for w in model.trainable_weights]


# Public name: Keras names a model after its class, and a leading underscore
# is not a valid name scope.
class Custom(keras.Sequential):
    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {}


def _custom_step_refusal(strategy):
    """The ValueError's message when a custom train_step is fit (None if it is not refused)."""
    strategy.n_fetch = 1
    with strategy.scope():
        custom = Custom([keras.Input((3,)), keras.layers.Dense(2)])
        custom.compile(optimizer="sgd", loss="mse")
    try:
        custom.fit(one_batch(), epochs=1, steps_per_epoch=2, verbose=0)
    except ValueError as e:
        return str(e)
    return None


def known_staleness(policy, path):
    """One worker, n_fetch=4, n_push=1, the same batch at every step, under
    POLICY (of :data:`POLICIES`): the pushes of a fetch block have staleness
    0, 1, 2, 3 (the worker's own earlier pushes) and all carry the gradient
    at the fetched parameters. Then a digits MLP, saved at PATH."""
    make_policy, make_optimizer, custom_step = POLICIES[policy]
    with LocalCluster(num_workers=1, num_ps=1) as cluster:
        strategy = tfdist_ext.DownpourStrategy(
            cluster.resolver,
            n_fetch=4,
            n_push=1,
            staleness_policy=make_policy(),
            background_fetch=True,  # rounds start from prefetched parameters
        )
        with strategy.scope():
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
            # Keras's calls of 4 batches: the 4 steps are one round, one fetch block.
            model.compile(optimizer=make_optimizer(), loss="mse", steps_per_execution=4)
        w0 = weights(model)
        model.fit(one_batch(), epochs=1, steps_per_epoch=4, verbose=0)
        w1 = weights(model)
        staleness = list(strategy.stats.staleness)
        strategy.stats.reset()
        losses, same = fit_and_reload(strategy, path, epochs=2, steps_per_epoch=60)
        prefetched = strategy.stats.summary()["prefetched_rounds"]
        refused = _custom_step_refusal(strategy) if custom_step else None
        report(
            {
                "w0": w0,
                "w1": w1,
                "staleness": staleness,
                "losses": losses,
                "same": same,
                "config": strategy.get_config(),
                "refused": refused,
                "prefetched": prefetched,
            }
        )


def delay_compensated_rounds(*configs):
    """One worker, one 8-step round of the same batch under
    DelayCompensation(lam=2.0) and SGD(0.1), for each CONFIG
    ``N_FETCH,N_PUSH``: the weights before and after, and the staleness."""
    out = []
    with LocalCluster(num_workers=1, num_ps=1) as cluster:
        strategy = tfdist_ext.DownpourStrategy(
            cluster.resolver,
            staleness_policy=DelayCompensation(lam=2.0),
            background_fetch=True,  # the overlap the test's NumPy round follows
        )
        for config in configs:
            strategy.n_fetch, strategy.n_push = map(int, config.split(","))
            strategy.stats.reset()
            with strategy.scope():
                model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
                model.compile(
                    optimizer=keras.optimizers.SGD(0.1), loss="mse", steps_per_execution=8
                )
            w0 = weights(model)
            model.fit(one_batch(), epochs=1, steps_per_epoch=8, verbose=0)
            out.append(
                {
                    "w0": w0,
                    "w1": weights(model),
                    "staleness": list(strategy.stats.staleness),
                    "summary": strategy.stats.summary(),
                }
            )
    report({"out": out})


def ssp_throttled(path):
    """max_staleness=2 on 2 workers, worker 1 throttled to 1/8 of a core; saves at PATH."""
    keras.utils.set_random_seed(0)
    with LocalCluster(num_workers=2, num_ps=1) as cluster:
        # deadline: a worker throttled to 1/8 of a core on a loaded 2-core
        # machine can take more than 30 s between fetch blocks (a CI run did).
        strategy = tfdist_ext.DownpourStrategy(cluster.resolver, max_staleness=2, deadline=90)
        # Rounds of 10 steps, one per Keras call: both workers hold rounds at
        # once, so the throttled one bounds the other.
        losses, same = fit_and_reload(
            strategy,
            path,
            during=cluster.throttle("worker", 1, 8),
            steps_per_execution=10,
            epochs=2,
            steps_per_epoch=100,
        )
        report(
            {
                "losses": losses,
                "same": same,
                "leads": strategy.stats.clock_leads.tolist(),
                "staleness": list(strategy.stats.staleness),
                "config": strategy.get_config(),
                "prefetched": strategy.stats.summary()["prefetched_rounds"],
            }
        )


class _Kill(keras.callbacks.Callback):
    """Kills worker 1 once, after batch 30, noting the steps each worker ran before."""

    def __init__(self, cluster, strategy, marks):
        super().__init__()
        self.cluster, self.strategy, self.marks = cluster, strategy, marks

    def on_train_batch_end(self, batch, logs=None):
        if batch >= 30 and not self.marks:
            self.marks["before"] = dict(self.strategy.stats.steps_per_worker)
            self.cluster.kill("worker", 1)


def ssp_killed_slow_worker():
    """max_staleness=1 on 2 workers; worker 1, slowed 4 times, is killed mid-fit."""
    keras.utils.set_random_seed(0)
    with LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = tfdist_ext.DownpourStrategy(cluster.resolver, max_staleness=1, deadline=12)
        with strategy.scope():
            model = digits_mlp()
        model.steps_per_execution = 10
        train = digits_train()  # one dataset: see fit_and_reload
        model.fit(train, epochs=1, steps_per_epoch=20, verbose=0)
        marks = {}
        start = time.monotonic()
        with cluster.throttle("worker", 1, slowdown=4):
            h = model.fit(
                train,
                epochs=2,
                steps_per_epoch=100,
                verbose=0,
                callbacks=[_Kill(cluster, strategy, marks)],
            )
        report(
            {
                "seconds": time.monotonic() - start,
                "loss": h.history["loss"],
                "marks": marks,
                "stats": strategy.stats.summary(),
                "per_worker": dict(strategy.stats.steps_per_worker),
            }
        )


CASES = {
    fn.__name__: fn
    for fn in (known_staleness, delay_compensated_rounds, ssp_throttled, ssp_killed_slow_worker)
}


def main(argv):
    """``CASE [ARGS]``: runs the case of that name with ARGS."""
    name, *args = argv
    CASES[name](*args)


if __name__ == "__main__":
    main(sys.argv[1:])
