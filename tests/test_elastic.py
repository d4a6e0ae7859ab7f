"""ElasticAveragingStrategy (asynchronous EASGD) on a real local cluster, through ``model.fit``.

The killed-worker and NaN tests are shared with Downpour (test_downpour.py,
``ASYNC_STRATEGIES``).

Each cluster test runs in a fresh interpreter (``script``): one process can
connect to one TensorFlow cluster only.
"""

import json

import pytest
from test_downpour import PRELUDE

from conftest import ADDED_LOSS
from conftest import assert_added_loss_trained


def _result(proc):
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"alpha": 0.0}, "alpha"),
        ({"alpha": 1.0}, "alpha"),
        ({"alpha": -0.5}, "alpha"),
        ({"alpha": float("nan")}, "alpha"),
        ({"alpha": "0.1"}, "alpha"),
        ({"alpha": True}, "alpha"),
        ({"tau": 0}, "tau"),
        ({"tau": 2.5}, "tau"),
        ({"tau": None}, "tau"),
    ],
)
def test_bad_alpha_or_tau_is_refused_at_construction(kwargs, named):
    import tfdist_ext

    # Checked before the strategy touches the cluster: no resolver needed.
    with pytest.raises(ValueError, match=f"ElasticAveragingStrategy: {named}"):
        tfdist_ext.ElasticAveragingStrategy(None, **kwargs)


