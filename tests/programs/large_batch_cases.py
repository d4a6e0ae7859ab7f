"""LinearScalingWarmup and LinearScaling under a strategy of 2 logical CPUs:
``python -m tests.programs.large_batch_cases CASE [ARGS]``.

In a fresh process: the logical CPUs are split before TensorFlow starts. Each
case prints one ``RESULT`` line for ``tests/test_large_batch_callbacks.py``.
"""

import sys

import keras
import numpy as np
import tensorflow as tf

import tfdist_ext
from tests.programs import report
from tfdist_ext.callbacks import LinearScalingWarmup
from tfdist_ext.cluster import logical_cpus
from tfdist_ext.schedules import LinearScaling

#: The package's strategies a case can run under, by name (2 replicas for the
#: compressed mirrored one, 1 for the model-parallel one).
STRATEGIES = {
    "compressed_mirrored": lambda devices: tfdist_ext.CompressedMirroredStrategy(
        devices, compression="fp16"
    ),
    "model_parallel": lambda devices: tfdist_ext.ModelParallelStrategy(devices),
}


def data():
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32")


def rate_probe(model, rates):
    """A callback that appends the rate each step trains with to ``rates``."""
    return keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda batch, logs: rates.append(
            float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))
        )
    )


def mirrored():
    """The callback with momentum correction under tf.distribute.MirroredStrategy."""
    devices = logical_cpus(2)
    strategy = tf.distribute.MirroredStrategy(devices)
    x, y = data()
    with strategy.scope():
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        m.compile(
            optimizer=keras.optimizers.SGD(0.5, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    cb = LinearScalingWarmup(
        0.01, base_batch_size=8, per_replica_batch_size=8, warmup_epochs=1, momentum_correction=True
    )
    rates = []
    h = m.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[cb, rate_probe(m, rates)])
    report(
        {
            "global": cb.global_batch_size,
            "scale": cb.schedule.scale,
            "rates": rates,
            "logged": h.history["learning_rate"],
            "corrections": cb.corrections,
        }
    )


def _build(optimizer):
    m = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)]
    )
    m.compile(
        optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return m


def package(strategy_name, per_replica):
    """The callback under one of :data:`STRATEGIES` (its replicas' batches of
    ``per_replica``), then a model trained by the schedule itself."""
    devices = logical_cpus(2)
    strategy = STRATEGIES[strategy_name](devices)
    x, y = data()
    with strategy.scope():
        m = _build(keras.optimizers.SGD(0.5))
    cb = LinearScalingWarmup(
        0.01, base_batch_size=8, per_replica_batch_size=int(per_replica), warmup_epochs=1
    )
    rates = []
    m.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[cb, rate_probe(m, rates)])
    schedule = LinearScaling(
        0.01, base_batch_size=8, batch_size=16, warmup_epochs=1, steps_per_epoch=4
    )
    with strategy.scope():
        s = _build(keras.optimizers.SGD(schedule))
    h = s.fit(x, y, batch_size=16, epochs=2, verbose=0)
    report(
        {
            "global": cb.global_batch_size,
            "scale": cb.schedule.scale,
            "rates": rates,
            "scheduled_rate": round(
                float(keras.ops.convert_to_numpy(s.optimizer.learning_rate)), 6
            ),
            "iterations": int(s.optimizer.iterations.numpy()),
            "loss_positive": bool(h.history["loss"][-1] > 0),
        }
    )


CASES = {fn.__name__: fn for fn in (mirrored, package)}


def main(argv):
    """``CASE [ARGS]``: runs the case of that name with ARGS."""
    name, *args = argv
    CASES[name](*args)


if __name__ == "__main__":
    main(sys.argv[1:])
