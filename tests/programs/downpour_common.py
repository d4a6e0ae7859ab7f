"""What the Downpour and EASGD programs share: the digits data, the MLP they
train, and where the ops of a strategy's traced round run.

Not a program itself: ``downpour_cases``, ``downpour_dispatch_cases`` and
``elastic_cases`` import it.
"""

import keras

from tfdist_ext import datasets


def mlp(hidden=64):
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def compiled(model, optimizer=None):
    """``model`` compiled for the digits: Adagrad(0.05) unless ``optimizer``, with accuracy."""
    model.compile(
        optimizer=optimizer or keras.optimizers.Adagrad(0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def digits_train(batch=32):
    return datasets.digits("train", flatten=True).shuffle(2048, seed=0).batch(batch).repeat()


def digits_test():
    return datasets.digits("test", flatten=True).batch(150)


def round_ops(strategy):
    """Every op of the strategy's traced round function, nested functions included.

    A nested function (the round's step loop) is listed by every graph that
    calls it; each is read once.
    """
    (round_fn,) = strategy._runtime.round_functions()
    seen = set()

    def walk(graph):
        yield from graph.get_operations()
        for name, function in graph._functions.items():
            if name not in seen:
                seen.add(name)
                yield from walk(function.graph)

    for concrete in round_fn._list_all_concrete_functions():
        yield from walk(concrete.graph)


def op_devices(strategy, op_type):
    """{device: count} of the ops of ``op_type`` in the traced round function."""
    counts = {}
    for op in round_ops(strategy):
        if op.type == op_type:
            counts[op.device] = counts.get(op.device, 0) + 1
    return counts