@pytest.mark.timeout(300)
def test_centre_and_replica_follow_the_easgd_rule_exactly(script):
    # One worker, so the order of exchanges is fixed: the centre after three
    # fits must be what EASGD's update (SGD with momentum locally, the
    # elastic exchange every tau steps, the replica and its momentum kept
    # between rounds and between fits, but started afresh from the centre
    # once the centre was set between fits) gives in NumPy.
    proc = script(
        PRELUDE
        + """
lr, momentum, alpha, tau, batch = 0.05, 0.5, 0.3, 3, 4
rng = np.random.default_rng(0)
x = rng.normal(size=(8, 2)).astype("float32")
y = (x @ np.array([[2.0], [-1.0]], "float32") + 0.5).astype("float32")
with LocalCluster(num_workers=1, num_ps=1) as cluster:
    strategy = tfdist_ext.ElasticAveragingStrategy(cluster.resolver, alpha=alpha, tau=tau)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat()
    with strategy.scope():
        model = keras.Sequential([keras.Input((2,)),
                                  keras.layers.Dense(1, kernel_initializer="ones",
                                                     bias_initializer="zeros")])
        model.compile(keras.optimizers.SGD(lr, momentum=momentum), "mse")
    model.fit(data, epochs=2, steps_per_epoch=12, verbose=0)    # two rounds
    model.fit(data, epochs=1, steps_per_epoch=12, verbose=0)    # continues
    centre_2 = [w.tolist() for w in model.get_weights()]
    model.set_weights([np.full((2, 1), 0.5, "float32"), np.ones(1, "float32")])
    model.fit(data, epochs=1, steps_per_epoch=12, verbose=0)    # afresh
    report(centre_2=centre_2,kernel=model.layers[0].kernel.numpy().tolist(),
           bias=model.layers[0].bias.numpy().tolist(),
           iterations=int(model.optimizer.iterations), stats=strategy.stats.summary())
""",
        timeout=280,
    )
    r = _result(proc)
    import numpy as np

    lr, momentum, alpha, tau, batch = 0.05, 0.5, 0.3, 3, 4
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 2)).astype("float32")
    y = (x @ np.array([[2.0], [-1.0]], "float32") + 0.5).astype("float32")
    centre = [np.ones((2, 1)), np.zeros(1)]
    step = 0
    for fit_steps, afresh in ((24, True), (12, False), (12, True)):
        if fit_steps == 12 and afresh:
            np.testing.assert_allclose(r["centre_2"][0], centre[0], rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(r["centre_2"][1], centre[1], rtol=1e-4, atol=1e-5)
            centre = [np.full((2, 1), 0.5), np.ones(1)]
        if afresh:
            replica = [c.copy() for c in centre]
            velocity = [np.zeros_like(c) for c in centre]
        for _ in range(fit_steps):
            start = (step * batch) % len(x)
            xb, yb = x[start : start + batch], y[start : start + batch]
            err = xb @ replica[0] + replica[1] - yb
            grads = [2 * xb.T @ err / batch, 2 * err.sum(0) / batch]
            velocity = [momentum * v - lr * g for v, g in zip(velocity, grads)]
            replica = [w + v for w, v in zip(replica, velocity)]
            step += 1
            if step % tau == 0:
                moves = [alpha * (w - c) for w, c in zip(replica, centre)]
                replica = [w - d for w, d in zip(replica, moves)]
                centre = [c + d for c, d in zip(centre, moves)]
    np.testing.assert_allclose(r["kernel"], centre[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(r["bias"], centre[1], rtol=1e-4, atol=1e-5)
    assert r["iterations"] == 48
    # 16 exchanges, none stale (one worker), bytes of the model each way per exchange.
    assert r["stats"]["pushes"] == 16 and r["stats"]["staleness_max"] == 0


# The compiled optimizer, as plain Keras would build it; options Keras applies
# itself (weight decay, clipping, loss scaling) included.
EXACT_OPTIMIZERS = {
    "adam": "keras.optimizers.Adam(0.05, weight_decay=0.02, clipnorm=0.5)",
    "adagrad": "keras.optimizers.Adagrad(0.3, global_clipnorm=2.0)",
    "loss_scale": "keras.optimizers.LossScaleOptimizer(keras.optimizers.RMSprop(0.02, momentum=0.5))",
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("optimizer", EXACT_OPTIMIZERS.values(), ids=EXACT_OPTIMIZERS.keys())
def test_replica_takes_plain_keras_optimizer_steps_between_exchanges(script, optimizer):
    # One worker: the centre after three epochs of tau=3 steps must be what a
    # plain Keras model (the replica, its optimizer state kept between
    # exchanges) trained with train_on_batch gives, with the elastic exchange
    # done by hand every tau steps. A callback halves the learning rate before
    # the last epoch: the replica's update must see it.
    proc = script(
        PRELUDE
        + f"""
alpha, tau, batch = 0.3, 3, 4
rng = np.random.default_rng(0)
x = rng.normal(size=(8, 2)).astype("float32")
y = (x @ np.array([[2.0], [-1.0]], "float32") + 0.5).astype("float32")

def make():
    model = keras.Sequential([keras.Input((2,)),
                              keras.layers.Dense(1, kernel_initializer="ones",
                                                 bias_initializer="zeros")])
    model.compile({optimizer}, "mse")
    return model

replica = make()
centre = replica.get_weights()
for step in range(9):
    if step == 6:
        replica.optimizer.learning_rate = float(np.asarray(replica.optimizer.learning_rate)) / 2
    start = (step * batch) % len(x)
    replica.train_on_batch(x[start:start + batch], y[start:start + batch])
    if (step + 1) % tau == 0:
        moves = [alpha * (w - c) for w, c in zip(replica.get_weights(), centre)]
        replica.set_weights([w - d for w, d in zip(replica.get_weights(), moves)])
        centre = [c + d for c, d in zip(centre, moves)]
halve = keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr / 2 if epoch == 2 else lr)
with LocalCluster(num_workers=1, num_ps=1) as cluster:
    strategy = tfdist_ext.ElasticAveragingStrategy(cluster.resolver, alpha=alpha, tau=tau)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat()
    with strategy.scope():
        model = make()
    model.fit(data, epochs=3, steps_per_epoch=3, verbose=0, callbacks=[halve])
    report(expected=[c.tolist() for c in centre], centre=[w.tolist() for w in model.get_weights()],
           iterations=int(model.optimizer.iterations), pushes=strategy.stats.summary()["pushes"])
""",
        timeout=280,
    )
    r = _result(proc)
    import numpy as np

    for got, expected in zip(r["centre"], r["expected"]):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    # The replica moved: the centre is not where it started.
    assert abs(r["expected"][0][0][0] - 1.0) > 1e-2
    assert r["iterations"] == 9 and r["pushes"] == 3


@pytest.mark.timeout(300)
def test_two_workers_train_digits_with_adaptive_optimizers(script):
    # DistBelief's Adagrad, Adam, and Adam under mixed_float16 (Keras wraps it
    # in a LossScaleOptimizer, whose loss scale each replica keeps).
    proc = script(
        PRELUDE
        + """
results = {}
with LocalCluster(num_workers=2, num_ps=1) as cluster:
    strategy = tfdist_ext.ElasticAveragingStrategy(cluster.resolver, tau=4)
    for name, make, policy in (("adagrad", lambda: keras.optimizers.Adagrad(0.1), "float32"),
                               ("adam", lambda: keras.optimizers.Adam(0.003), "float32"),
                               ("mixed_float16", lambda: keras.optimizers.Adam(0.003),
                                "mixed_float16")):
        keras.utils.set_random_seed(0)
        keras.mixed_precision.set_global_policy(policy)
        with strategy.scope():
            model = compile(mlp(), make())
        h = model.fit(digits_train(), epochs=3, steps_per_epoch=50, verbose=0)
        _, accuracy = model.evaluate(digits_test(), verbose=0)
        results[name] = dict(loss=h.history["loss"], accuracy=accuracy,
                             optimizer=type(model.optimizer).__name__,
                             rejected=h.history["rejected_pushes"])
        keras.mixed_precision.set_global_policy("float32")
report(results=results)
""",
        timeout=280,
    )
    results = _result(proc)["results"]
    assert results["mixed_float16"]["optimizer"] == "LossScaleOptimizer"
    for r in results.values():
        assert r["loss"][-1] < 0.7 * r["loss"][0], results
        # Ten classes: chance is 0.1.
        assert r["accuracy"] > 0.85, results
        assert r["rejected"] == [0, 0, 0], results


@pytest.mark.timeout(300)
def test_two_workers_train_digits_and_evaluate_the_centre(script):
    proc = script(
        PRELUDE
        + ADDED_LOSS
        + """
keras.utils.set_random_seed(0)
with LocalCluster(num_workers=2, num_ps=1) as cluster:
    strategy = tfdist_ext.ElasticAveragingStrategy(cluster.resolver, tau=4)
    with strategy.scope():
        model = compile(mlp(), keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True))
    h = model.fit(digits_train(), epochs=3, steps_per_epoch=60, verbose=0)
    _, accuracy = model.evaluate(digits_test(), verbose=0)
    stats, per_worker = strategy.stats.summary(), dict(strategy.stats.steps_per_worker)
    added = fit_added_loss(strategy)  # a layer's add_loss
    report(history=h.history, accuracy=accuracy, stats=stats, per_worker=per_worker,
           config=strategy.get_config(), **added)
""",
        timeout=280,
    )
    r = _result(proc)
    assert r["accuracy"] > 0.9, r
    assert r["history"]["loss"][-1] < r["history"]["loss"][0]
    assert set(r["per_worker"]) == {"0", "1"}
    # Each replica exchanges every tau=4 of its own steps, a period spanning
    # rounds and epochs: 180 steps, 44 or 45 exchanges.
    assert r["stats"]["pushes"] == sum(n // 4 for n in r["per_worker"].values()), r
    assert r["stats"]["rejected_pushes"] == 0
    # The loss a layer adds in call() is part of what the replicas train
    # (it was dropped: the reported loss lacked it).
    assert_added_loss_trained(r)
    assert r["config"] == {
        "alpha": 0.45,
        "tau": 4,
        "min_shard_bytes": 256 << 20,
        "deadline": 60.0,
    }


@pytest.mark.timeout(300)
def test_what_easgd_cannot_train_is_refused_before_the_first_step(script):
    proc = script(
        PRELUDE
        + """
class OwnStep(keras.Sequential):
    def train_step(self, data):
        return super().train_step(data)

refused = {}
with LocalCluster(num_workers=1, num_ps=1) as cluster:
    strategy = tfdist_ext.ElasticAveragingStrategy(cluster.resolver, tau=2)
    cases = {
        "ema": lambda: compile(mlp(), keras.optimizers.Adam(use_ema=True)),
        "ema_inner": lambda: compile(mlp(), keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.1, use_ema=True))),
        "accumulation": lambda: compile(
            mlp(), keras.optimizers.Adagrad(gradient_accumulation_steps=2)),
        "train_step": lambda: compile(
            OwnStep([keras.Input((64,)), keras.layers.Dense(10)]), keras.optimizers.SGD(0.1)),
    }
    for name, make in cases.items():
        with strategy.scope():
            model = make()
        batches = []
        seen = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, l: batches.append(b))
        try:
            model.fit(digits_train(), epochs=1, steps_per_epoch=4, verbose=0, callbacks=[seen])
            refused[name] = None
        except ValueError as e:
            refused[name] = [str(e), len(batches)]
report(refused=refused)
""",
        timeout=280,
    )
    refused = _result(proc)["refused"]
    expected = {
        "ema": "use_ema=True",
        "ema_inner": "SGD has use_ema=True",
        "accumulation": "gradient_accumulation_steps=2",
        "train_step": "compute_loss override",
    }
    for name, words in expected.items():
        assert refused[name] is not None, f"{name} was not refused"
        message, batches = refused[name]
        assert message.startswith("ElasticAveragingStrategy:") and words in message, message
        assert batches == 0, f"{name} refused only after {batches} batches"
