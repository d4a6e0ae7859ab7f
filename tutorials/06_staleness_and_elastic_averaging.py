"""Tutorial 6: stale gradients, their corrections, and elastic averaging (EASGD).

Run it from the repository root::

    python tutorials/06_staleness_and_elastic_averaging.py            # about 3 minutes on 2 cores
    python tutorials/06_staleness_and_elastic_averaging.py --quick    # a smoke run

What happens
------------
Asynchronous training is only as good as its gradients are fresh. Here one of
two workers is a real straggler: ``LocalCluster.throttle("worker", 1, 4)``
stops its process (SIGSTOP) three quarters of the time. Each run trains the
same MLP on the bundled digits for the same number of steps, on its own
local cluster, and reports held-out accuracy and the staleness of every push:

1. plain Downpour (``n_fetch=8``: a replica fetches every 8 steps, pushes
   every step, so its pushes are computed from parameters up to several
   server updates old);
2. ``StalenessAwareLR()``: the server divides the rate of a push by its
   staleness (Zhang et al. 2016);
3. ``DelayCompensation(lam)``: DC-ASGD (Zheng et al. 2017), the server
   corrects a stale gradient ``g`` with ``lam * g * g * (w_now - w_fetched)``
   from a copy of the fetched parameters it keeps per worker;
4. ``max_staleness=2``: stale synchronous parallel, the fast worker waits
   when it is more than 2 fetch blocks ahead of the slow one;
5. ``ElasticAveragingStrategy(tau=8)``: EASGD (Zhang, Choromanska, LeCun
   2015). No gradient crosses the wire: each worker trains its own replica
   and every ``tau`` steps exchanges the elastic difference
   ``alpha * (replica - centre)`` with a centre variable on the ps.

The knobs
---------
``staleness_policy=`` / ``max_staleness=`` (``DownpourStrategy``)
    How the ps applies a stale push; how far a worker may run ahead.
``alpha`` / ``tau`` (``ElasticAveragingStrategy``)
    The moving rate of one exchange (default ``0.9 / num_workers``) and the
    local steps between exchanges. EASGD's local update is the compiled
    ``keras.optimizers.SGD`` (with momentum: EAMSGD).
``strategy.stats.staleness``
    Every push's staleness (for EASGD: the other replicas' exchanges between
    two of this replica's).

On this small model a run takes seconds, and how much the corrections help
depends on how stale the pushes really get; the measured comparison, on
digits and MNIST-1D against synchronous all-reduce, is the benchmark
``python -m benchmarks.run async_corrections``.

Seeds: data split 0, model seed 0 (``--seed``).
"""

import argparse
import json
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfdist_ext  # noqa: E402
from tfdist_ext import datasets  # noqa: E402

SLOWDOWN = 4


def build_model():
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def systems():
    """(name, strategy factory) of every run."""
    downpour = tfdist_ext.DownpourStrategy
    policies = tfdist_ext.downpour
    return [
        ("Downpour", lambda r: downpour(r, n_fetch=8)),
        (
            "+ StalenessAwareLR",
            lambda r: downpour(r, n_fetch=8, staleness_policy=policies.StalenessAwareLR()),
        ),
        (
            "+ DelayCompensation",
            lambda r: downpour(r, n_fetch=8, staleness_policy=policies.DelayCompensation(lam=2.0)),
        ),
        ("SSP max_staleness=2", lambda r: downpour(r, n_fetch=8, max_staleness=2)),
        ("EASGD tau=8", lambda r: tfdist_ext.ElasticAveragingStrategy(r, tau=8)),
    ]


