"""What n_push does to the step: ``python -m tests.programs.push_sum K``.

One worker, ``DownpourStrategy(n_fetch=K, n_push=K)``, plain SGD, one round
of K batches (``steps_per_execution=K``, one epoch of K steps). Prints the
weights it ends with, the weights of one Keras SGD step of rate ``K * lr``
on the K batches together (their mean gradient), and of K sequential Keras
steps of rate ``lr``.
"""

import sys

import keras
import numpy as np
import tensorflow as tf

import tfdist_ext
from tests.programs import report

LR, BATCH = 0.05, 16


def model():
    keras.utils.set_random_seed(0)
    net = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(3)]
    )
    return net


def compiled(net, lr, steps):
    net.compile(
        keras.optimizers.SGD(lr),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=steps,
    )
    return net


def distance(a, b):
    """The largest absolute difference between two lists of weights."""
    return float(max(np.max(np.abs(p - q)) for p, q in zip(a, b)))


def main(k):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(k * BATCH, 8)).astype("float32")
    y = rng.integers(0, 3, size=k * BATCH)
    initial = model().get_weights()
    together = compiled(model(), k * LR, 1)
    together.set_weights(initial)
    together.fit(x, y, batch_size=k * BATCH, epochs=1, shuffle=False, verbose=0)
    sequential = compiled(model(), LR, 1)
    sequential.set_weights(initial)
    sequential.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    # Read before the cluster: connecting makes this process's variables unreachable.
    one_step, k_steps = together.get_weights(), sequential.get_weights()
    with tfdist_ext.LocalCluster(num_workers=1, num_ps=1) as cluster:
        strategy = tfdist_ext.DownpourStrategy(cluster.resolver, n_fetch=k, n_push=k)
        with strategy.scope():
            net = compiled(model(), LR, k)
            net.set_weights(initial)
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
        net.fit(data, epochs=1, verbose=0)
        pushes = strategy.stats.summary()["pushes"]
        downpour = net.get_weights()

    report(
        {
            "pushes": pushes,
            "to_one_step_of_k_lr": distance(downpour, one_step),
            "to_k_sequential_steps": distance(downpour, k_steps),
            "moved": distance(downpour, initial),
        }
    )


if __name__ == "__main__":
    main(int(sys.argv[1]))
