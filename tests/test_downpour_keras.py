"""Real Keras programs under DownpourStrategy and SandblasterStrategy (issue 12).

Downpour runs a custom ``train_step`` on the workers (n_fetch=1, refused at
``fit()`` start otherwise); Sandblaster refuses it at ``fit()`` start with a
message that says what to do; a ``compute_loss`` override (Keras's public
extension point) runs in both; ``mixed_float16`` trains with loss
scaling; learning-rate schedules count training steps, as in plain Keras.
Each test runs its body in a fresh interpreter (``script`` fixture).
"""

import json

import numpy as np
import pytest

from conftest import ADDED_LOSS
from conftest import assert_added_loss_trained

PRELUDE = (
    """
import json, time
import numpy as np
import keras
import tensorflow as tf
import tfdist_ext
from tfdist_ext import datasets
from tfdist_ext.cluster import LocalCluster

def digits_train(batch=32):
    return datasets.digits("train", flatten=True).shuffle(2048, seed=0).batch(batch).repeat()

def report(**values):
    print("RESULT " + json.dumps(values), flush=True)

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
        return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(
            y, y_pred, from_logits=True))

def layers(hidden=32):
    return [keras.Input((64,)), keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(10)]
"""
    + ADDED_LOSS
)


def _result(proc):
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


OWN_STEP = """
class OwnStep(keras.Sequential):
    # The issue's case: compiled without a loss, the step computes its own.
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
            loss = keras.ops.mean(keras.losses.sparse_categorical_crossentropy(
                y, logits, from_logits=True))
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
"""


@pytest.mark.timeout(300)
def test_downpour_runs_custom_train_step_on_the_workers(script):
    proc = script(
        PRELUDE
        + OWN_STEP
        + """
keras.utils.set_random_seed(0)
def refusal(model):
    started = time.monotonic()
    try:
        model.fit(digits_train(), epochs=1, steps_per_epoch=10, verbose=0)
    except ValueError as e:
        return str(e), time.monotonic() - started
    return None, time.monotonic() - started

with LocalCluster(num_workers=2, num_ps=2) as cluster:
    strategy = tfdist_ext.DownpourStrategy(cluster.resolver, n_fetch=2, n_push=3,
                                           min_shard_bytes=8 << 10)
    with strategy.scope():
        model = OwnStep(layers(16))
        model.compile(optimizer=keras.optimizers.Adagrad(0.05))
        split = OwnStep(layers(128))    # a 32 KiB kernel, split over both ps
        split.compile(optimizer=keras.optimizers.Adagrad(0.05))
    fetch_refusal, refused_in = refusal(model)
    untouched = float(model.steps_run.result())
    strategy.n_fetch = 1
    split_refusal, _ = refusal(split)
    with strategy.scope():
        writer = WritesWeights(layers(16))
        writer.compile(optimizer=keras.optimizers.Adagrad(0.05))
        normed = OwnStep([keras.Input((64,)), keras.layers.Dense(16),
                          keras.layers.BatchNormalization(), keras.layers.ReLU(),
                          keras.layers.Dropout(0.2), keras.layers.Dense(10)])
        normed.compile(optimizer=keras.optimizers.Adagrad(0.05))
    write_refusal, _ = refusal(writer)
    h = model.fit(digits_train(), epochs=3, steps_per_epoch=30, verbose=0)
    s = strategy.stats.summary()
    guide = fit_added_loss(strategy, GuideStep)
    hn = normed.fit(digits_train(), epochs=1, steps_per_epoch=10, verbose=0)
    moving_mean = normed.layers[1].moving_mean.numpy()
    report(refusal=fetch_refusal, split_refusal=split_refusal, refused_in=refused_in,
           write_refusal=write_refusal, untouched=untouched, history=h.history,
           steps=s["steps"], pushes=s["pushes"], iterations=int(model.optimizer.iterations.numpy()),
           normed_steps=hn.history["steps_run"], moving_mean_moved=float(np.abs(moving_mean).max()),
           **guide)
""",
        timeout=280,
    )
    r = _result(proc)
    # n_fetch > 1 cannot hold for a step that reads the server's variables:
    # refused before any round, saying what to do.
    assert r["refusal"] and "train_step" in r["refusal"] and "n_fetch=1" in r["refusal"]
    assert r["untouched"] == 0 and r["refused_in"] < 30
    # A weight split across ps tasks has no handle for the user's tape: refused.
    assert r["split_refusal"] and "min_shard_bytes" in r["split_refusal"]
    # With n_fetch=1 the user's own step runs on the workers: its loss (the
    # only loss; none is compiled) falls, and its metrics count its steps
    # (Keras's read-then-write increments may overlap across workers).
    h = r["history"]
    assert h["own_loss"][-1] < h["own_loss"][0]
    # Each counts every step once: the step's metric updates accumulate on
    # the round's local copy and are added atomically at its end (Keras's
    # own assign_add, a read then a write, lost about half of them when two
    # workers updated the server's metric variables at once).
    assert h["steps_run"] == [30.0, 30.0, 30.0], h["steps_run"]
    # n_push=3; an epoch's first round (one batch) pushes at its end.
    assert r["steps"] == 90 and 30 <= r["pushes"] <= 33 and r["iterations"] == 90
    # Its non-trainable weights (BatchNorm statistics) are written where they
    # live, with Dropout in the model too; assigning a trainable weight in
    # the step is refused before any batch, naming the weight.
    assert r["normed_steps"] == [10.0] and r["moving_mean_moved"] > 0
    assert r["write_refusal"] and "assigned" in r["write_refusal"], r["write_refusal"]
    assert "kernel" in r["write_refusal"] and "apply_gradients" in r["write_refusal"]
    # The guide's train_step (self.compute_loss) includes a layer's add_loss.
    assert_added_loss_trained(r)


