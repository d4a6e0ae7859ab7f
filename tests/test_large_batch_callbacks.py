"""LinearScalingWarmup and MomentumCorrection callbacks."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.programs import run_program
from tfdist_ext.callbacks import LinearScalingWarmup
from tfdist_ext.callbacks import MomentumCorrection
from tfdist_ext.schedules import LinearScaling

pytestmark = pytest.mark.timeout(120)


class RateProbe(keras.callbacks.Callback):
    """Records the rate each step trains with (read at batch begin, after the others)."""

    def __init__(self):
        super().__init__()
        self.rates = []

    def on_train_batch_begin(self, batch, logs=None):
        rate = keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)
        self.rates.append(float(rate))


def data(n=64, seed=0):
    x = np.random.default_rng(seed).normal(size=(n, 4)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32")


def model(optimizer=None):
    m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    m.compile(
        optimizer=optimizer or keras.optimizers.SGD(0.5, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return m


def test_sets_the_linear_scaling_rate_each_step_and_logs_it():
    x, y = data()
    cb = LinearScalingWarmup(0.01, base_batch_size=4, batch_size=16, warmup_epochs=2)
    probe = RateProbe()
    history = model().fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[cb, probe])
    expected = LinearScaling(0.01, 4, 16, warmup_epochs=2, steps_per_epoch=4)
    np.testing.assert_allclose(probe.rates, [float(expected(s)) for s in range(12)], rtol=1e-6)
    assert probe.rates[0] == pytest.approx(0.01) and probe.rates[-1] == pytest.approx(0.04)
    # the rate of each epoch's last step
    np.testing.assert_allclose(
        history.history["learning_rate"],
        [0.01 + 0.03 * 3 / 8, 0.01 + 0.03 * 7 / 8, 0.04],
        rtol=1e-5,
    )
    assert cb.global_batch_size == 16 and cb.schedule.scale == 4


def test_global_batch_from_data_and_constant_warmup():
    x, y = data()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(32, drop_remainder=True)
    cb = LinearScalingWarmup(0.01, base_batch_size=8, data=ds, warmup_epochs=1, warmup="constant")
    probe = RateProbe()
    model().fit(ds, epochs=2, verbose=0, callbacks=[cb, probe])
    np.testing.assert_allclose(probe.rates, [0.01, 0.01, 0.04, 0.04], rtol=1e-6)


def test_per_replica_batch_times_replicas_of_the_default_strategy():
    x, y = data()
    cb = LinearScalingWarmup(0.01, base_batch_size=8, per_replica_batch_size=16, warmup_epochs=1)
    model().fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[cb])
    assert cb.global_batch_size == 16  # 1 replica


def test_composes_with_reduce_lr_on_plateau():
    x, y = data()
    cb = LinearScalingWarmup(0.01, base_batch_size=4, batch_size=16, warmup_epochs=3)
    # min_delta so large that every epoch after the first is a "plateau":
    # the rate is halved at the end of epochs 2, 3 and 4.
    plateau = keras.callbacks.ReduceLROnPlateau(
        monitor="loss", factor=0.5, patience=0, min_delta=1e9, min_lr=0.0
    )
    probe = RateProbe()
    model().fit(x, y, batch_size=16, epochs=5, verbose=0, callbacks=[cb, plateau, probe])
    rates = np.array(probe.rates)
    expected = np.array(
        [
            float(LinearScaling(0.01, 4, 16, warmup_epochs=3, steps_per_epoch=4)(s))
            for s in range(20)
        ]
    )
    np.testing.assert_allclose(rates[:8], expected[:8], rtol=1e-6)
    # The halving during warm-up is kept as a factor on the rest of the ramp ...
    np.testing.assert_allclose(rates[8:12], expected[8:12] * 0.5, rtol=1e-5)
    # ... warm-up ends on 0.04 x the plateau's factors, then the plateau rules.
    np.testing.assert_allclose(rates[12:16], 0.04 * 0.25, rtol=1e-5)
    np.testing.assert_allclose(rates[16:], 0.04 * 0.125, rtol=1e-5)


def test_errors():
    x, y = data()
    with pytest.raises(ValueError, match="exactly one of batch_size"):
        LinearScalingWarmup(0.1, 32)
    with pytest.raises(ValueError, match="exactly one of batch_size"):
        LinearScalingWarmup(0.1, 32, batch_size=64, per_replica_batch_size=32)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(10)
    with pytest.raises(ValueError, match="not static"):
        LinearScalingWarmup(0.1, 32, data=ds)
    with pytest.raises(ValueError, match="warmup_epochs must be a positive number"):
        LinearScalingWarmup(0.1, 32, batch_size=64, warmup_epochs=0)
    too_long = LinearScalingWarmup(0.1, 4, batch_size=16, warmup_epochs=5)
    with pytest.raises(ValueError, match="longer than training"):
        model().fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[too_long])
    scheduled = model(keras.optimizers.SGD(LinearScaling(0.1, 4, 16, warmup_epochs=0)))
    with pytest.raises(ValueError, match="is a LearningRateSchedule"):
        scheduled.fit(
            x,
            y,
            batch_size=16,
            epochs=1,
            verbose=0,
            callbacks=[LinearScalingWarmup(0.1, 4, batch_size=16, warmup_epochs=1)],
        )
    with pytest.raises(ValueError, match="SGD with momentum > 0"):
        model(keras.optimizers.Adam(0.1)).fit(
            x, y, batch_size=16, epochs=1, verbose=0, callbacks=[MomentumCorrection()]
        )


def reference_sgd(x, y, w, rates, momentum, corrected):
    """Keras SGD on mean((xw - y)^2): v = m v - lr g; w += v (optionally corrected)."""
    v = np.zeros_like(w)
    out_of_velocity_w, u = w.copy(), np.zeros_like(w)
    previous = None
    for lr in rates:
        g = 2.0 / len(x) * x.T @ (x @ w - y)
        if corrected and previous:
            v *= lr / previous
        v = momentum * v - lr * g
        w = w + v
        previous = lr
        g2 = 2.0 / len(x) * x.T @ (x @ out_of_velocity_w - y)
        u = momentum * u + g2  # the paper's Eq. (9): rate outside
        out_of_velocity_w = out_of_velocity_w - lr * u
    return w, out_of_velocity_w


@pytest.mark.parametrize("corrected", [True, False])
def test_momentum_correction_matches_rate_outside_the_velocity(corrected):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 3)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")
    m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, use_bias=False)])
    w0 = m.get_weights()[0].astype("float64")
    lr = LinearScaling(0.01, 1, 8, warmup_epochs=1, steps_per_epoch=6)  # changes each step
    m.compile(optimizer=keras.optimizers.SGD(lr, momentum=0.9), loss="mse")
    cb = MomentumCorrection()
    m.fit(
        x, y, batch_size=16, epochs=8, shuffle=False, verbose=0, callbacks=[cb] if corrected else []
    )
    rates = [float(lr(s)) for s in range(8)]
    keras_form, paper_form = reference_sgd(
        x.astype("float64"), y.astype("float64"), w0, rates, 0.9, corrected
    )
    np.testing.assert_allclose(m.get_weights()[0], keras_form, rtol=1e-4, atol=1e-6)
    if corrected:
        # With correction Keras's form equals the paper's rate-outside form
        # (up to the paper's lr_t vs lr_{t+1} indexing: identical here).
        np.testing.assert_allclose(m.get_weights()[0], paper_form, rtol=1e-4, atol=1e-6)
        assert cb.corrections == 6
    else:
        assert np.abs(keras_form - paper_form).max() > 1e-3


def test_callback_with_momentum_correction_option():
    x, y = data()
    cb = LinearScalingWarmup(0.01, 4, batch_size=16, warmup_epochs=1, momentum_correction=True)
    model().fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[cb])
    assert cb.corrections == 4  # steps 1..4 change the rate (0 -> 4 is the ramp)


@pytest.mark.timeout(240)
def test_reads_the_replicas_of_mirrored_strategy():
    r = run_program("large_batch_cases", "mirrored", timeout=200)
    assert r["global"] == 16 and r["scale"] == 2.0, r
    np.testing.assert_allclose(r["rates"], [0.01, 0.0125, 0.015, 0.0175] + [0.02] * 4, rtol=1e-5)
    assert r["corrections"] == 4


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "strategy, per_replica",
    [pytest.param("compressed_mirrored", 8, marks=pytest.mark.slow), ("model_parallel", 16)],
)
def test_works_under_the_package_strategies(strategy, per_replica):
    # Same rule, same rates under the package's own strategies: the callback
    # reads their replica count (2 for the compressed mirrored strategy, 1
    # for the model-parallel one), and the schedule trains the model too.
    r = run_program("large_batch_cases", "package", strategy, per_replica, timeout=200)
    assert r["global"] == 16 and r["scale"] == 2.0, r
    np.testing.assert_allclose(r["rates"], [0.01, 0.0125, 0.015, 0.0175] + [0.02] * 4, rtol=1e-5)
    assert (r["scheduled_rate"], r["iterations"], r["loss_positive"]) == (0.02, 8, True), r


def test_benchmark_sgd_is_sgd_with_momentum_correction_at_any_steps_per_execution():
    """benchmarks.large_batch._sgd (the paper's Eq. (9) form, in-graph) equals
    Keras SGD + MomentumCorrection, also with several steps per execution."""
    from benchmarks.large_batch import MOMENTUM
    from benchmarks.large_batch import _sgd
    from tfdist_ext.schedules import StepDecay

    rng = np.random.default_rng(2)
    x = rng.normal(size=(16, 3)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")
    final = {}
    for form in ("callback", "in-graph"):
        keras.utils.set_random_seed(0)
        m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, use_bias=False)])
        # A gradual warm-up (the rate changes every step) and a decay by 10.
        lr = LinearScaling(
            0.01,
            1,
            8,
            warmup_epochs=1,
            steps_per_epoch=4,
            after=StepDecay(0.01, (2,), steps_per_epoch=4),
        )
        if form == "callback":
            m.compile(optimizer=keras.optimizers.SGD(lr, momentum=MOMENTUM), loss="mse")
            m.fit(
                x,
                y,
                batch_size=4,
                epochs=3,
                shuffle=False,
                verbose=0,
                callbacks=[MomentumCorrection()],
            )
        else:
            m.compile(optimizer=_sgd(lr), loss="mse", steps_per_execution=5)
            m.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0)
        assert int(m.optimizer.iterations.numpy()) == 12
        final[form] = m.get_weights()[0]
    np.testing.assert_allclose(final["in-graph"], final["callback"], rtol=1e-5, atol=1e-6)
