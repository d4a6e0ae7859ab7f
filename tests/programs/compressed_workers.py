"""CompressedMultiWorkerMirroredStrategy as every worker runs it: ``python -m
tests.programs.compressed_workers CASE [ARGS]``.

Each worker process runs the same case with its own ``TF_CONFIG`` (from
``run_workers`` or a ``LocalCluster`` started with this ``command``) and
prints its own ``RESULT``, for ``tests/test_compression_multiworker.py``
and ``tests/test_netns.py`` to compare across workers.
"""

import importlib
import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf

from tests.programs import report
from tfdist_ext import _integration
from tfdist_ext import compression as C
from tfdist_ext import datasets
from tfdist_ext.callbacks._compression import CompressionLogger


def sharded_by_data(dataset):
    """``dataset`` split between the workers by example (not by file)."""
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return dataset.with_options(options)


def train(name, kwargs):
    """3 epochs of a digits MLP with compressor ``name`` (JSON ``kwargs``): each
    worker's weights, losses, compression ratios and statistics."""
    strategy = C.CompressedMultiWorkerMirroredStrategy(
        compression=C.get(name, **json.loads(kwargs))
    )
    keras.utils.set_random_seed(0)
    x, y = datasets.digits("train", flatten=True, as_numpy=True)
    ds = sharded_by_data(tf.data.Dataset.from_tensor_slices((x, y)).batch(64).take(8))
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(32, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
        model.compile(
            keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
    logger = CompressionLogger()
    history = model.fit(ds, epochs=3, verbose=0, callbacks=[logger])
    report(
        {
            "weights": [w.ravel().tolist() for w in model.get_weights()],
            "loss": history.history["loss"],
            "ratio": history.history["compression_ratio"],
            "stats": strategy.compression_stats(),
        }
    )


def ring_sum(pack):
    """The summable exchange's all-reduce of three tensors, ``pack`` bytes per pack:
    the sums and each CollectiveReduceV2's ``max_subdivs_per_device``."""
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    options = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=int(pack))
    strategy = C.CompressedMultiWorkerMirroredStrategy(communication_options=options)
    big = tf.fill([3_000_000], float(task + 1))  # 12 MB: a subdivided ring
    small = tf.range(6, dtype=tf.float16) * (task + 1)
    mid = tf.ones([1000, 300]) * (task + 1)

    @tf.function
    def total():
        return strategy.run(lambda: strategy._all_sum([big, small, mid]))

    out = total()
    reduces = [
        op.get_attr("max_subdivs_per_device")
        for op in total.get_concrete_function().graph.get_operations()
        if op.type == "CollectiveReduceV2"
    ]
    report(
        {
            "big": [float(tf.reduce_min(out[0])), float(tf.reduce_max(out[0]))],
            "small": out[1].numpy().tolist(),
            "small_dtype": out[1].dtype.name,
            "mid": [float(tf.reduce_min(out[2])), float(tf.reduce_max(out[2]))],
            "mid_shape": out[2].shape.as_list(),
            "subdivs": reduces,
        }
    )


def log_reduction():
    """A step's logs, different on each worker, reduced by Keras's own
    ``reduce_per_replica`` and by the function Keras's step functions call
    (the strategy's): both results and the collective reductions each traces."""
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    strategy = C.MultiWorkerMirroredStrategy()
    logs = {
        "loss": tf.constant(1.0 + task),
        "accuracy": tf.constant(0.25 * task),
        "seen": tf.constant(10.0 * (task + 1), tf.float64),
        "per_class": tf.constant([1.0, 3.0]) * (task + 1),
    }
    keras_reduce = _integration.keras_reduce_per_replica
    step_reduce = importlib.import_module(keras_reduce.__module__).reduce_per_replica
    out = {}
    for name, reduce in (("keras", keras_reduce), ("strategy", step_reduce)):
        function = tf.function(lambda reduce=reduce: reduce(logs, strategy, "auto"))
        values = function()
        graph = function.get_concrete_function().graph
        out[name] = {
            "logs": {k: np.asarray(v).tolist() for k, v in values.items()},
            "collectives": sum(op.type == "CollectiveReduceV2" for op in graph.get_operations()),
        }
    report(out)


def fp16_regression():
    """3 epochs of a linear regression whose all-reduce sends fp16: the task,
    its losses and kernel."""
    strategy = C.CompressedMultiWorkerMirroredStrategy(compression=C.get("fp16"))
    keras.utils.set_random_seed(0)
    x = np.random.RandomState(0).randn(256, 8).astype("float32")
    y = x.sum(1, keepdims=True)
    ds = sharded_by_data(tf.data.Dataset.from_tensor_slices((x, y)).batch(32))
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.05), "mse")
    history = model.fit(ds, epochs=3, verbose=0)
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    report(
        {
            "task": task,
            "loss": history.history["loss"],
            "kernel": model.get_weights()[0].ravel().tolist(),
        }
    )


CASES = {fn.__name__: fn for fn in (train, ring_sum, log_reduction, fp16_regression)}


def main(argv):
    """``CASE [ARGS]``: runs the case of that name with ARGS."""
    name, *args = argv
    CASES[name](*args)


if __name__ == "__main__":
    main(sys.argv[1:])