@pytest.mark.timeout(300)
def test_downpour_runs_compute_loss_override(script):
    proc = script(
        PRELUDE
        + """
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
        eager.compile(optimizer=keras.optimizers.Adagrad(0.05), run_eagerly=True,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        xla = keras.Sequential(layers())
        xla.compile(optimizer=keras.optimizers.Adagrad(0.05), jit_compile=True,
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = strategy.stats.summary()["steps"]
    try:
        eager.fit(digits_train(), epochs=1, steps_per_epoch=4, verbose=0)
        eager_refusal = None
    except ValueError as e:
        eager_refusal = str(e)
    eager_steps = strategy.stats.summary()["steps"] - before
    before = strategy.stats.summary()["steps"]
    try:
        xla.fit(digits_train(), epochs=1, steps_per_epoch=4, verbose=0)
        jit_refusal = None
    except ValueError as e:
        jit_refusal = str(e)
    report(steps=steps, loss=h.history["loss"], compute_loss_calls=OwnLoss.calls,
           **added, eager_refusal=eager_refusal, eager_steps=eager_steps, jit_refusal=jit_refusal,
           xla_steps=strategy.stats.summary()["steps"] - before)
""",
        timeout=280,
    )
    r = _result(proc)
    # The compute_loss override (the only loss; none is compiled) is what
    # Downpour trains.
    assert r["compute_loss_calls"] > 0
    assert r["steps"] == 90 and r["loss"][-1] < r["loss"][0]
    # The loss a layer adds in call() is part of what Downpour trains (it
    # was dropped: Downpour reported the loss without it).
    assert_added_loss_trained(r)
    assert r["eager_refusal"] and "run_eagerly=True" in r["eager_refusal"], r["eager_refusal"]
    assert r["eager_steps"] == 0
    assert r["jit_refusal"] and "jit_compile=True" in r["jit_refusal"], r["jit_refusal"]
    assert r["xla_steps"] == 0


