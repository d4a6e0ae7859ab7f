"""Real Keras programs under DownpourStrategy and SandblasterStrategy:
``python -m tests.programs.downpour_keras_cases CASE [ARGS]``.

The models override what keras.io's guides say to override: ``train_step``
("Customizing what happens in fit()") and ``compute_loss``. Each case (a
function below) starts its own cluster and prints one ``RESULT`` line for
``tests/test_downpour_keras.py`` to check.
"""

import os
import sys
import time

import keras
import numpy as np
import tensorflow as tf

import tfdist_ext
from tests.programs import report
from tests.programs.added_loss import fit_added_loss
from tests.programs.added_loss import keras_losses
from tests.programs.added_loss import regularized
from tfdist_ext import datasets
from tfdist_ext.cluster import LocalCluster
from tfdist_ext.optimizers import LBFGS


def digits_train(batch=32):
    return datasets.digits("train", flatten=True).shuffle(2048, seed=0).batch(batch).repeat()


def layers(hidden=32):
    return [
        keras.Input((64,)),
        keras.layers.Dense(hidden, activation="relu"),
        keras.layers.Dense(10),
    ]


def sparse_ce():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


# -- the users' models -------------------------------------------------------------


class CountingStep(keras.Sequential):
    steps = 0

    def train_step(self, data):
        CountingStep.steps += 1
        return super().train_step(data)


class OwnLoss(keras.Sequential):
    # Compiled without a loss: the override is the only loss there is.
    calls = 0

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        OwnLoss.calls += 1
        return keras.ops.mean(
            keras.losses.sparse_categorical_crossentropy(y, y_pred, from_logits=True)
        )


class OwnStep(keras.Sequential):
    # The case: compiled without a loss, the step computes its own.
    def __init__(self, layers):
        super().__init__(layers)
        self.steps_run = keras.metrics.Sum(name="steps_run")
        self.own_loss = keras.metrics.Mean(name="own_loss")

    @property
    def metrics(self):
        return [self.steps_run, self.own_loss]

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            logits = self(x, training=True)
            loss = keras.ops.mean(
                keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
            )
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        self.steps_run.update_state(1.0)
        self.own_loss.update_state(loss)
        return {"steps_run": self.steps_run.result(), "own_loss": self.own_loss.result()}


class GuideStep(keras.Sequential):
    # "Customizing what happens in fit()": the loss from self.compute_loss.
    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
        return {m.name: m.result() for m in self.metrics}


class WritesWeights(OwnStep):
    # Writes a trainable weight itself: refused under Downpour.
    def train_step(self, data):
        logs = super().train_step(data)
        kernel = self.trainable_variables[0]
        kernel.assign(kernel * 0.999)
        return logs


def refused(fit):
    """The message of the ValueError ``fit()`` raised (None if none), and
    ``fit``'s seconds."""
    started = time.monotonic()
    try:
        fit()
    except ValueError as e:
        return str(e), time.monotonic() - started
    return None, time.monotonic() - started


def refusal(model):
    """:func:`refused` of a short fit of ``model``."""
    return refused(lambda: model.fit(digits_train(), epochs=1, steps_per_epoch=10, verbose=0))


def own_step(hidden_layers):
    model = OwnStep(hidden_layers)
    model.compile(optimizer=keras.optimizers.Adagrad(0.05))
    return model


# -- the cases ----------------------------------------------------------------------


def _custom_step_refusals(strategy):
    """Refusals of OwnStep models that cannot run, the model that then runs, and
    one with BatchNormalization and Dropout."""
    with strategy.scope():
        model = own_step(layers(16))
        split = own_step(layers(128))  # a 32 KiB kernel, split over both ps
    fetch_refusal, refused_in = refusal(model)
    untouched = float(model.steps_run.result())
    strategy.n_fetch = 1
    split_refusal, _ = refusal(split)
    with strategy.scope():
        writer = WritesWeights(layers(16))
        writer.compile(optimizer=keras.optimizers.Adagrad(0.05))
        normed = own_step(
            [
                keras.Input((64,)),
                keras.layers.Dense(16),
                keras.layers.BatchNormalization(),
                keras.layers.ReLU(),
                keras.layers.Dropout(0.2),
                keras.layers.Dense(10),
            ]
        )
    write_refusal, _ = refusal(writer)
    seen = {
        "refusal": fetch_refusal,
        "split_refusal": split_refusal,
        "refused_in": refused_in,
        "write_refusal": write_refusal,
        "untouched": untouched,
    }
    return seen, model, normed


