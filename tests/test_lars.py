"""LARS: the update against a NumPy reference, exclusions, validation, serialisation, fit,
MirroredStrategy and mixed precision."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.programs import run_program
from tfdist_ext import datasets
from tfdist_ext.optimizers import LARS
from tfdist_ext.schedules import LinearScaling

pytestmark = pytest.mark.timeout(120)


def reference_step(w, g, v, *, lr, momentum, weight_decay, eta, epsilon, adapt, decay):
    """One step of You et al.'s Algorithm 1 in NumPy (float64); returns (w, v)."""
    beta = weight_decay if decay else 0.0
    local = 1.0
    w_norm, g_norm = np.linalg.norm(w), np.linalg.norm(g)
    if adapt and w_norm > 0 and g_norm > 0:
        local = eta * w_norm / (g_norm + beta * w_norm + epsilon)
    step = lr * local * (g + beta * w)
    if momentum:
        v = momentum * v + step
        step = v
    return w - step, v


def _variables(rng):
    """name -> initial value; the zero ones exercise the trust ratio's zero-norm rule."""
    return {
        "kernel": rng.normal(size=(3, 4)),
        "bias": rng.normal(size=(4,)),
        "zero_kernel": np.zeros((2, 3)),  # ||w|| = 0
        "still_kernel": rng.normal(size=(2, 2)),  # ||g|| = 0
        "special_kernel": rng.normal(size=(5,)).reshape(5, 1),
    }


def _gradients(rng, values):
    grads = {name: rng.normal(size=value.shape) for name, value in values.items()}
    grads["still_kernel"] = np.zeros_like(values["still_kernel"])
    return grads


def _run(optimizer, values, grads_per_step):
    variables = [keras.Variable(v.astype(np.float32), name=name) for name, v in values.items()]
    for grads in grads_per_step:
        optimizer.apply([tf.constant(grads[v.name], tf.float32) for v in variables], variables)
    return {v.name: v.numpy() for v in variables}


def _reference(values, grads_per_step, rates, adapt, decay, **hyper):
    out = {}
    for name, w in values.items():
        v = np.zeros_like(w)
        for grads, lr in zip(grads_per_step, rates):
            w, v = reference_step(
                w, grads[name], v, lr=lr, adapt=adapt(name, w), decay=decay(name, w), **hyper
            )
        out[name] = w
    return out


def _matrix(name, w):
    return w.ndim > 1


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_steps_match_the_numpy_reference(momentum, weight_decay):
    rng = np.random.default_rng(0)
    values = _variables(rng)
    steps = [_gradients(rng, values) for _ in range(3)]
    hyper = dict(momentum=momentum, weight_decay=weight_decay, eta=0.02, epsilon=1e-6)
    got = _run(LARS(0.5, **hyper), values, steps)
    # Default: rank <= 1 variables (the bias) get neither the trust ratio nor decay.
    want = _reference(values, steps, [0.5] * 3, _matrix, _matrix, **hyper)
    for name in values:
        np.testing.assert_allclose(got[name], want[name], rtol=2e-5, atol=1e-6, err_msg=name)
    # The trust ratio really acts: the kernel's step is not plain SGD's.
    plain = _reference(values, steps, [0.5] * 3, lambda *a: False, _matrix, **hyper)
    assert np.abs(plain["kernel"] - want["kernel"]).max() > 1e-2


def test_exclusions_by_name_and_by_keras_method():
    rng = np.random.default_rng(1)
    values = _variables(rng)
    steps = [_gradients(rng, values) for _ in range(2)]
    hyper = dict(momentum=0.9, weight_decay=0.05, eta=0.01, epsilon=0.0)
    opt = LARS(
        0.3,
        exclude_from_weight_decay=["^kernel"],
        exclude_from_layer_adaptation=["special"],
        exclude_vectors=False,
        **hyper,
    )
    got = _run(opt, values, steps)
    want = _reference(
        values,
        steps,
        [0.3] * 2,
        lambda name, w: "special" not in name,  # the bias is adapted: exclude_vectors=False
        lambda name, w: name != "kernel",
        **hyper,
    )
    for name in values:
        np.testing.assert_allclose(got[name], want[name], rtol=2e-5, atol=1e-6, err_msg=name)

    # Keras's own exclude_from_weight_decay (here by variable) is honoured; the
    # layer-adaptation patterns default to the weight-decay ones.
    opt = LARS(0.3, **hyper)
    variables = [keras.Variable(v.astype(np.float32), name=n) for n, v in values.items()]
    opt.exclude_from_weight_decay(var_list=[variables[0]])
    for grads in steps:
        opt.apply([tf.constant(grads[v.name], tf.float32) for v in variables], variables)
    want = _reference(
        values, steps, [0.3] * 2, _matrix, lambda n, w: w.ndim > 1 and n != "kernel", **hyper
    )
    for v in variables:
        np.testing.assert_allclose(v.numpy(), want[v.name], rtol=2e-5, atol=1e-6, err_msg=v.name)
    # exclude_from_layer_adaptation=None means the weight-decay patterns.
    got = _run(LARS(0.3, exclude_from_weight_decay=["still"], **hyper), values, steps)
    want = _reference(
        values, steps, [0.3] * 2, *[lambda n, w: w.ndim > 1 and "still" not in n] * 2, **hyper
    )
    for name in values:
        np.testing.assert_allclose(got[name], want[name], rtol=2e-5, atol=1e-6, err_msg=name)


