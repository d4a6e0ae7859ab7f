"""ModelParallelStrategy under TensorFlow's own placement log: ``python -m
tests.programs.model_parallel_cases CASE``.

In a fresh process: the placement log must be switched on before TensorFlow
starts. ``placement_log`` writes ``START`` and ``END`` to stderr around a fit
whose ops TensorFlow logs there (at ``TF_CPP_MIN_LOG_LEVEL=0``), for
``tests/test_model_parallel.py`` to read.
"""

import sys

import tensorflow as tf

from tests.programs import report


def placement_log():
    """A run_eagerly fit of two Dense layers placed on two logical CPUs."""
    tf.debugging.set_log_device_placement(True)  # must precede TF's start-up
    from tfdist_ext.cluster import logical_cpus

    devices = logical_cpus(2)
    import keras
    import numpy as np

    from tfdist_ext.model_parallel import ModelParallelStrategy

    strategy = ModelParallelStrategy(devices, partition={"first": devices[0], "second": devices[1]})
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((4,)),
                keras.layers.Dense(3, name="first"),
                keras.layers.Dense(2, name="second"),
            ]
        )
        model.compile(
            "sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True), run_eagerly=True
        )
    x = np.ones((8, 4), "float32")
    y = np.zeros((8,), "int32")
    strategy.place(model)
    print("START", file=sys.stderr, flush=True)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    print("END", file=sys.stderr, flush=True)
    tf.debugging.set_log_device_placement(False)  # the RESULT line alone on stdout
    report({"fitted": True})


CASES = {fn.__name__: fn for fn in (placement_log,)}


def main(argv):
    """``CASE``: runs the case of that name."""
    name, *args = argv
    CASES[name](*args)


if __name__ == "__main__":
    main(sys.argv[1:])
