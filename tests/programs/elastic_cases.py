"""ElasticAveragingStrategy (asynchronous EASGD) on a real local cluster:
``python -m tests.programs.elastic_cases CASE [ARGS]``.

Each case (a function below) starts its own cluster and prints one
``RESULT`` line for ``tests/test_elastic.py``, which checks the exact cases
against EASGD's rule computed in NumPy or by plain Keras.
"""

import os
import sys

import keras
import numpy as np
import tensorflow as tf

import tfdist_ext
from tests.programs import report
from tests.programs.added_loss import fit_added_loss
from tests.programs.downpour_common import compiled
from tests.programs.downpour_common import digits_test
from tests.programs.downpour_common import digits_train
from tests.programs.downpour_common import mlp
from tfdist_ext.cluster import LocalCluster

#: The compiled optimizer of ``plain_keras_steps``, as plain Keras would build
#: it; options Keras applies itself (weight decay, clipping, loss scaling) included.
EXACT_OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.05, weight_decay=0.02, clipnorm=0.5),
    "adagrad": lambda: keras.optimizers.Adagrad(0.3, global_clipnorm=2.0),
    "loss_scale": lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.RMSprop(0.02, momentum=0.5)
    ),
}


def linear_data():
    """8 examples of y = 2 x0 - x1 + 0.5."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 2)).astype("float32")
    y = (x @ np.array([[2.0], [-1.0]], "float32") + 0.5).astype("float32")
    return x, y


def linear_model():
    return keras.Sequential(
        [
            keras.Input((2,)),
            keras.layers.Dense(1, kernel_initializer="ones", bias_initializer="zeros"),
        ]
    )


def easgd_rule():
    """One worker, SGD with momentum, three fits; the centre set before the third."""
    lr, momentum, alpha, tau, batch = 0.05, 0.5, 0.3, 3, 4
    x, y = linear_data()
    with LocalCluster(num_workers=1, num_ps=1) as cluster:
        strategy = tfdist_ext.ElasticAveragingStrategy(cluster.resolver, alpha=alpha, tau=tau)
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat()
        with strategy.scope():
            model = linear_model()
            model.compile(keras.optimizers.SGD(lr, momentum=momentum), "mse")
        model.fit(data, epochs=2, steps_per_epoch=12, verbose=0)  # two rounds
        model.fit(data, epochs=1, steps_per_epoch=12, verbose=0)  # continues
        centre_2 = [w.tolist() for w in model.get_weights()]
        model.set_weights([np.full((2, 1), 0.5, "float32"), np.ones(1, "float32")])
        model.fit(data, epochs=1, steps_per_epoch=12, verbose=0)  # afresh
        report(
            {
                "centre_2": centre_2,
                "kernel": model.layers[0].kernel.numpy().tolist(),
                "bias": model.layers[0].bias.numpy().tolist(),
                "iterations": int(model.optimizer.iterations),
                "stats": strategy.stats.summary(),
            }
        )


def _by_hand(make, x, y, alpha, tau, batch):
    """The centre after 9 steps of a plain Keras replica (train_on_batch, the
    rate halved before step 6) with the elastic exchange done by hand every
    tau steps."""
    replica = make()
    centre = replica.get_weights()
    for step in range(9):
        if step == 6:
            rate = float(np.asarray(replica.optimizer.learning_rate))
            replica.optimizer.learning_rate = rate / 2
        start = (step * batch) % len(x)
        replica.train_on_batch(x[start : start + batch], y[start : start + batch])
        if (step + 1) % tau == 0:
            moves = [alpha * (w - c) for w, c in zip(replica.get_weights(), centre)]
            replica.set_weights([w - d for w, d in zip(replica.get_weights(), moves)])
            centre = [c + d for c, d in zip(centre, moves)]
    return centre


def plain_keras_steps(optimizer):
    """One worker, three epochs of tau=3 steps with OPTIMIZER (of
    :data:`EXACT_OPTIMIZERS`), the rate halved by a callback before the last;
    beside the same by hand in plain Keras."""
    alpha, tau, batch = 0.3, 3, 4
    x, y = linear_data()

    def make():
        model = linear_model()
        model.compile(EXACT_OPTIMIZERS[optimizer](), "mse")
        return model

    centre = _by_hand(make, x, y, alpha, tau, batch)
    halve = keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr / 2 if epoch == 2 else lr)
    with LocalCluster(num_workers=1, num_ps=1) as cluster:
        strategy = tfdist_ext.ElasticAveragingStrategy(cluster.resolver, alpha=alpha, tau=tau)
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat()
        with strategy.scope():
            model = make()
        model.fit(data, epochs=3, steps_per_epoch=3, verbose=0, callbacks=[halve])
        report(
            {
                "expected": [c.tolist() for c in centre],
                "centre": [w.tolist() for w in model.get_weights()],
                "iterations": int(model.optimizer.iterations),
                "pushes": strategy.stats.summary()["pushes"],
            }
        )


def adaptive_optimizers():
    """2 workers, tau=4: Adagrad, Adam, and Adam under mixed_float16."""
    results = {}
    with LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = tfdist_ext.ElasticAveragingStrategy(cluster.resolver, tau=4)
        for name, make, policy in (
            ("adagrad", lambda: keras.optimizers.Adagrad(0.1), "float32"),
            ("adam", lambda: keras.optimizers.Adam(0.003), "float32"),
            ("mixed_float16", lambda: keras.optimizers.Adam(0.003), "mixed_float16"),
        ):
            keras.utils.set_random_seed(0)
            keras.mixed_precision.set_global_policy(policy)
            with strategy.scope():
                model = compiled(mlp(), make())
            h = model.fit(digits_train(), epochs=3, steps_per_epoch=50, verbose=0)
            _, accuracy = model.evaluate(digits_test(), verbose=0)
            results[name] = {
                "loss": h.history["loss"],
                "accuracy": accuracy,
                "optimizer": type(model.optimizer).__name__,
                "rejected": h.history["rejected_pushes"],
            }
            keras.mixed_precision.set_global_policy("float32")
    report({"results": results})


def digits_and_centre():
    """2 workers, tau=4, Nesterov SGD; the centre evaluated, then a layer's add_loss."""
    keras.utils.set_random_seed(0)
    with LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = tfdist_ext.ElasticAveragingStrategy(cluster.resolver, tau=4)
        with strategy.scope():
            model = compiled(mlp(), keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True))
        h = model.fit(digits_train(), epochs=3, steps_per_epoch=60, verbose=0)
        _, accuracy = model.evaluate(digits_test(), verbose=0)
        stats, per_worker = strategy.stats.summary(), dict(strategy.stats.steps_per_worker)
        added = fit_added_loss(strategy)  # a layer's add_loss
        report(
            {
                "history": h.history,
                "accuracy": accuracy,
                "stats": stats,
                "per_worker": per_worker,
                "config": strategy.get_config(),
                **added,
            }
        )


