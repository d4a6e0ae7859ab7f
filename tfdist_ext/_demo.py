"""The main job (internal): ``tfdist-ext demo``.

Starts a real local cluster and reports each task as alive, then trains a
small Keras model on the bundled digits with ``MirroredStrategy`` over two
logical CPU devices and prints held-out accuracy.
"""

import argparse
import os
import time


def main(argv=None):
    parser = argparse.ArgumentParser(prog="tfdist-ext demo")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs = min(args.epochs, 3)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

    from tfdist_ext.cluster import LocalCluster
    from tfdist_ext.cluster import logical_cpus

    devices = logical_cpus(2)
    print("== local cluster: 2 workers, 1 parameter server on 127.0.0.1")
    t0 = time.time()
    with LocalCluster(num_workers=2, num_ps=1) as cluster:
        for task, devs in cluster.ping().items():
            print(f"   {task:<9} alive at {cluster.address(*_split(task))}  {devs[0]}")
        print(f"   cluster up and answering in {time.time() - t0:.1f}s")

    import keras
    import tensorflow as tf

    from tfdist_ext import datasets

    keras.utils.set_random_seed(args.seed)
    train = datasets.digits("train").shuffle(2048, seed=args.seed).batch(64)
    test = datasets.digits("test").batch(256)
    strategy = tf.distribute.MirroredStrategy(devices)
    print(f"== MirroredStrategy over {strategy.num_replicas_in_sync} logical CPU devices, "
          f"digits (seed {args.seed})")
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ])
        model.compile(
            optimizer=keras.optimizers.Adam(1e-2),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    model.fit(train, epochs=args.epochs, verbose=0)
    _, accuracy = model.evaluate(test, verbose=0)
    print(f"   held-out accuracy after {args.epochs} epochs: {accuracy:.4f}")
    return 0


def _split(task):
    job, index = task.split(":")
    return job, int(index)