@pytest.mark.timeout(300)
def test_sandblaster_refuses_custom_train_step_and_runs_compute_loss(script):
    proc = script(
        PRELUDE
        + """
from tfdist_ext.optimizers import LBFGS
x, y = datasets.digits("train", flatten=True, as_numpy=True)
with LocalCluster(num_workers=2, num_ps=1) as cluster:
    strategy = tfdist_ext.SandblasterStrategy(cluster.resolver, slices_per_worker=2)
    with strategy.scope():
        custom = CountingStep(layers())
        custom.compile(optimizer=LBFGS(),
                       loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    try:
        custom.fit(x, y, epochs=2, verbose=0)
        refusal = None
    except ValueError as e:
        refusal = str(e)
    with strategy.scope():
        own = OwnLoss(layers())
        own.compile(optimizer=LBFGS())
    h = own.fit(x, y, epochs=5, verbose=0)
    # A layer's add_loss is part of the objective: the loss Sandblaster
    # reports at its final iterate is plain Keras's at those weights.
    keras.utils.set_random_seed(0)
    with strategy.scope():
        added = regularized()
        added.compile(optimizer=LBFGS(),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ha = added.fit(x, y, epochs=2, verbose=0)
    with strategy.scope():
        eager = keras.Sequential(layers())
        eager.compile(optimizer=LBFGS(), run_eagerly=True,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    passes = len(strategy.passes)
    try:
        eager.fit(x, y, epochs=1, verbose=0)
        eager_refusal = None
    except ValueError as e:
        eager_refusal = str(e)
    report(eager_refusal=eager_refusal, eager_passes=len(strategy.passes) - passes,
           refusal=refusal, step_ran=CountingStep.steps, passes=len(strategy.passes),
           loss=h.history["loss"], compute_loss_calls=OwnLoss.calls,
           added_reported=ha.history["loss"][-1], **keras_losses(added, x, y))
""",
        timeout=280,
    )
    r = _result(proc)
    assert r["refusal"] is not None, "a custom train_step must not be silently skipped"
    assert "train_step" in r["refusal"] and "CountingStep" in r["refusal"]
    assert "compute_loss" in r["refusal"]
    assert r["step_ran"] == 0
    assert r["compute_loss_calls"] > 0 and r["loss"][-1] < r["loss"][0]
    # L-BFGS shrinks the activity term it minimises: 0.004-0.02 after one or
    # two iterations (seeds 0-3), once 0.0026 in CI. Still ten times the
    # agreement's tolerance (1e-4 of the loss), which is what the margin guards.
    assert_added_loss_trained(r, margin=1e-3)
    assert r["eager_refusal"] and r["eager_refusal"].startswith("SandblasterStrategy: run_eagerly")
    assert r["eager_passes"] == 0


