"""IndependentBatchNormalization: group statistics, errors, serialisation, replicas."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.programs import run_program
from tfdist_ext.layers import IndependentBatchNormalization

pytestmark = pytest.mark.timeout(120)


def grouped_reference(x, n, axis, eps):
    """NumPy: normalise each group of n examples with its own statistics."""
    g = x.reshape(-1, n, *x.shape[1:])
    axes = tuple(a for a in range(g.ndim) if a not in (0, axis + 1))
    mean = g.mean(axis=axes, keepdims=True)
    var = g.var(axis=axes, keepdims=True)
    out = ((g - mean) / np.sqrt(var + eps)).reshape(x.shape)
    return out, mean.mean(axis=0).ravel(), var.mean(axis=0).ravel()


@pytest.mark.parametrize("shape, axis", [((12, 5), -1), ((8, 4, 4, 3), -1), ((8, 3, 6), 1)])
def test_each_group_of_n_is_normalised_with_its_own_statistics(shape, axis):
    rng = np.random.default_rng(0)
    x = (rng.normal(size=shape) * 3 + rng.normal(size=shape[:1] + (1,) * (len(shape) - 1))).astype(
        "float32"
    )
    n = 4
    bn = IndependentBatchNormalization(virtual_batch_size=n, axis=axis, momentum=0.0, epsilon=1e-3)
    out = bn(x, training=True).numpy()
    ref, mean, var = grouped_reference(x, n, axis % len(shape), 1e-3)
    np.testing.assert_allclose(out, ref, atol=2e-5)
    np.testing.assert_allclose(bn.moving_mean.numpy(), mean, atol=1e-5)
    np.testing.assert_allclose(bn.moving_variance.numpy(), var, rtol=1e-4)
    # and the same result in a traced function with a dynamic batch dimension
    fn = tf.function(
        lambda t: bn(t, training=True), input_signature=[tf.TensorSpec((None, *shape[1:]))]
    )
    np.testing.assert_allclose(fn(x).numpy(), ref, atol=2e-5)


def test_one_group_equals_keras_batch_norm_and_inference_uses_moving_stats():
    x = np.random.default_rng(1).normal(size=(16, 6)).astype("float32") + 2
    ibn = IndependentBatchNormalization(virtual_batch_size=16, momentum=0.5)
    bn = keras.layers.BatchNormalization(momentum=0.5)
    np.testing.assert_allclose(
        ibn(x, training=True).numpy(), bn(x, training=True).numpy(), atol=1e-5
    )
    np.testing.assert_allclose(ibn.moving_mean.numpy(), bn.moving_mean.numpy(), atol=1e-6)
    np.testing.assert_allclose(ibn.moving_variance.numpy(), bn.moving_variance.numpy(), atol=1e-6)
    # inference: moving statistics, any batch size
    np.testing.assert_allclose(
        ibn(x[:5], training=False).numpy(), bn(x[:5], training=False).numpy(), atol=1e-6
    )


def test_moving_statistics_are_mean_aggregated_variables():
    bn = IndependentBatchNormalization(virtual_batch_size=2)
    bn.build((None, 3))
    assert bn.moving_mean.aggregation == "mean"
    assert bn.moving_variance.aggregation == "mean"
    assert bn.gamma.aggregation != "mean"


def test_errors():
    for bad in (0, -2, 2.5, True, None):
        with pytest.raises(ValueError, match="virtual_batch_size must be a positive integer"):
            IndependentBatchNormalization(virtual_batch_size=bad)
    with pytest.raises(ValueError, match="synchronized=True"):
        IndependentBatchNormalization(virtual_batch_size=4, synchronized=True)
    with pytest.raises(ValueError, match="renorm"):
        IndependentBatchNormalization(virtual_batch_size=4, renorm=True)
    with pytest.raises(ValueError, match="batch axis"):
        IndependentBatchNormalization(virtual_batch_size=4, axis=0)
    bn = IndependentBatchNormalization(virtual_batch_size=4)
    with pytest.raises(ValueError, match=r"multiple of virtual_batch_size=4.*batch of 6"):
        bn(np.zeros((6, 3), "float32"), training=True)
    fn = tf.function(lambda t: bn(t, training=True), input_signature=[tf.TensorSpec((None, 3))])
    with pytest.raises(tf.errors.InvalidArgumentError, match="multiple of virtual_batch_size"):
        fn(np.zeros((6, 3), "float32"))
    assert bn(np.zeros((6, 3), "float32"), training=False).shape == (6, 3)


def test_save_and_load_model_round_trip(tmp_path):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(32, 6)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8),
            IndependentBatchNormalization(virtual_batch_size=4, momentum=0.8, name="ibn"),
            keras.layers.Dense(2),
        ]
    )
    model.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    path = os.path.join(tmp_path, "ibn.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    layer = loaded.get_layer("ibn")
    assert isinstance(layer, IndependentBatchNormalization)
    assert layer.virtual_batch_size == 4 and layer.momentum == pytest.approx(0.8)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6)
    np.testing.assert_allclose(
        loaded(x, training=True).numpy(), model(x, training=True).numpy(), atol=1e-5
    )
    clone = IndependentBatchNormalization.from_config(model.get_layer("ibn").get_config())
    assert clone.virtual_batch_size == 4


@pytest.mark.timeout(280)
def test_one_replica_4n_equals_four_replicas_n_only_with_independent_bn():
    """1 replica x 4n vs MirroredStrategy 4 x n on logical CPUs, 6 training steps.

    Few steps on purpose: SGD on a net amplifies float rounding differences
    (the all-reduce order) chaotically over hundreds of steps.
    """
    results = run_program("batchnorm_cases", "replicas", timeout=260)
    assert set(results) == {"independent", "plain", "sync"}, results
    ibn, plain, sync = results["independent"], results["plain"], results["sync"]
    assert ibn["copies"] == 4
    # Independent BN: same statistics per group, same moving statistics, same
    # training trajectory, and every replica's copy identical (mean aggregation).
    assert ibn["weight_diff"] < 1e-4 and ibn["stat_diff"] < 1e-5 and ibn["spread"] == 0.0
    # Plain Keras BN: statistics over 4n vs over n -> a different model, and its
    # moving statistics (aggregation "none") differ between replica copies.
    assert plain["weight_diff"] > 1e-3 and plain["spread"] > 1e-3
    # Keras's synchronised BN over 4 replicas x n is plain BN over 4n on 1 replica;
    # the "1x4n" column of sync runs on one device, where it is plain BN.
    assert sync["weight_diff"] < 1e-4 and sync["spread"] < 1e-6
