"""Offline data loaders."""

import numpy as np
import pytest
import tensorflow as tf

from tfdist_ext import datasets


def test_digits_real_images_and_stratified_split():
    x_train, y_train = datasets.digits("train", as_numpy=True)
    x_test, y_test = datasets.digits("test", as_numpy=True)
    assert x_train.shape == (1347, 8, 8, 1) and x_test.shape == (450, 8, 8, 1)
    assert len(x_train) + len(x_test) == 1797
    assert x_train.dtype == np.float32 and y_train.dtype == np.int32
    assert 0.0 <= x_train.min() and x_train.max() == 1.0
    assert set(np.unique(y_test)) == set(range(10))
    ds = datasets.digits("train", flatten=True)
    assert ds.element_spec[0].shape == (64,)
    assert ds.element_spec[1].dtype == tf.int32
    x, _ = next(iter(ds.batch(5)))
    np.testing.assert_allclose(x.numpy(), x_train[:5].reshape(5, 64))


def test_mnist1d_standard_split_and_determinism():
    x, y = datasets.mnist1d("train", as_numpy=True)
    xt, yt = datasets.mnist1d("test", as_numpy=True)
    assert x.shape == (4000, 40) and xt.shape == (1000, 40)
    assert set(np.unique(y)) == set(range(10))
    ds = datasets.mnist1d("test", channels=True)
    assert ds.element_spec[0].shape == (40, 1)
    x2, _ = datasets.mnist1d("train", as_numpy=True)
    np.testing.assert_array_equal(x, x2)


def test_synthetic_is_seeded_and_any_size():
    a, ya = datasets.synthetic(500, input_shape=(4, 4, 2), num_classes=3, seed=7, as_numpy=True)
    b, yb = datasets.synthetic(500, input_shape=(4, 4, 2), num_classes=3, seed=7, as_numpy=True)
    c, _ = datasets.synthetic(500, input_shape=(4, 4, 2), num_classes=3, seed=8, as_numpy=True)
    assert a.shape == (500, 4, 4, 2) and set(np.unique(ya)) <= {0, 1, 2}
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(ya, yb)
    assert not np.array_equal(a, c)
    assert datasets.synthetic(3).cardinality().numpy() == 3


def test_synthetic_is_learnable():
    # Class centres are separated: a nearest-centroid rule beats chance by far.
    x, y = datasets.synthetic(2000, input_shape=(16,), num_classes=4, seed=0, as_numpy=True)
    centroids = np.stack([x[y == k].mean(0) for k in range(4)])
    pred = np.argmin(((x[:, None] - centroids[None]) ** 2).sum(-1), axis=1)
    assert (pred == y).mean() > 0.9


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: datasets.digits("validation"), "split must be one of"),
        (lambda: datasets.digits(test_fraction=1.0), "test_fraction"),
        (lambda: datasets.mnist1d("dev"), "split must be one of"),
        (lambda: datasets.synthetic(0), "num_examples"),
        (lambda: datasets.synthetic(10, num_classes=1), "num_classes"),
        (lambda: datasets.synthetic(10, input_shape=(0,)), "input_shape"),
        (lambda: datasets.from_tfds("mnist", data_dir=None), "data_dir"),
    ],
)
def test_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_from_tfds_local_data_dir_with_tfds_mock_data(tmp_path):
    import tensorflow_datasets as tfds

    with tfds.testing.mock_data(num_examples=12, data_dir=str(tmp_path)):
        ds = datasets.from_tfds("mnist", "train", data_dir=str(tmp_path))
        x, y = datasets.from_tfds("mnist", "test", data_dir=str(tmp_path), as_numpy=True)
    examples = list(ds.as_numpy_iterator())
    assert len(examples) == 12
    image, label = examples[0]
    assert image.shape == (28, 28, 1) and image.dtype == np.float32
    assert 0.0 <= image.min() and image.max() <= 1.0
    assert x.shape == (12, 28, 28, 1) and y.dtype == np.int32


def test_as_numpy_collects_dataset():
    x, y = datasets.as_numpy(datasets.digits("test"))
    x2, y2 = datasets.digits("test", as_numpy=True)
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)