class OwnStep(keras.Sequential):
    def train_step(self, data):
        return super().train_step(data)


#: What EASGD cannot train, by name: a compiled model.
UNTRAINABLE = {
    "ema": lambda: compiled(mlp(), keras.optimizers.Adam(use_ema=True)),
    "ema_inner": lambda: compiled(
        mlp(), keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1, use_ema=True))
    ),
    "accumulation": lambda: compiled(
        mlp(), keras.optimizers.Adagrad(gradient_accumulation_steps=2)
    ),
    "train_step": lambda: compiled(
        OwnStep([keras.Input((64,)), keras.layers.Dense(10)]), keras.optimizers.SGD(0.1)
    ),
}


def refused_before_the_first_step():
    """Each of :data:`UNTRAINABLE` fit on one worker: the ValueError's message
    and the batches that ran (None if it trained)."""
    refused = {}
    with LocalCluster(num_workers=1, num_ps=1) as cluster:
        strategy = tfdist_ext.ElasticAveragingStrategy(cluster.resolver, tau=2)
        for name, make in UNTRAINABLE.items():
            with strategy.scope():
                model = make()
            batches = []
            seen = keras.callbacks.LambdaCallback(
                on_train_batch_end=lambda b, l, batches=batches: batches.append(b)
            )
            try:
                model.fit(digits_train(), epochs=1, steps_per_epoch=4, verbose=0, callbacks=[seen])
                refused[name] = None
            except ValueError as e:
                refused[name] = [str(e), len(batches)]
    report({"refused": refused})


class _Preempted(keras.callbacks.Callback):
    """Raises at the start of epoch ``at``, as a preempted job stops."""

    def __init__(self, at):
        super().__init__()
        self.at = at

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.at:
            raise RuntimeError("preempted")


def resume(backup, preempt_at=None):
    """One worker, SGD with momentum, tau=3 over epochs of 4 steps (so a
    replica's period and momentum span epochs), 4 epochs with Keras's
    BackupAndRestore in ``backup``; preempted at the start of epoch
    ``preempt_at`` if given. Reports the centre, the epochs this run
    trained and the backup's listing."""
    x, y = linear_data()
    with LocalCluster(num_workers=1, num_ps=1) as cluster:
        strategy = tfdist_ext.ElasticAveragingStrategy(cluster.resolver, alpha=0.3, tau=3)
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(4).repeat()
        with strategy.scope():
            model = linear_model()
            model.compile(keras.optimizers.SGD(0.05, momentum=0.5), "mse")
        callbacks = [keras.callbacks.BackupAndRestore(backup, delete_checkpoint=False)]
        if preempt_at is not None:
            callbacks.append(_Preempted(int(preempt_at)))
        epochs = []
        callbacks.append(keras.callbacks.LambdaCallback(on_epoch_end=lambda e, l: epochs.append(e)))
        try:
            model.fit(data, epochs=4, steps_per_epoch=4, verbose=0, callbacks=callbacks)
        except RuntimeError as e:
            if str(e) != "preempted":
                raise
        report(
            {
                "centre": [w.tolist() for w in model.get_weights()],
                "epochs": epochs,
                "backup": sorted(os.listdir(backup)),
            }
        )


CASES = {
    fn.__name__: fn
    for fn in (
        resume,
        easgd_rule,
        plain_keras_steps,
        adaptive_optimizers,
        digits_and_centre,
        refused_before_the_first_step,
    )
}


def main(argv):
    """``CASE [ARGS]``: runs the case of that name with ARGS."""
    name, *args = argv
    CASES[name](*args)


if __name__ == "__main__":
    main(sys.argv[1:])
