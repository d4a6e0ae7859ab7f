"""Tutorial 1: Downpour SGD with Keras 3 ``model.fit`` on a local cluster.

Run it from the repository root::

    python tutorials/01_downpour.py            # about a minute on 2 cores
    python tutorials/01_downpour.py --quick    # a smoke run

What happens
------------
1. ``LocalCluster`` starts a real TensorFlow cluster on 127.0.0.1: two
   ``worker`` processes and one ``ps`` (parameter server) process, each a
   ``tf.distribute.Server``. This process is the ``chief``.
2. ``DownpourStrategy`` connects to it. Under ``strategy.scope()`` the model's
   variables and the optimizer's state are created on the ``ps`` task
   (split across ``ps`` tasks when there are several).
3. ``model.fit`` runs Downpour: each worker is an asynchronous model replica
   with its own copy of the parameters, trained on the batches Keras's own
   data pipeline reads on the chief (every example once per epoch). It
   fetches fresh parameters every ``n_fetch`` steps and pushes its summed
   gradients every ``n_push`` steps; the ps applies the compiled optimizer
   (Adagrad, as in the paper) to each push. Replicas never wait for each
   other.

The knobs
---------
``n_fetch`` / ``n_push``
    Larger values cut the bytes each step sends and receives (the logs show
    ``push_bytes_per_step`` and ``fetch_bytes_per_step``) at the cost of
    staler parameters.
``warmstart_steps``
    Train the first steps on a single replica before the others join, as the
    paper does to avoid a noisy start.
``staleness_mean`` / ``staleness_max`` (in the logs and ``History``)
    For each push, how many server updates happened since that replica last
    fetched. ``strategy.stats.staleness`` keeps every value.
``deadline``
    How long any wait on another task may take: a lost parameter server is a
    clear error, never a hang.

Seeds: data split 0, model seed 0.
"""

import argparse
import json
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

import tfdist_ext  # noqa: E402
from tfdist_ext import datasets  # noqa: E402


def build_model():
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def compile_model(model):
    model.compile(
        optimizer=keras.optimizers.Adagrad(0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def write_result(path, figures):
    """Writes this run's figures to ``path`` as JSON (NumPy numbers as Python ones)."""
    with open(path, "w") as f:
        json.dump(figures, f, indent=2, default=lambda value: value.item())


def train_downpour(cluster, seed, epochs, steps):
    """Downpour's ``fit`` on the cluster: the model, its data and figures."""
    strategy = tfdist_ext.DownpourStrategy(
        cluster.resolver, n_fetch=2, n_push=2, warmstart_steps=20
    )
    # Datasets are created after the strategy has connected this process
    # to the cluster.
    train = datasets.digits("train", flatten=True).shuffle(2048, seed=seed)
    train = train.batch(32).repeat()
    test = datasets.digits("test", flatten=True).batch(150)

    keras.utils.set_random_seed(seed)
    with strategy.scope():
        model = compile_model(build_model())
    history = model.fit(
        train, epochs=epochs, steps_per_epoch=steps, validation_data=test, verbose=2
    )
    accuracy = model.evaluate(test, verbose=0)[1]
    stats = strategy.stats.summary()
    print(f"\nDownpour (2 workers, n_fetch=n_push=2): held-out accuracy {accuracy:.4f}")
    print(
        f"  staleness mean {stats['staleness_mean']:.2f}, max {stats['staleness_max']:.0f}; "
        f"{stats['push_bytes_per_step']:.0f} bytes pushed and "
        f"{stats['fetch_bytes_per_step']:.0f} fetched per step; "
        f"steps per worker {strategy.stats.steps_per_worker}"
    )
    print(f"  staleness per epoch: {[round(v, 2) for v in history.history['staleness_mean']]}")
    figures = {
        "fit_steps": epochs * steps,
        "downpour_accuracy": accuracy,
        "staleness_mean": stats["staleness_mean"],
        "staleness_max": stats["staleness_max"],
        "push_bytes_per_step": stats["push_bytes_per_step"],
        "fetch_bytes_per_step": stats["fetch_bytes_per_step"],
        "steps_per_worker": strategy.stats.steps_per_worker,
        "staleness_per_epoch": history.history["staleness_mean"],
    }
    return model, (train, test), figures


def train_baseline(seed, train, test, epochs, steps):
    """The single-process baseline: the same model, steps and optimizer."""
    keras.utils.set_random_seed(seed)
    baseline = compile_model(build_model())
    baseline.fit(train, epochs=epochs, steps_per_epoch=steps, verbose=0)
    accuracy = baseline.evaluate(test, verbose=0)[1]
    print(f"Single-process Keras, same steps:       held-out accuracy {accuracy:.4f}")
    return accuracy


def save_and_reload(model, test):
    """A model trained with Downpour is a normal Keras model."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "downpour_digits.keras")
        model.save(path)
        reloaded = keras.models.load_model(path)
    accuracy = reloaded.evaluate(test, verbose=0)[1]
    print(f"Saved and reloaded outside the cluster: accuracy {accuracy:.4f}")
    return accuracy


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--result",
        metavar="PATH",
        help="write this run's figures as JSON to PATH (the tests read it)",
    )
    args = parser.parse_args(argv)
    epochs, steps = (3, 80) if args.quick else (6, 100)

    with tfdist_ext.LocalCluster(num_workers=2, num_ps=1) as cluster:
        alive = cluster.ping()
        for task, devices in alive.items():
            print(f"{task:<9} alive: {devices[0]}")
        model, (train, test), figures = train_downpour(cluster, args.seed, epochs, steps)
        keras_accuracy = train_baseline(args.seed, train, test, epochs, steps)
        reloaded_accuracy = save_and_reload(model, test)

    # The README's claims: accuracy (checked here) and speed (the benchmarks).
    downpour_accuracy = figures["downpour_accuracy"]
    close = downpour_accuracy >= keras_accuracy - 0.02
    print(
        f"\nVERDICT: Downpour within 2 points of single-process Keras at the same steps: "
        f"{'yes' if close else 'no'} ({'quick' if args.quick else 'full'} run: Downpour "
        f"{downpour_accuracy:.3f}, Keras {keras_accuracy:.3f}, seed {args.seed}); "
        "speed on 2 cores against one Keras process: python -m benchmarks.run "
        "downpour_throughput; time to accuracy: python -m benchmarks.run downpour"
    )
    if args.result:
        figures.update(
            quick=args.quick,
            seed=args.seed,
            tasks_alive=sorted(alive),
            keras_accuracy=keras_accuracy,
            reloaded_accuracy=reloaded_accuracy,
            within_2_points=close,
        )
        write_result(args.result, figures)


if __name__ == "__main__":
    main()
