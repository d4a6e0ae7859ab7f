"""The main job (internal): ``tfdist-ext demo``.

Starts a real local cluster (2 workers, 1 parameter server; each task in its
own network namespace where the OS allows it, else on 127.0.0.1),
reports each task as alive, trains an MLP on the bundled digits with Downpour
SGD through Keras ``model.fit``, and prints its held-out accuracy next to the
same model trained for the same number of steps in one process, then why
Downpour takes longer here and what the run does show.
"""

import argparse
import os
import time
import types


def _model(keras):
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adagrad(0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def _parse(argv):
    parser = argparse.ArgumentParser(prog="tfdist-ext demo")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100, help="steps per epoch")
    parser.add_argument("--n", type=int, default=2, help="n_fetch = n_push")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs, args.steps = 2, 40
    return args


def _load():
    """Keras and this package's parts, loaded quietly: this process is ours, so
    TensorFlow's start-up notices go, as in the tasks."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # After TF_CPP_MIN_LOG_LEVEL is set: TensorFlow reads it when it loads.
    from tfdist_ext._stderr import TF_START_UP_NOISE
    from tfdist_ext._stderr import native_log_without

    with native_log_without(TF_START_UP_NOISE):
        import keras

        from tfdist_ext import datasets
        from tfdist_ext.cluster import LocalCluster
        from tfdist_ext.downpour import DownpourStrategy
    return types.SimpleNamespace(
        keras=keras, datasets=datasets, LocalCluster=LocalCluster, Downpour=DownpourStrategy
    )


def _show_cluster(cluster, start):
    """Prints each task alive; the seconds the cluster took to answer."""
    network = "each task in its own network namespace" if cluster.isolated else "127.0.0.1"
    print(f"== local cluster: 2 workers, 1 parameter server ({network})")
    for task, devices in cluster.ping().items():
        job, index = task.split(":")
        print(f"   {task:<9} alive at {cluster.address(job, int(index))}  {devices[0]}")
    seconds = time.time() - start
    print(f"   all tasks answering after {seconds:.1f}s")
    return seconds


def _fit_downpour(parts, strategy, args, train, test):
    """``(held-out accuracy, seconds, strategy)`` of Downpour on the cluster."""
    print(
        f"== Downpour SGD, Keras model.fit: {args.epochs} epochs x {args.steps} steps, "
        f"n_fetch = n_push = {args.n}, Adagrad on the ps, digits (seed {args.seed})"
    )
    parts.keras.utils.set_random_seed(args.seed)
    with strategy.scope():
        model = _model(parts.keras)
    start = time.time()
    model.fit(train, epochs=args.epochs, steps_per_epoch=args.steps, verbose=2)
    seconds = time.time() - start
    return model.evaluate(test, verbose=0)[1], seconds, strategy


def _fit_baseline(keras, args, train, test):
    """``(held-out accuracy, seconds)`` of the same model in this process."""
    keras.utils.set_random_seed(args.seed)
    model = _model(keras)
    start = time.time()
    model.fit(train, epochs=args.epochs, steps_per_epoch=args.steps, shuffle=False, verbose=0)
    seconds = time.time() - start
    return model.evaluate(test, verbose=0)[1], seconds


def _report(args, startup_seconds, downpour, baseline):
    (accuracy, seconds, strategy), (base_accuracy, base_seconds) = downpour, baseline
    stats = strategy.stats.summary()
    print("== held-out accuracy on 450 digits")
    print(
        f"   Downpour, 2 async workers : {accuracy:.4f}  ({seconds:.1f}s, "
        f"staleness mean {stats['staleness_mean']:.2f} max {stats['staleness_max']:.0f}, "
        f"steps per worker {dict(sorted(strategy.stats.steps_per_worker.items()))})"
    )
    print(f"   single-process Keras      : {base_accuracy:.4f}  ({base_seconds:.1f}s, same steps)")
    step_ms = 1000 * base_seconds / (args.epochs * args.steps)
    print(
        f"   why Downpour is slower here: the ps round trips every {args.n} steps over gRPC, "
        f"4 processes on 2 cores, for a {step_ms:.1f} ms step (and the cluster's "
        f"{startup_seconds:.1f}s start, not counted); Downpour pays off when a step's compute "
        "is large and the network link is the limit (python -m benchmarks.run downpour)."
    )
    print(
        f"   what this shows: 2 worker processes train one Keras model asynchronously through "
        f"model.fit (staleness mean {stats['staleness_mean']:.2f}, max "
        f"{stats['staleness_max']:.0f}) to the accuracy of one process "
        f"({accuracy:.3f} vs {base_accuracy:.3f})."
    )


def main(argv=None):
    args = _parse(argv)
    parts = _load()
    start = time.time()
    with parts.LocalCluster(num_workers=2, num_ps=1) as cluster:
        startup_seconds = _show_cluster(cluster, start)
        # The strategy first: it connects this process to the cluster, and a
        # dataset made before that would belong to the runtime it replaces.
        strategy = parts.Downpour(cluster.resolver, n_fetch=args.n, n_push=args.n)
        train = parts.datasets.digits("train", flatten=True).shuffle(2048, seed=args.seed)
        train = train.batch(32).repeat()
        test = parts.datasets.digits("test", flatten=True).batch(150)
        downpour = _fit_downpour(parts, strategy, args, train, test)
        baseline = _fit_baseline(parts.keras, args, train, test)
        _report(args, startup_seconds, downpour, baseline)
    return 0