@pytest.mark.timeout(400)
def test_downpour_mixed_float16_trains_saves_and_loads(script, tmp_path):
    path = str(tmp_path / "mixed.keras")
    proc = script(
        PRELUDE
        + f"""
keras.mixed_precision.set_global_policy("mixed_float16")
keras.utils.set_random_seed(0)
x_test, y_test = datasets.digits("test", flatten=True, as_numpy=True)
with LocalCluster(num_workers=2, num_ps=1) as cluster:
    strategy = tfdist_ext.DownpourStrategy(cluster.resolver, n_push=2, n_fetch=2)
    with strategy.scope():
        model = keras.Sequential(layers(64))
        model.compile(optimizer=keras.optimizers.Adagrad(0.05),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    # 200 steps: with the overlapped push (one more push of staleness) 120
    # left the held-out accuracy near 0.8.
    h = model.fit(digits_train(), epochs=5, steps_per_epoch=40, verbose=0)
    scale = float(model.optimizer.dynamic_scale.numpy())
    logits = model.predict(x_test, verbose=0)
    model.save({path!r})
    np.save({str(tmp_path / "x.npy")!r}, x_test[:5])
    # A custom train_step (here Keras's own, via super(): scale_loss, then
    # apply_gradients of the LossScaleOptimizer) trains under mixed_float16 too.
    strategy.n_fetch = 1
    with strategy.scope():
        custom = CountingStep(layers(64))
        custom.compile(optimizer=keras.optimizers.Adagrad(0.05),
                       loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    custom_h = custom.fit(digits_train(), epochs=3, steps_per_epoch=40, verbose=0)
    report(custom_loss=custom_h.history["loss"], custom_traced=CountingStep.steps,
           custom_scale=float(custom.optimizer.dynamic_scale.numpy()),
           loss=h.history["loss"], accuracy=float((logits.argmax(1) == y_test).mean()),
           compute_dtype=model.layers[0].compute_dtype, scale=scale,
           optimizer=type(model.optimizer).__name__,
           iterations=int(model.optimizer.iterations.numpy()), logits=logits[:5].tolist())
""",
        timeout=380,
    )
    r = _result(proc)
    assert r["compute_dtype"] == "float16" and r["optimizer"] == "LossScaleOptimizer"
    assert r["loss"][-1] < r["loss"][0] and r["accuracy"] > 0.8
    assert 1.0 <= r["scale"] <= 2.0**15
    assert r["iterations"] == 200
    assert r["custom_traced"] > 0 and r["custom_loss"][-1] < r["custom_loss"][0]
    assert 1.0 <= r["custom_scale"] <= 2.0**15
    # A fresh process without tfdist_ext loads it and predicts the same.
    loaded = script(
        f"""
import json, numpy as np, keras
model = keras.models.load_model({path!r})
x = np.load({str(tmp_path / "x.npy")!r})
print("LOADED " + json.dumps([type(model.optimizer).__name__, model.layers[0].compute_dtype,
                              model.predict(x, verbose=0).tolist()]), flush=True)
""",
        timeout=120,
    )
    line = [l for l in loaded.stdout.splitlines() if l.startswith("LOADED ")][0]
    _, dtype, logits = json.loads(line[len("LOADED ") :])
    assert dtype == "float16"
    np.testing.assert_allclose(logits, r["logits"], rtol=1e-2, atol=1e-2)


@pytest.mark.timeout(300)
def test_downpour_schedule_counts_steps_like_plain_keras(script):
    proc = script(
        PRELUDE
        + """
keras.utils.set_random_seed(0)
def schedule():
    return keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=20, decay_rate=0.5)
class Rates(keras.callbacks.Callback):
    def __init__(self):
        self.seen = []
    def on_epoch_end(self, epoch, logs=None):
        opt = self.model.optimizer
        self.seen.append((int(opt.iterations.numpy()), float(opt.learning_rate.numpy())))
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
plain = keras.Sequential(layers())
plain.compile(optimizer=keras.optimizers.SGD(schedule()), loss=loss)
plain_rates = Rates()
plain.fit(digits_train(), epochs=2, steps_per_epoch=42, verbose=0, callbacks=[plain_rates])
with LocalCluster(num_workers=2, num_ps=1) as cluster:
    strategy = tfdist_ext.DownpourStrategy(cluster.resolver, n_push=5, n_fetch=5)
    with strategy.scope():
        model = keras.Sequential(layers())
        model.compile(optimizer=keras.optimizers.SGD(schedule()), loss=loss)
    rates = Rates()
    model.fit(digits_train(), epochs=2, steps_per_epoch=42, verbose=0, callbacks=[rates])
    report(downpour=rates.seen, plain=plain_rates.seen, pushes=strategy.stats.summary()["pushes"])
""",
        timeout=280,
    )
    r = _result(proc)
    # 42 steps per epoch at n_push=5: 9 pushes per epoch (8 of 5 steps, 1 of
    # 2), and one more where the epoch's first round (one batch: its logs are
    # the callbacks' first) ends inside a push block.
    assert 18 <= r["pushes"] <= 20
    assert [s for s, _ in r["downpour"]] == [s for s, _ in r["plain"]] == [42, 84]
    for (_, rate), (_, expected) in zip(r["downpour"], r["plain"]):
        assert rate == pytest.approx(expected, rel=1e-6)
