"""Real data, offline: loaders that return ``tf.data.Dataset`` of ``(x, y)``.

Nothing here downloads. The sources are:

* :func:`digits` -- scikit-learn's bundled 8x8 handwritten digits (1797 real
  images shipped inside scikit-learn).
* :func:`mnist1d` -- MNIST-1D generated procedurally by the ``mnist1d``
  package with its standard arguments (4000 train / 1000 test).
* :func:`synthetic` -- a seeded synthetic classification set of any size.
* :func:`from_tfds` -- any TFDS data set already prepared in a local
  ``data_dir`` (``download=False``).

Every loader returns unbatched examples (features ``float32``, labels
``int32``); batch them as usual. Pass ``as_numpy=True`` to get ``(x, y)``
NumPy arrays instead.

Example:
  >>> from tfdist_ext import datasets
  >>> train = datasets.digits("train").shuffle(2048, seed=0).batch(64)
  >>> x_test, y_test = datasets.digits("test", as_numpy=True)
"""

import functools
import importlib
from collections.abc import Sequence
from typing import Literal
from typing import TYPE_CHECKING
from typing import Union

import numpy as np

if TYPE_CHECKING:  # this module stays light: TensorFlow is imported on use
    import tensorflow as tf

SPLITS = ("train", "test")
Split = Literal["train", "test"]
# A tf.data.Dataset of (x, y), or the (x, y) arrays with as_numpy=True.
Data = Union["tf.data.Dataset", tuple[np.ndarray, np.ndarray]]