def test_a_schedule_sets_the_global_rate_at_each_step():
    rng = np.random.default_rng(2)
    values = _variables(rng)
    steps = [_gradients(rng, values) for _ in range(4)]
    schedule = LinearScaling(0.1, 16, 64, warmup_epochs=1, steps_per_epoch=4)
    rates = [float(schedule(i)) for i in range(4)]
    assert rates[0] < rates[-1]
    hyper = dict(momentum=0.9, weight_decay=1e-3, eta=0.01, epsilon=0.0)
    got = _run(LARS(schedule, **hyper), values, steps)
    want = _reference(values, steps, rates, _matrix, _matrix, **hyper)
    for name in values:
        np.testing.assert_allclose(got[name], want[name], rtol=2e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(learning_rate=-0.1), "learning_rate must be a finite number >= 0"),
        (dict(learning_rate=float("nan")), "learning_rate must be a finite number >= 0"),
        (dict(momentum=1.0), r"momentum must be in \[0, 1\)"),
        (dict(momentum=-0.5), r"momentum must be in \[0, 1\)"),
        (dict(momentum=True), r"momentum must be in \[0, 1\)"),
        (dict(weight_decay=-1e-4), "weight_decay must be a finite number >= 0"),
        (dict(weight_decay=float("inf")), "weight_decay must be a finite number >= 0"),
        (dict(eta=-0.001), "eta must be a finite number >= 0"),
        (dict(eta=float("inf")), "eta must be a finite number >= 0"),
        (dict(epsilon="1e-8"), "epsilon must be a finite number >= 0"),
        (dict(exclude_from_weight_decay="bias"), "exclude_from_weight_decay must be a list"),
        (dict(exclude_from_layer_adaptation=["("]), "invalid pattern"),
        (dict(exclude_vectors=1), "exclude_vectors must be True or False"),
        (dict(clipnorm=1.0, clipvalue=1.0), "Only one of"),
    ],
)
def test_bad_arguments_are_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LARS(**kwargs)


def test_config_round_trip_with_a_schedule():
    schedule = LinearScaling(0.1, 16, 512, warmup_epochs=1, steps_per_epoch=10)
    opt = LARS(
        schedule,
        momentum=0.8,
        weight_decay=5e-4,
        eta=0.002,
        epsilon=1e-9,
        exclude_from_weight_decay=["bias"],
        exclude_from_layer_adaptation=["gamma", "beta"],
        exclude_vectors=False,
        clipnorm=2.0,
    )
    config = opt.get_config()
    again = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(again) is LARS
    assert again.get_config() == config
    assert config["exclude_from_layer_adaptation"] == ["gamma", "beta"]
    assert type(again._learning_rate) is LinearScaling
    assert keras.saving.get_registered_name(LARS) == "tfdist_ext>LARS"


def _digits_model():
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(32),
            keras.layers.BatchNormalization(),
            keras.layers.ReLU(),
            keras.layers.Dense(10),
        ]
    )


def _digits():
    x, y = datasets.digits("train", flatten=True, as_numpy=True)
    return (x / 16.0).astype(np.float32), y


def test_fit_on_digits_reduces_the_loss():
    x, y = _digits()
    keras.utils.set_random_seed(0)
    model = _digits_model()
    model.compile(
        optimizer=LARS(2.0, weight_decay=5e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    history = model.fit(x, y, batch_size=128, epochs=5, verbose=0).history
    assert history["loss"][-1] < 0.5 * history["loss"][0]
    assert history["accuracy"][-1] > 0.85


@pytest.mark.slow
def test_save_and_load_keeps_the_optimizer(tmp_path):
    x, y = _digits()
    keras.utils.set_random_seed(0)
    model = _digits_model()
    model.compile(
        optimizer=LARS(1.0, weight_decay=5e-4, exclude_from_weight_decay=["gamma"]),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(x[:256], y[:256], batch_size=64, epochs=1, verbose=0)
    path = str(tmp_path / "lars.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.optimizer) is LARS
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    assert int(loaded.optimizer.iterations.numpy()) == 4
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    # A fresh process finds LARS once tfdist_ext.optimizers is imported (the
    # registration runs there; ``import tfdist_ext`` alone imports subpackages
    # lazily), with no custom_objects; with Keras alone it cannot.
    ok = run_program("saved_optimizers", "load_with_optimizers", path, timeout=90)
    assert ok["optimizer"] == "LARS"
    bare = run_program(
        "saved_optimizers", "load_with_keras_alone", path, timeout=90, expect_ok=False
    )
    assert bare.returncode != 0 and "Could not locate class 'LARS'" in bare.stderr


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_mirrored_strategy_matches_one_device():
    # In a fresh interpreter: a plain tf.distribute.MirroredStrategy restarts
    # TensorFlow's collective keys at the first group and instance, which the
    # process caches for its life, so it would collide with the strategies of
    # later tests in this process (TensorFlow's bug; see docs/architecture.md).
    r = run_program("lars_cases", "mirrored_matches_one_device", timeout=280)
    assert r["moved"] > 1e-3  # training moved them
    one = r["weights"]["one_device"]
    for strategy in ("mirrored", "compressed_mirrored"):
        for a, b in zip(r["weights"][strategy], one):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6)


def test_mixed_precision_wraps_it_in_a_loss_scale_optimizer():
    x, y = _digits()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(0)
        model = _digits_model()
        model.compile(
            optimizer=LARS(2.0, weight_decay=5e-4),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        history = model.fit(x, y, batch_size=128, epochs=3, verbose=0).history
    finally:
        keras.config.set_dtype_policy("float32")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert type(model.optimizer.inner_optimizer) is LARS
    assert np.isfinite(history["loss"]).all() and history["loss"][-1] < history["loss"][0]
    assert model.layers[0].kernel.dtype == "float32"