def custom_train_step():
    """OwnStep on 2 workers and 2 ps, first at n_fetch=2 (refused), then at 1."""
    keras.utils.set_random_seed(0)
    with LocalCluster(num_workers=2, num_ps=2) as cluster:
        strategy = tfdist_ext.DownpourStrategy(
            cluster.resolver, n_fetch=2, n_push=3, min_shard_bytes=8 << 10
        )
        seen, model, normed = _custom_step_refusals(strategy)
        h = model.fit(digits_train(), epochs=3, steps_per_epoch=30, verbose=0)
        s = strategy.stats.summary()
        guide = fit_added_loss(strategy, GuideStep)
        hn = normed.fit(digits_train(), epochs=1, steps_per_epoch=10, verbose=0)
        moving_mean = normed.layers[1].moving_mean.numpy()
        report(
            {
                **seen,
                "history": h.history,
                "steps": s["steps"],
                "pushes": s["pushes"],
                "iterations": int(model.optimizer.iterations.numpy()),
                "normed_steps": hn.history["steps_run"],
                "moving_mean_moved": float(np.abs(moving_mean).max()),
                **guide,
            }
        )


def _refused_steps(strategy, model):
    """:func:`refused` of a 4-step fit of ``model`` and the steps it ran."""
    before = strategy.stats.summary()["steps"]
    message, _ = refused(lambda: model.fit(digits_train(), epochs=1, steps_per_epoch=4, verbose=0))
    return message, strategy.stats.summary()["steps"] - before


def compute_loss_override():
    """OwnLoss on 2 workers; then run_eagerly and jit_compile, refused."""
    with LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = tfdist_ext.DownpourStrategy(cluster.resolver, n_push=2, n_fetch=2)
        with strategy.scope():
            own = OwnLoss(layers())
            own.compile(optimizer=keras.optimizers.Adagrad(0.05))
        h = own.fit(digits_train(), epochs=3, steps_per_epoch=30, verbose=0)
        steps = strategy.stats.summary()["steps"]
        added = fit_added_loss(strategy)  # a layer's add_loss
        # run_eagerly and jit_compile cannot hold on the workers: refused before
        # any round.
        with strategy.scope():
            eager = keras.Sequential(layers())
            eager.compile(
                optimizer=keras.optimizers.Adagrad(0.05), run_eagerly=True, loss=sparse_ce()
            )
            xla = keras.Sequential(layers())
            xla.compile(
                optimizer=keras.optimizers.Adagrad(0.05), jit_compile=True, loss=sparse_ce()
            )
        eager_refusal, eager_steps = _refused_steps(strategy, eager)
        jit_refusal, xla_steps = _refused_steps(strategy, xla)
        report(
            {
                "steps": steps,
                "loss": h.history["loss"],
                "compute_loss_calls": OwnLoss.calls,
                **added,
                "eager_refusal": eager_refusal,
                "eager_steps": eager_steps,
                "jit_refusal": jit_refusal,
                "xla_steps": xla_steps,
            }
        )


def sandblaster_custom_step():
    """SandblasterStrategy refuses CountingStep and run_eagerly, and trains
    OwnLoss and a layer's add_loss."""
    x, y = datasets.digits("train", flatten=True, as_numpy=True)
    with LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = tfdist_ext.SandblasterStrategy(cluster.resolver, slices_per_worker=2)
        with strategy.scope():
            custom = CountingStep(layers())
            custom.compile(optimizer=LBFGS(), loss=sparse_ce())
        refusal, _ = refused(lambda: custom.fit(x, y, epochs=2, verbose=0))
        with strategy.scope():
            own = OwnLoss(layers())
            own.compile(optimizer=LBFGS())
        h = own.fit(x, y, epochs=5, verbose=0)
        # A layer's add_loss is part of the objective: the loss Sandblaster
        # reports at its final iterate is plain Keras's at those weights.
        keras.utils.set_random_seed(0)
        with strategy.scope():
            added = regularized()
            added.compile(optimizer=LBFGS(), loss=sparse_ce())
        ha = added.fit(x, y, epochs=2, verbose=0)
        with strategy.scope():
            eager = keras.Sequential(layers())
            eager.compile(optimizer=LBFGS(), run_eagerly=True, loss=sparse_ce())
        passes = len(strategy.passes)
        eager_refusal, _ = refused(lambda: eager.fit(x, y, epochs=1, verbose=0))
        report(
            {
                "eager_refusal": eager_refusal,
                "eager_passes": len(strategy.passes) - passes,
                "refusal": refusal,
                "step_ran": CountingStep.steps,
                "passes": len(strategy.passes),
                "loss": h.history["loss"],
                "compute_loss_calls": OwnLoss.calls,
                "added_reported": ha.history["loss"][-1],
                **keras_losses(added, x, y),
            }
        )


