"""A weight split across 2 ps tasks, updated by Keras optimizers through
DownpourStrategy's per-shard updates: ``python -m tests.programs.split_variable_updates``.

One worker pushes the same three random gradients to each optimizer of
:data:`OPTIMIZERS`; this process then applies them with Keras to whole
weights. Prints, per optimizer, how far the server's weights and optimizer
state are from Keras's (``errors``) and where the update's arithmetic on the
kernel's pieces ran in the traced push (``devices``).
"""

import keras
import numpy as np
import tensorflow as tf

import tfdist_ext
from tests.programs import report
from tests.programs.downpour_common import mlp
from tfdist_ext.cluster import LocalCluster

OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "adagrad": lambda: keras.optimizers.Adagrad(0.05),
    "adam": lambda: keras.optimizers.Adam(0.01, amsgrad=True),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
    "ftrl": lambda: keras.optimizers.Ftrl(0.05, l1_regularization_strength=1e-3),
    "lion": lambda: keras.optimizers.Lion(0.001),
    "lamb": lambda: keras.optimizers.Lamb(0.01),
}
#: The arithmetic an elementwise update does on a piece.
ARITHMETIC = ("Mul", "RealDiv", "Sqrt", "AddV2", "Sub", "Neg", "Sign")


def model_and_grads():
    """The seeded model and its random gradients: the same ones every call."""
    keras.utils.set_random_seed(0)
    model = mlp(96)
    rng = np.random.RandomState(0)
    return model, [rng.randn(*v.shape).astype("float32") for v in model.trainable_variables]


def piece_arithmetic_devices(push, kernel):
    """{device: count} of the update's arithmetic on the kernel's pieces in ``push``."""
    pieces = {tuple(p.shape) for p in kernel.value.variables}
    counts = {}
    for f in push._list_all_concrete_functions():
        for op in f.graph.get_operations():
            if op.type in ARITHMETIC and tuple(op.outputs[0].shape) in pieces:
                counts[op.device] = counts.get(op.device, 0) + 1
    return counts


def on_the_server(strategy, make):
    """Three pushes of the gradients: the weights and optimizer state after
    them, and where the kernel's pieces were updated."""
    with strategy.scope():
        model, grads = model_and_grads()
        optimizer = make()
        optimizer.build(model.trainable_variables)
    kernel = model.layers[0].kernel
    assert type(kernel.value).__name__ == "ShardedVariable", type(kernel.value)
    trainable = model.trainable_variables

    @tf.function
    def push(gs):
        with strategy.extended.per_shard_updates(optimizer, trainable):
            optimizer.apply_gradients(zip(gs, trainable))
        return tf.constant(0)

    for _ in range(3):
        strategy.coordinator.schedule(push, args=([tf.constant(g) for g in grads],)).fetch()
    values = [v.numpy() for v in trainable + optimizer.variables]
    return values, piece_arithmetic_devices(push, kernel)


def by_keras(make):
    """The same three updates by Keras, in this process, on whole weights."""
    model, grads = model_and_grads()
    optimizer = make()
    optimizer.build(model.trainable_variables)
    for _ in range(3):
        optimizer.apply_gradients(zip([tf.constant(g) for g in grads], model.trainable_variables))
    return [v.numpy() for v in model.trainable_variables + optimizer.variables]


def main():
    results, devices = {}, {}
    with LocalCluster(num_workers=1, num_ps=2) as cluster:
        strategy = tfdist_ext.DownpourStrategy(cluster.resolver, min_shard_bytes=8 << 10)
        for name, make in OPTIMIZERS.items():
            results[name], devices[name] = on_the_server(strategy, make)
    errors = {}
    for name, make in OPTIMIZERS.items():
        expected = by_keras(make)
        # np.testing.assert_allclose's measure, rtol 1e-5: 0 when within atol 1e-6.
        errors[name] = max(
            float(np.max(np.abs(a - b) - 1e-5 * np.abs(b))) for a, b in zip(results[name], expected)
        )
    report({"errors": errors, "devices": devices})


if __name__ == "__main__":
    main()