def train(make_strategy, epochs, steps, seed, keep=None):
    """One run on its own cluster: (accuracy, staleness values, steps per worker)."""
    with tfdist_ext.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = make_strategy(cluster.resolver)
        # Datasets are made after the strategy has connected this process.
        train_data = datasets.digits("train", flatten=True).shuffle(2048, seed=seed)
        train_data = train_data.batch(32).repeat()
        test = datasets.digits("test", flatten=True).batch(150)
        keras.utils.set_random_seed(seed)
        with strategy.scope():
            model = build_model()
            model.compile(
                optimizer=keras.optimizers.SGD(0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
            )
        # A few steps first, so that every function is traced and registered
        # on the cluster before a worker is throttled (see LocalCluster.throttle).
        model.fit(train_data, epochs=1, steps_per_epoch=16, verbose=0)
        model.evaluate(test, verbose=0)
        strategy.stats.reset()
        with cluster.throttle("worker", 1, slowdown=SLOWDOWN):
            model.fit(train_data, epochs=epochs, steps_per_epoch=steps, verbose=0)
        accuracy = model.evaluate(test, verbose=0)[1]
        if keep is not None:  # a model trained this way is a normal Keras model
            model.save(keep)
        return accuracy, list(strategy.stats.staleness), dict(strategy.stats.steps_per_worker)


def histogram(values, width=40):
    """The staleness histogram as text bars."""
    if not values:
        return "  (no pushes)"
    counts = np.bincount(values)
    top = counts.max()
    return "\n".join(
        f"  {k:>3} | {'#' * max(1, round(width * c / top)) if c else ''} {c}"
        for k, c in enumerate(counts)
    )


def write_result(path, figures):
    """Writes this run's figures to ``path`` as JSON (NumPy numbers as Python ones)."""
    with open(path, "w") as f:
        json.dump(figures, f, indent=2, default=lambda value: value.item())


def train_all(epochs, steps, seed):
    """Trains every system; ``{name: (accuracy, staleness, steps per worker)}``
    and the held-out accuracy of EASGD's centre saved and reloaded."""
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        saved = os.path.join(tmp, "easgd_digits.keras")
        for name, make in systems():
            keep = saved if name.startswith("EASGD") else None
            results[name] = train(make, epochs, steps, seed, keep)
            accuracy, staleness, per_worker = results[name]
            print(
                f"{name:<22} held-out accuracy {accuracy:.4f}   staleness mean "
                f"{np.mean(staleness) if staleness else 0:.2f}, max "
                f"{max(staleness) if staleness else 0}   steps per worker {per_worker}",
                flush=True,
            )
        reloaded = keras.models.load_model(saved)
        test = datasets.digits("test", flatten=True, as_numpy=True)
        reloaded_accuracy = float(
            np.mean(np.argmax(reloaded.predict(test[0], verbose=0), 1) == test[1])
        )
    print(f"EASGD centre saved and reloaded without a cluster: accuracy {reloaded_accuracy:.4f}")
    return results, reloaded_accuracy


def comparison(results):
    """The best correction against plain Downpour, as figures."""
    plain, staleness, _ = results["Downpour"]
    best_name, (best, _, _) = max(
        ((n, r) for n, r in results.items() if n != "Downpour"), key=lambda item: item[1][0]
    )
    return {
        "best_correction": best_name,
        "best_accuracy": best,
        "downpour_accuracy": plain,
        "points_over_downpour": 100 * (best - plain),
        "downpour_mean_staleness": np.mean(staleness) if staleness else 0.0,
        "downpour_staleness_histogram": np.bincount(np.asarray(staleness, dtype=int)).tolist(),
    }


def per_run(results):
    return {
        name: {
            "accuracy": accuracy,
            "pushes": len(staleness),
            "staleness_mean": np.mean(staleness) if staleness else 0.0,
            "staleness_max": max(staleness) if staleness else 0,
            "steps_per_worker": per_worker,
        }
        for name, (accuracy, staleness, per_worker) in results.items()
    }


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
    epochs, steps = (2, 60) if args.quick else (5, 100)

    results, reloaded_accuracy = train_all(epochs, steps, args.seed)
    print(f"\nStaleness of plain Downpour's pushes (worker 1 slowed {SLOWDOWN}x):")
    print(histogram(results["Downpour"][1]))
    c = comparison(results)
    print(
        f"\nVERDICT: best correction here {c['best_correction']} at {c['best_accuracy']:.3f} "
        f"against plain Downpour {c['downpour_accuracy']:.3f} "
        f"({c['points_over_downpour']:+.1f} points; plain Downpour's mean staleness "
        f"{c['downpour_mean_staleness']:.1f}; {'quick' if args.quick else 'full'} run, "
        f"seed {args.seed}); one run on a small model, not a measurement: the comparison "
        "with synchronous all-reduce is python -m benchmarks.run async_corrections"
    )
    if args.result:
        figures = {
            "quick": args.quick,
            "seed": args.seed,
            "steps_per_run": epochs * steps,  # throttled steps of each run
            "runs": per_run(results),
            "easgd_reloaded_accuracy": reloaded_accuracy,
        }
        write_result(args.result, {**figures, **c})


if __name__ == "__main__":
    main()
