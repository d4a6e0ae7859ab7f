"""LinearScaling / StepDecay: values, validation, serialisation with the model."""

import os

import keras
import numpy as np
import pytest

from tfdist_ext.schedules import LinearScaling
from tfdist_ext.schedules import StepDecay

pytestmark = pytest.mark.timeout(120)


def values(schedule, steps):
    return np.array([float(schedule(s)) for s in steps])


def test_gradual_warmup_is_a_line_from_base_to_k_times_base():
    lr = LinearScaling(
        0.1, base_batch_size=256, batch_size=2048, warmup_epochs=2, steps_per_epoch=10
    )
    assert lr.scale == 8 and lr.warmup_steps == 20
    got = values(lr, [0, 5, 10, 20, 21, 1000])
    np.testing.assert_allclose(
        got, [0.1, 0.1 + 0.7 * 0.25, 0.1 + 0.7 * 0.5, 0.8, 0.8, 0.8], rtol=1e-6
    )


def test_constant_warmup_and_no_warmup():
    constant = LinearScaling(0.1, 32, 128, warmup_epochs=1, steps_per_epoch=5, warmup="constant")
    np.testing.assert_allclose(values(constant, [0, 4, 5, 9]), [0.1, 0.1, 0.4, 0.4], rtol=1e-6)
    none = LinearScaling(0.1, 32, 128, warmup_epochs=0)
    np.testing.assert_allclose(values(none, [0, 3, 100]), [0.4] * 3, rtol=1e-6)


def test_after_schedule_is_scaled_and_warmup_lands_on_it():
    after = StepDecay(0.1, (3, 6), steps_per_epoch=10)
    lr = LinearScaling(0.1, 256, 1024, warmup_epochs=1, steps_per_epoch=10, after=after)
    got = values(lr, [0, 10, 29, 30, 59, 60])
    np.testing.assert_allclose(got, [0.1, 0.4, 0.4, 0.04, 0.04, 0.004], rtol=1e-5)


def test_step_decay_values():
    s = StepDecay(1.0, (30, 60, 80), steps_per_epoch=2, factor=0.5)
    np.testing.assert_allclose(
        values(s, [0, 59, 60, 120, 160, 1000]), [1, 1, 0.5, 0.25, 0.125, 0.125]
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(warmup_epochs=10, total_epochs=5), "longer than training"),
        (dict(warmup_epochs=1, steps_per_epoch=None), "steps_per_epoch is required"),
        (dict(warmup="linear"), "warmup must be one of"),
        (dict(batch_size=0), "batch_size must be a positive integer"),
        (dict(base_batch_size=12.5), "base_batch_size must be a positive integer"),
        (dict(base_learning_rate=-0.1), "base_learning_rate must be a positive number"),
        (dict(warmup_epochs=-1), "warmup_epochs must be a number >= 0"),
        (dict(after=3.0), "after must be a LearningRateSchedule"),
    ],
)
def test_bad_arguments_raise_at_construction(kwargs, match):
    args = dict(
        base_learning_rate=0.1,
        base_batch_size=32,
        batch_size=64,
        warmup_epochs=1,
        steps_per_epoch=10,
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        LinearScaling(**args)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(boundaries=(5, 3)), "strictly increasing"),
        (dict(boundaries=(0, 3)), "strictly increasing"),
        (dict(factor=2.0), r"factor must be in \(0, 1\]"),
        (dict(steps_per_epoch=0), "steps_per_epoch must be a positive integer"),
    ],
)
def test_step_decay_bad_arguments(kwargs, match):
    args = dict(base_learning_rate=0.1, boundaries=(3, 6), steps_per_epoch=10)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        StepDecay(**args)


def test_config_round_trip_with_nested_after():
    lr = LinearScaling(
        0.05,
        64,
        512,
        warmup_epochs=1.5,
        steps_per_epoch=4,
        after=StepDecay(0.05, (2, 4), steps_per_epoch=4),
        total_epochs=6,
    )
    restored = keras.optimizers.schedules.deserialize(keras.optimizers.schedules.serialize(lr))
    assert isinstance(restored, LinearScaling) and isinstance(restored.after, StepDecay)
    steps = range(0, 30, 3)
    np.testing.assert_allclose(values(restored, steps), values(lr, steps))


def test_optimizer_follows_schedule_in_fit_and_survives_save_load(tmp_path):
    x = np.random.default_rng(0).normal(size=(64, 5)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int32")
    lr = LinearScaling(
        0.01,
        8,
        16,
        warmup_epochs=1,
        steps_per_epoch=4,
        after=StepDecay(0.01, (2,), steps_per_epoch=4),
    )
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)])
    model.compile(
        optimizer=keras.optimizers.SGD(lr, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 4
    np.testing.assert_allclose(float(model.optimizer.learning_rate), 0.02, rtol=1e-6)
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    schedule = loaded.optimizer._learning_rate
    assert isinstance(schedule, LinearScaling)
    assert schedule.get_config()["after"]["config"]["boundaries"] == [2.0]
    assert int(loaded.optimizer.iterations.numpy()) == 4
    np.testing.assert_allclose(values(schedule, range(12)), values(lr, range(12)))
    loaded.fit(x, y, batch_size=16, epochs=1, verbose=0)  # resumes: steps 4..7
    # step 8 is epoch 2: the step decay (x0.1) of `after`, still scaled by k = 2
    np.testing.assert_allclose(float(loaded.optimizer.learning_rate), 0.002, rtol=1e-5)
