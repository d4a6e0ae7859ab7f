"""apply_goyal_recipe: zero-gamma on residual branches, weight decay as a loss term."""

import os

import keras
import numpy as np
import pytest

from tfdist_ext.recipes import apply_goyal_recipe
from tfdist_ext.recipes import residual_branch_norms

pytestmark = pytest.mark.timeout(120)


def resnet():
    def block(x, filters, name, project=False):
        shortcut = x
        y = keras.layers.Conv2D(filters, 3, padding="same", name=f"{name}_c1")(x)
        y = keras.layers.ReLU()(keras.layers.BatchNormalization(name=f"{name}_bn1")(y))
        y = keras.layers.Conv2D(filters, 3, padding="same", name=f"{name}_c2")(y)
        y = keras.layers.BatchNormalization(name=f"{name}_bn2")(y)
        if project:
            shortcut = keras.layers.Conv2D(filters, 1, name=f"{name}_proj")(shortcut)
            shortcut = keras.layers.BatchNormalization(name=f"{name}_proj_bn")(shortcut)
        return keras.layers.ReLU()(keras.layers.Add()([shortcut, y]))

    inputs = keras.Input((8, 8, 1))
    x = keras.layers.Conv2D(4, 3, padding="same", name="stem")(inputs)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization(name="stem_bn")(x))
    x = block(x, 4, "b1")
    x = block(x, 8, "b2", project=True)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(3, name="logits")(x))


def test_zero_gamma_on_last_bn_of_each_residual_branch_only():
    model = resnet()
    assert [bn.name for bn in residual_branch_norms(model)] == ["b1_bn2", "b2_bn2"]
    report = apply_goyal_recipe(model, weight_decay=1e-4)
    assert report["zero_gamma"] == ["b1_bn2", "b2_bn2"]
    for name in ("b1_bn2", "b2_bn2"):
        assert not np.any(model.get_layer(name).gamma.numpy())
        assert model.get_layer(name).get_config()["gamma_initializer"]["class_name"] == "Zeros"
    for name in ("stem_bn", "b1_bn1", "b2_bn1", "b2_proj_bn"):
        np.testing.assert_array_equal(model.get_layer(name).gamma.numpy(), 1.0)


def test_weight_decay_is_an_l2_loss_on_kernels_only():
    model = resnet()
    report = apply_goyal_recipe(model, weight_decay=2e-3, zero_gamma=False)
    assert set(report["weight_decay"]) == {
        "stem",
        "b1_c1",
        "b1_c2",
        "b2_c1",
        "b2_c2",
        "b2_proj",
        "logits",
    }
    assert report["zero_gamma"] == []
    kernels = [layer.kernel for layer in model.layers if hasattr(layer, "kernel")]
    expected = sum(1e-3 * float(np.sum(k.numpy() ** 2)) for k in kernels)
    x = np.zeros((2, 8, 8, 1), "float32")
    model(x)  # losses are recomputed on call
    np.testing.assert_allclose(float(sum(model.losses)), expected, rtol=1e-5)
    # No decay on BN parameters or biases.
    assert all(
        getattr(v, "regularizer", None) is None
        for v in model.trainable_weights
        if "kernel" not in v.path
    )


def test_recipe_survives_save_and_load(tmp_path):
    model = resnet()
    apply_goyal_recipe(model, weight_decay=1e-4)
    path = os.path.join(tmp_path, "r.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert not np.any(loaded.get_layer("b2_bn2").gamma.numpy())
    assert loaded.get_layer("b1_c1").kernel_regularizer is not None
    assert len(loaded.losses) == 7


def test_explicit_layers_and_errors():
    model = resnet()
    assert apply_goyal_recipe(model, weight_decay=0, zero_gamma_layers=["stem_bn"])[
        "zero_gamma"
    ] == ["stem_bn"]
    with pytest.raises(ValueError, match="no layer named 'nope'"):
        apply_goyal_recipe(model, zero_gamma_layers=["nope"])
    with pytest.raises(ValueError, match="not a normalisation layer"):
        apply_goyal_recipe(model, zero_gamma_layers=["stem"])
    with pytest.raises(ValueError, match="weight_decay must be a number >= 0"):
        apply_goyal_recipe(model, weight_decay=-1)
    with pytest.raises(ValueError, match="build the model first"):
        apply_goyal_recipe(keras.Sequential([keras.layers.Dense(2)]))
    with pytest.raises(ValueError, match="must be a keras.Model"):
        apply_goyal_recipe(keras.layers.Dense(2))
