"""LARS under a plain tf.distribute.MirroredStrategy: ``python -m
tests.programs.lars_cases CASE``.

In a fresh process: a plain MirroredStrategy restarts TensorFlow's
collective keys at the first group and instance, which a process caches for
its life, so it would collide with the strategies of later tests in the
test process (TensorFlow's bug; see docs/architecture.md).
"""

import sys

import keras
import numpy as np
import tensorflow as tf

from tests.programs import report
from tfdist_ext import datasets
from tfdist_ext.cluster import logical_cpus
from tfdist_ext.compression import CompressedMirroredStrategy
from tfdist_ext.optimizers import LARS


def digits():
    x, y = datasets.digits("train", flatten=True, as_numpy=True)
    return (x / 16.0).astype(np.float32), y


def dense_model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(16), keras.layers.Dense(10)])


def fit_weights(strategy, x, y, steps=6):
    """The trainable weights after ``steps`` LARS steps with momentum and decay."""
    with strategy.scope():
        model = dense_model(0)
        model.compile(
            optimizer=LARS(1.0, momentum=0.9, weight_decay=1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(32).take(steps)
    model.fit(ds, epochs=1, verbose=0, shuffle=False)
    return [w.numpy() for w in model.trainable_weights]


def mirrored_matches_one_device():
    """The weights of the same LARS steps on one device, under MirroredStrategy and
    under CompressedMirroredStrategy (dense: no compressor) on 2 devices, and
    how far training moved them on one."""
    devices = logical_cpus(2)
    x, y = digits()
    one = fit_weights(tf.distribute.OneDeviceStrategy(devices[0]), x, y)
    start = [w.numpy() for w in dense_model(0).trainable_weights]
    weights = {"one_device": [w.tolist() for w in one]}
    for name, strategy in (
        ("mirrored", tf.distribute.MirroredStrategy(devices[:2])),
        ("compressed_mirrored", CompressedMirroredStrategy(devices[:2])),
    ):
        weights[name] = [w.tolist() for w in fit_weights(strategy, x, y)]
    moved = min(np.abs(a - b).max() for a, b in zip(one, start))
    report({"moved": float(moved), "weights": weights})


CASES = {fn.__name__: fn for fn in (mirrored_matches_one_device,)}


def main(argv):
    """``CASE``: runs the case of that name."""
    name, *args = argv
    CASES[name](*args)


if __name__ == "__main__":
    main(sys.argv[1:])
