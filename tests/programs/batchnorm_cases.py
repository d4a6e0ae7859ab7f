"""Batch normalisation, 1 replica x 4n against MirroredStrategy 4 x n on logical
CPUs: ``python -m tests.programs.batchnorm_cases CASE``.

In a fresh process: the CPU is split into 4 logical devices before
TensorFlow starts. Prints one ``RESULT`` line for
``tests/test_layers_batchnorm.py``.
"""

import sys

import keras
import numpy as np
import tensorflow as tf

from tests.programs import report
from tfdist_ext.cluster import logical_cpus
from tfdist_ext.layers import IndependentBatchNormalization

N = 8  # examples per replica

#: The normalisations compared, by name.
NORMS = {
    "independent": lambda: IndependentBatchNormalization(
        virtual_batch_size=N, momentum=0.5, name="bn"
    ),
    "plain": lambda: keras.layers.BatchNormalization(momentum=0.5, name="bn"),
    "sync": lambda: keras.layers.BatchNormalization(momentum=0.5, synchronized=True, name="bn"),
}


def data():
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(4 * N * 6, 10)) + np.repeat(np.arange(24), N)[:, None] * 0.3).astype(
        "float32"
    )
    return x, (x[:, 0] + x[:, 1] > x[:, 2]).astype("int32")


def build(norm):
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((10,)),
            keras.layers.Dense(16, name="d1"),
            norm(),
            keras.layers.ReLU(),
            keras.layers.Dense(2),
        ]
    )


def trained(norm, strategy, x, y):
    """The weights after one epoch under ``strategy``, and the moving mean's
    copies (one a replica)."""
    with strategy.scope():
        model = build(norm)
        model.compile(
            optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    # Same global batches of 4n in the same order; under MirroredStrategy
    # fit splits each into 4 contiguous per-replica slices of n.
    # (train_on_batch would not split it.)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(4 * N, drop_remainder=True)
    model.fit(ds, epochs=1, verbose=0)
    bn = model.get_layer("bn")
    copies = [
        np.asarray(c) for c in getattr(bn.moving_mean.value, "values", [bn.moving_mean.value])
    ]
    return model.get_weights(), copies


def replicas():
    """For each of :data:`NORMS`: how far the weights and the moving mean of
    1 x 4n and 4 x n differ, and how far the 4 replicas' copies spread."""
    devices = logical_cpus(4)
    mirrored = tf.distribute.MirroredStrategy(devices)
    x, y = data()
    results = {}
    for name, norm in NORMS.items():
        w1, c1 = trained(norm, tf.distribute.get_strategy(), x, y)
        w4, c4 = trained(norm, mirrored, x, y)
        results[name] = {
            "weight_diff": max(float(np.abs(a - b).max()) for a, b in zip(w1, w4)),
            "spread": max(float(np.abs(c - c4[0]).max()) for c in c4),
            "stat_diff": float(np.abs(c1[0] - c4[0]).max()),
            "copies": len(c4),
        }
    report(results)


CASES = {fn.__name__: fn for fn in (replicas,)}


def main(argv):
    """``CASE``: runs the case of that name."""
    name, *args = argv
    CASES[name](*args)


if __name__ == "__main__":
    main(sys.argv[1:])
