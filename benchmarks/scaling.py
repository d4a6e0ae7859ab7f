"""``scaling``: plain Keras ``model.fit`` in one process vs ``MirroredStrategy``
over two logical CPU devices, examples/second, MLP and small CNN.

Both systems live in the same process and share its CPU thread pool; they are
measured round-robin (medians of repeats) on the same seeded synthetic data.
"""

import time

from benchmarks import _harness


def _models(keras):
    def mlp():
        return keras.Sequential(
            [
                keras.Input((784,)),
                keras.layers.Dense(512, activation="relu"),
                keras.layers.Dense(512, activation="relu"),
                keras.layers.Dense(10),
            ]
        )

    def cnn():
        return keras.Sequential(
            [
                keras.Input((28, 28, 1)),
                keras.layers.Conv2D(32, 3, activation="relu"),
                keras.layers.MaxPooling2D(),
                keras.layers.Conv2D(64, 3, activation="relu"),
                keras.layers.MaxPooling2D(),
                keras.layers.Flatten(),
                keras.layers.Dense(128, activation="relu"),
                keras.layers.Dense(10),
            ]
        )

    return {"mlp": (mlp, (784,), 256), "cnn": (cnn, (28, 28, 1), 128)}


def _measurer(keras, strategy, build, ds, batch, steps, seed):
    """A model built and compiled under ``strategy``; a function measuring its
    examples/s over one ``fit`` of ``steps`` steps."""
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        model = build()
        model.compile(
            optimizer=keras.optimizers.SGD(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )

    def measure():
        start = time.perf_counter()
        model.fit(ds, epochs=1, steps_per_epoch=steps, verbose=0)
        return batch * steps / (time.perf_counter() - start)

    return measure


def run(quick=False, seed=0):
    from tfdist_ext.cluster import logical_cpus

    devices = logical_cpus(2)
    import keras
    import tensorflow as tf

    from tfdist_ext import datasets

    steps = 10 if quick else 40
    repeats = 2 if quick else 5
    figures, rows = [], []
    # One MirroredStrategy for the whole run: two instances in one process
    # collide on collective instance keys.
    mirrored = tf.distribute.MirroredStrategy(devices)
    for case, (build, shape, batch) in _models(keras).items():
        ds = (
            datasets.synthetic(batch * steps, input_shape=shape, seed=seed)
            .batch(batch)
            .cache()
            .repeat()
        )
        systems = {
            system: _measurer(keras, strategy, build, ds, batch, steps, seed)
            for system, strategy in (
                ("keras", tf.distribute.get_strategy()),
                ("mirrored-2", mirrored),
            )
        }
        samples = _harness.interleaved(systems, repeats)
        for system, values in samples.items():
            figures.append(
                _harness.figure(
                    case, system, "throughput", "examples/s", values, batch_size=batch, steps=steps
                )
            )
        base = _harness.median(samples["keras"])
        candidate = _harness.median(samples["mirrored-2"])
        rows.append([case, batch, base, candidate, candidate / base])
    return {
        "candidate": "tf.distribute.MirroredStrategy over 2 logical CPU devices",
        "peer": "plain Keras model.fit, one process, default strategy",
        "figures": figures,
        "table": {
            "columns": [
                "model",
                "global batch",
                "keras ex/s",
                "mirrored-2 ex/s",
                "mirrored / keras",
            ],
            "rows": rows,
        },
        "notes": [
            "Both systems share one process and its intra-op thread pool on a "
            f"{__import__('os').cpu_count()}-core CPU: logical devices split the "
            "work, not the cores, so this measures MirroredStrategy's overhead.",
            f"medians of {repeats} interleaved repeats of {steps} steps each, "
            "after one discarded warm-up round",
        ],
    }