def _custom_step_mixed(strategy):
    """A custom train_step (here Keras's own, via super(): scale_loss, then
    apply_gradients of the LossScaleOptimizer) under mixed_float16."""
    strategy.n_fetch = 1
    with strategy.scope():
        custom = CountingStep(layers(64))
        custom.compile(optimizer=keras.optimizers.Adagrad(0.05), loss=sparse_ce())
    custom_h = custom.fit(digits_train(), epochs=3, steps_per_epoch=40, verbose=0)
    return {
        "custom_loss": custom_h.history["loss"],
        "custom_traced": CountingStep.steps,
        "custom_scale": float(custom.optimizer.dynamic_scale.numpy()),
    }


def mixed_float16(directory):
    """A digits MLP under mixed_float16 on 2 workers; saves it as
    DIRECTORY/mixed.keras and 5 test inputs as DIRECTORY/x.npy."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    x_test, y_test = datasets.digits("test", flatten=True, as_numpy=True)
    with LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = tfdist_ext.DownpourStrategy(cluster.resolver, n_push=2, n_fetch=2)
        with strategy.scope():
            model = keras.Sequential(layers(64))
            model.compile(
                optimizer=keras.optimizers.Adagrad(0.05), loss=sparse_ce(), metrics=["accuracy"]
            )
        # 200 steps: with the overlapped push (one more push of staleness) 120
        # left the held-out accuracy near 0.8.
        h = model.fit(digits_train(), epochs=5, steps_per_epoch=40, verbose=0)
        scale = float(model.optimizer.dynamic_scale.numpy())
        logits = model.predict(x_test, verbose=0)
        model.save(os.path.join(directory, "mixed.keras"))
        np.save(os.path.join(directory, "x.npy"), x_test[:5])
        custom = _custom_step_mixed(strategy)
        report(
            {
                **custom,
                "loss": h.history["loss"],
                "accuracy": float((logits.argmax(1) == y_test).mean()),
                "compute_dtype": model.layers[0].compute_dtype,
                "scale": scale,
                "optimizer": type(model.optimizer).__name__,
                "iterations": int(model.optimizer.iterations.numpy()),
                "logits": logits[:5].tolist(),
            }
        )


class _Rates(keras.callbacks.Callback):
    """(iterations, learning rate) at each epoch's end."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_epoch_end(self, epoch, logs=None):
        opt = self.model.optimizer
        self.seen.append((int(opt.iterations.numpy()), float(opt.learning_rate.numpy())))


def _decaying_sgd():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=20, decay_rate=0.5)
    return keras.optimizers.SGD(schedule)


def schedule_counts_steps():
    """ExponentialDecay by plain Keras, then under Downpour at n_push=5 on 2 workers."""
    keras.utils.set_random_seed(0)
    plain = keras.Sequential(layers())
    plain.compile(optimizer=_decaying_sgd(), loss=sparse_ce())
    plain_rates = _Rates()
    plain.fit(digits_train(), epochs=2, steps_per_epoch=42, verbose=0, callbacks=[plain_rates])
    with LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = tfdist_ext.DownpourStrategy(cluster.resolver, n_push=5, n_fetch=5)
        with strategy.scope():
            model = keras.Sequential(layers())
            model.compile(optimizer=_decaying_sgd(), loss=sparse_ce())
        rates = _Rates()
        model.fit(digits_train(), epochs=2, steps_per_epoch=42, verbose=0, callbacks=[rates])
        report(
            {
                "downpour": rates.seen,
                "plain": plain_rates.seen,
                "pushes": strategy.stats.summary()["pushes"],
            }
        )


CASES = {
    fn.__name__: fn
    for fn in (
        custom_train_step,
        compute_loss_override,
        sandblaster_custom_step,
        mixed_float16,
        schedule_counts_steps,
    )
}


def main(argv):
    """``CASE [ARGS]``: runs the case of that name with ARGS."""
    name, *args = argv
    CASES[name](*args)


if __name__ == "__main__":
    main(sys.argv[1:])