def _optional(module, loader, extra):
    """Imports a data set's optional dependency, or says which extra has it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"datasets.{loader} needs the '{module.split('.')[0]}' package, which is "
            f"not installed: pip install 'tfdist_ext[{extra}]'"
        ) from e


def _check_split(loader, split):
    if split not in SPLITS:
        raise ValueError(f"{loader}: split must be one of {SPLITS}, got {split!r}")


def _result(x, y, as_numpy):
    x = np.ascontiguousarray(x, dtype=np.float32)
    y = np.ascontiguousarray(y, dtype=np.int32)
    if as_numpy:
        return x, y
    # as_numpy needs no TensorFlow: it loads only for a tf.data.Dataset.
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices((x, y))


@functools.lru_cache(maxsize=8)
def _digits_arrays(test_fraction, seed):
    sklearn_datasets = _optional("sklearn.datasets", "digits", "data")
    train_test_split = _optional("sklearn.model_selection", "digits", "data").train_test_split

    bunch = sklearn_datasets.load_digits()
    x = bunch.images.astype(np.float32) / 16.0
    return train_test_split(
        x,
        bunch.target,
        test_size=test_fraction,
        random_state=seed,
        stratify=bunch.target,
    )


def digits(
    split: Split = "train",
    *,
    flatten: bool = False,
    test_fraction: float = 0.25,
    seed: int = 0,
    as_numpy: bool = False,
) -> Data:
    """scikit-learn's bundled handwritten digits, scaled to [0, 1].

    Args:
      split: ``"train"`` or ``"test"`` (a stratified split).
      flatten: features of shape ``(64,)`` instead of ``(8, 8, 1)``.
      test_fraction: fraction of the 1797 images held out for ``"test"``.
      seed: seed of the split.
      as_numpy: return ``(x, y)`` arrays instead of a ``tf.data.Dataset``.

    Example:
      >>> ds = digits("train", flatten=True).batch(32)   # x: (32, 64), y: (32,)
    """
    _check_split("digits", split)
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"digits: test_fraction must be in (0, 1), got {test_fraction!r}")
    x_train, x_test, y_train, y_test = _digits_arrays(float(test_fraction), int(seed))
    x, y = (x_train, y_train) if split == "train" else (x_test, y_test)
    x = x.reshape(len(x), -1) if flatten else x[..., None]
    return _result(x, y, as_numpy)


@functools.lru_cache(maxsize=4)
def _mnist1d_arrays(seed):
    data_module = _optional("mnist1d.data", "mnist1d", "data")

    args = data_module.get_dataset_args()
    args.seed = seed
    data = data_module.make_dataset(args)  # procedural: never touches args.url
    return data["x"], data["y"], data["x_test"], data["y_test"]


def mnist1d(
    split: Split = "train", *, channels: bool = False, seed: int = 42, as_numpy: bool = False
) -> Data:
    """MNIST-1D, generated procedurally (standard arguments: 4000/1000, length 40).

    Args:
      split: ``"train"`` (4000 examples) or ``"test"`` (1000 examples).
      channels: features of shape ``(40, 1)`` (for ``Conv1D``) instead of ``(40,)``.
      seed: generator seed (42 is the package's standard set).
      as_numpy: return ``(x, y)`` arrays instead of a ``tf.data.Dataset``.

    Example:
      >>> ds = mnist1d("test", channels=True).batch(100)   # x: (100, 40, 1)
    """
    _check_split("mnist1d", split)
    x_train, y_train, x_test, y_test = _mnist1d_arrays(int(seed))
    x, y = (x_train, y_train) if split == "train" else (x_test, y_test)
    if channels:
        x = x[..., None]
    return _result(x, y, as_numpy)


def synthetic(
    num_examples: int = 10000,
    *,
    input_shape: Sequence[int] = (32,),
    num_classes: int = 10,
    seed: int = 0,
    noise: float = 0.5,
    as_numpy: bool = False,
) -> Data:
    """A seeded synthetic classification set of any size.

    Examples are drawn around ``num_classes`` random class centres with
    Gaussian noise of scale ``noise``; the same seed gives the same set.

    Args:
      num_examples: number of examples (>= 1).
      input_shape: shape of one example's features.
      num_classes: number of classes (>= 2).
      seed: random seed.
      noise: standard deviation of the noise around the class centre.
      as_numpy: return ``(x, y)`` arrays instead of a ``tf.data.Dataset``.

    Example:
      >>> ds = synthetic(10000, input_shape=(28, 28, 1), seed=1).batch(256)
    """
    if isinstance(num_examples, bool) or not isinstance(num_examples, int) or num_examples < 1:
        raise ValueError(
            f"synthetic: num_examples must be a positive integer, got {num_examples!r}"
        )
    if not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"synthetic: num_classes must be an integer >= 2, got {num_classes!r}")
    input_shape = tuple(int(d) for d in input_shape)
    if not input_shape or min(input_shape) < 1:
        raise ValueError(
            f"synthetic: input_shape must be non-empty and positive, got {input_shape!r}"
        )
    rng = np.random.default_rng(seed)
    dim = int(np.prod(input_shape))
    centres = rng.normal(size=(num_classes, dim)).astype(np.float32)
    y = rng.integers(0, num_classes, size=num_examples)
    x = centres[y] + noise * rng.normal(size=(num_examples, dim)).astype(np.float32)
    return _result(x.reshape((num_examples, *input_shape)), y, as_numpy)


def from_tfds(name: str, split: str = "train", *, data_dir: str, as_numpy: bool = False) -> Data:
    """A TFDS data set prepared on disk in ``data_dir``; never downloads.

    Returns ``(features, label)`` pairs (TFDS ``as_supervised=True``), images
    scaled to [0, 1] as ``float32``.

    Example:
      >>> ds = from_tfds("mnist", "test", data_dir="~/tensorflow_datasets")  # doctest: +SKIP
    """
    if not data_dir:
        raise ValueError("from_tfds: data_dir is required (nothing is downloaded)")
    # TensorFlow loads only when used: the CLI, launchers and cluster start without it.
    import tensorflow as tf

    tfds = _optional("tensorflow_datasets", "from_tfds", "tfds")
    ds = tfds.load(
        name,
        split=split,
        data_dir=data_dir,
        download=False,
        as_supervised=True,
        shuffle_files=False,
    )

    def convert(x, y):
        if x.dtype == tf.uint8:
            x = tf.cast(x, tf.float32) / 255.0
        return tf.cast(x, tf.float32), tf.cast(y, tf.int32)

    ds = ds.map(convert)
    if as_numpy:
        xs, ys = zip(*tfds.as_numpy(ds))
        return np.stack(xs), np.asarray(ys, dtype=np.int32)
    return ds


def as_numpy(dataset: "tf.data.Dataset") -> tuple[np.ndarray, np.ndarray]:
    """Collects an unbatched ``(x, y)`` dataset into two NumPy arrays.

    Example:
      >>> x, y = as_numpy(digits("test"))
    """
    xs, ys = [], []
    for x, y in dataset.as_numpy_iterator():
        xs.append(x)
        ys.append(y)
    return np.stack(xs), np.asarray(ys)


__all__ = ["as_numpy", "digits", "from_tfds", "mnist1d", "synthetic"]
