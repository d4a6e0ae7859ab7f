"""``large_batch``: held-out error against total batch k*n (Goyal et al., 2017, Fig. 1/2).

For MNIST-1D and the bundled digits, a small ResNet-style CNN whose batch
norm is ``IndependentBatchNormalization(virtual_batch_size=n)`` is trained
with SGD + momentum on a total batch ``k * n`` (k = 1 ... 32, n fixed, same
number of epochs) under three rules:

* ``scaled+warmup``: ``LinearScaling`` (rate k * eta) with gradual warm-up;
* ``scaled``: linear scaling without warm-up;
* ``unscaled``: rate eta whatever k.

The k workers are simulated on one device: a total batch ``k * n`` with BN
statistics over groups of ``n`` is exactly what k workers with per-worker
batch n and local BN compute (the gradients of the mean loss are the same).
A second experiment runs the same model with 1 replica x batch 4n and with
``MirroredStrategy`` over 4 logical CPUs x batch n, with independent and with
plain batch norm. PNG plots go to ``benchmarks/results/``.
"""

import os
import time

import numpy as np

from benchmarks import _harness

KS = (1, 2, 4, 8, 16, 32)
VARIANTS = ("scaled+warmup", "scaled", "unscaled")

# Per data set: per-worker batch n, base rate eta (for batch n), epochs,
# warm-up epochs, step-decay epochs, width of the CNN.
CONFIG = {
    "mnist1d": dict(n=16, eta=0.02, epochs=10, warmup=2, decay=(5, 8), width=16),
    "digits": dict(n=16, eta=0.02, epochs=12, warmup=2, decay=(6, 9), width=16),
}
WEIGHT_DECAY = 5e-4
MOMENTUM = 0.9


def _load(name):
    from tfdist_ext import datasets

    if name == "mnist1d":
        train = datasets.mnist1d("train", channels=True, as_numpy=True)
        test = datasets.mnist1d("test", channels=True, as_numpy=True)
    else:
        train = datasets.digits("train", as_numpy=True)
        test = datasets.digits("test", as_numpy=True)
    mean, std = train[0].mean(), train[0].std()
    return ((train[0] - mean) / std, train[1]), ((test[0] - mean) / std, test[1])


def build_model(input_shape, width, norm, num_classes=10):
    """A small ResNet: stem, two residual blocks (the second downsamples), GAP, Dense."""
    import keras

    conv = keras.layers.Conv1D if len(input_shape) == 2 else keras.layers.Conv2D

    def block(x, filters, stride, name):
        shortcut = x
        y = conv(filters, 3, strides=stride, padding="same", use_bias=False,
                 name=f"{name}_conv1")(x)
        y = keras.layers.ReLU()(norm(f"{name}_bn1")(y))
        y = conv(filters, 3, padding="same", use_bias=False, name=f"{name}_conv2")(y)
        y = norm(f"{name}_bn2")(y)
        if stride != 1 or shortcut.shape[-1] != filters:
            shortcut = conv(filters, 1, strides=stride, use_bias=False,
                            name=f"{name}_proj")(shortcut)
            shortcut = norm(f"{name}_proj_bn")(shortcut)
        return keras.layers.ReLU()(keras.layers.Add()([shortcut, y]))

    inputs = keras.Input(input_shape)
    x = conv(width, 3, padding="same", use_bias=False, name="stem_conv")(inputs)
    x = keras.layers.ReLU()(norm("stem_bn")(x))
    x = block(x, width, 1, "block1")
    x = block(x, 2 * width, 2, "block2")
    pool = (keras.layers.GlobalAveragePooling1D if len(input_shape) == 2
            else keras.layers.GlobalAveragePooling2D)
    x = pool()(x)
    return keras.Model(inputs, keras.layers.Dense(num_classes, name="logits")(x))


def _ibn(n):
    from tfdist_ext.layers import IndependentBatchNormalization

    return lambda name: IndependentBatchNormalization(
        virtual_batch_size=n, momentum=0.9, name=name)


def _plain_bn(name):
    import keras

    return keras.layers.BatchNormalization(momentum=0.9, name=name)


def _rate(variant, cfg, k, steps_per_epoch):
    from tfdist_ext.schedules import LinearScaling
    from tfdist_ext.schedules import StepDecay

    n, eta = cfg["n"], cfg["eta"]
    after = StepDecay(eta, cfg["decay"], steps_per_epoch=steps_per_epoch)
    batch = n if variant == "unscaled" else k * n
    warmup = cfg["warmup"] if variant == "scaled+warmup" else 0
    return LinearScaling(eta, n, batch, warmup_epochs=warmup,
                         steps_per_epoch=steps_per_epoch, after=after,
                         total_epochs=cfg["epochs"])


def _train(data, cfg, k, variant, seed, epochs):
    import keras
    import tensorflow as tf

    from tfdist_ext.callbacks import MomentumCorrection
    from tfdist_ext.recipes import apply_goyal_recipe

    (x, y), (x_test, y_test) = data
    batch = k * cfg["n"]
    steps = len(x) // batch
    keras.utils.set_random_seed(seed)
    model = build_model(x.shape[1:], cfg["width"], _ibn(cfg["n"]))
    apply_goyal_recipe(model, weight_decay=WEIGHT_DECAY)
    cfg = dict(cfg, epochs=epochs)
    model.compile(
        optimizer=keras.optimizers.SGD(_rate(variant, cfg, k, steps), momentum=MOMENTUM),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    ds = (tf.data.Dataset.from_tensor_slices((x, y))
          .shuffle(len(x), seed=seed, reshuffle_each_iteration=True)
          .batch(batch, drop_remainder=True).prefetch(2))
    start = time.perf_counter()
    history = model.fit(ds, epochs=epochs, verbose=0, callbacks=[MomentumCorrection()])
    seconds = time.perf_counter() - start
    _, accuracy = model.evaluate(x_test, y_test, batch_size=500, verbose=0)
    loss = history.history["loss"]
    return {
        "test_error": 100.0 * (1.0 - accuracy),
        "train_error_curve": [100.0 * (1.0 - a) for a in history.history["accuracy"]],
        "train_loss_curve": [float(v) if np.isfinite(v) else None for v in loss],
        "diverged": not np.isfinite(loss[-1]),
        "seconds": seconds,
    }


def _grid(name, data, cfg, ks, seeds, epochs, log):
    runs = {}
    for k in ks:
        for seed in seeds:
            # At k = 1 the three rules are the same rate: train once.
            variants = VARIANTS[:1] if k == 1 else VARIANTS
            for variant in variants:
                result = _train(data, cfg, k, variant, seed, epochs)
                runs[(k, variant, seed)] = result
                log(f"{name} k={k:2d} {variant:14s} seed={seed}: "
                    f"error {result['test_error']:.2f}% ({result['seconds']:.0f}s)")
            if k == 1:
                for variant in VARIANTS[1:]:
                    runs[(1, variant, seed)] = runs[(1, VARIANTS[0], seed)]
    return runs


def _replica_experiment(mirrored, seed, epochs, log):
    """1 replica x batch 4n vs 4 replicas x batch n, independent vs plain BN.

    Both systems see the same global batches of 4n in the same order
    (``fit`` on one unshuffled, pre-permuted ``tf.data`` pipeline, which
    ``MirroredStrategy`` splits into 4 contiguous slices of n). Reported: the
    largest weight difference after 1 and 10 steps and after ``epochs``
    epochs, and the held-out accuracies. A third run, 1 replica with one
    kernel perturbed by 1e-7, gives the floating-point noise floor: SGD on
    this net amplifies a 1e-7 difference to O(0.1) in a few hundred steps.
    """
    import keras
    import tensorflow as tf

    cfg = CONFIG["mnist1d"]
    n = cfg["n"]
    (x, y), (x_test, y_test) = _load("mnist1d")
    order = np.random.default_rng(seed).permutation(len(x))
    ds = tf.data.Dataset.from_tensor_slices((x[order], y[order])).batch(
        4 * n, drop_remainder=True)
    systems = (("1x4n", tf.distribute.get_strategy(), False), ("4xn", mirrored, False),
               ("1x4n+1e-7", tf.distribute.get_strategy(), True))
    out = {}
    for norm_name, norm in (("independent", _ibn(n)), ("plain", _plain_bn)):
        results = {}
        for system, strategy, perturb in systems:
            if perturb and norm_name == "plain":
                continue
            keras.utils.set_random_seed(seed)
            with strategy.scope():
                model = build_model(x.shape[1:], cfg["width"], norm)
                model.compile(
                    optimizer=keras.optimizers.SGD(cfg["eta"] * 4, momentum=MOMENTUM),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    metrics=["accuracy"],
                )
            if perturb:
                kernel = model.get_layer("stem_conv").kernel
                kernel.assign(kernel.numpy() + 1e-7 * np.random.default_rng(1).normal(
                    size=kernel.shape).astype("float32"))
            snapshots = []
            model.fit(ds.take(1), verbose=0)
            snapshots.append([w.numpy() for w in model.weights])
            model.fit(ds.skip(1).take(9), verbose=0)
            snapshots.append([w.numpy() for w in model.weights])
            model.fit(ds, epochs=epochs, verbose=0)
            snapshots.append([w.numpy() for w in model.weights])
            _, accuracy = model.evaluate(x_test, y_test, batch_size=500, verbose=0)
            bn = model.get_layer("stem_bn")
            copies = getattr(bn.moving_mean.value, "values", None)
            spread = (0.0 if not copies else float(max(
                np.abs(c.numpy() - copies[0].numpy()).max() for c in copies)))
            results[system] = {"accuracy": 100 * float(accuracy), "snapshots": snapshots,
                               "replica_spread": spread}

        def diff(a, b, i):
            return float(max(np.abs(u - v).max() for u, v in
                             zip(results[a]["snapshots"][i], results[b]["snapshots"][i])))

        row = {
            "acc_1x4n": results["1x4n"]["accuracy"],
            "acc_4xn": results["4xn"]["accuracy"],
            "weight_diff_step1": diff("1x4n", "4xn", 0),
            "weight_diff_step10": diff("1x4n", "4xn", 1),
            "weight_diff_final": diff("1x4n", "4xn", 2),
            "replica_spread_moving_mean": results["4xn"]["replica_spread"],
        }
        if "1x4n+1e-7" in results:
            row["noise_floor_acc"] = results["1x4n+1e-7"]["accuracy"]
            row["noise_floor_diff_step10"] = diff("1x4n", "1x4n+1e-7", 1)
            row["noise_floor_diff_final"] = diff("1x4n", "1x4n+1e-7", 2)
        out[norm_name] = row
        log(f"replicas {norm_name}: " + ", ".join(f"{k}={v:.3g}" for k, v in row.items()))
    return out


def _first_step_stats(mirrored, seed):
    """BN statistics per group at the first step: 1 replica x 4n vs 4 replicas x n."""
    import keras
    import tensorflow as tf

    from tfdist_ext.layers import IndependentBatchNormalization

    n = CONFIG["mnist1d"]["n"]
    (x, _), _ = _load("mnist1d")
    batch = x[: 4 * n].reshape(4 * n, -1)
    diffs = {}
    for norm_name in ("independent", "plain"):
        stats = {}
        for system, strategy in (("1x4n", tf.distribute.get_strategy()), ("4xn", mirrored)):
            with strategy.scope():
                layer = (IndependentBatchNormalization(virtual_batch_size=n, momentum=0.0)
                         if norm_name == "independent"
                         else keras.layers.BatchNormalization(momentum=0.0))
                layer.build(batch.shape)
            # Normalised output of each group of n with the statistics it was given.
            if system == "1x4n":
                out = layer(batch, training=True).numpy()
            else:
                ds = tf.data.Dataset.from_tensor_slices(batch).batch(4 * n)
                dist = mirrored.experimental_distribute_dataset(ds)
                per_replica = mirrored.run(lambda t: layer(t, training=True),
                                           args=(next(iter(dist)),))
                out = np.concatenate([v.numpy() for v in
                                      mirrored.experimental_local_results(per_replica)])
            stats[system] = out
        diffs[norm_name] = float(np.abs(stats["1x4n"] - stats["4xn"]).max())
    return diffs


def _plots(results, curves, path_error, path_curves):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    names = list(results)
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.2))
    for ax, name in zip(np.atleast_1d(axes), names):
        n = CONFIG[name]["n"]
        for variant, marker in zip(VARIANTS, "os^"):
            ks = sorted(results[name][variant])
            means = [results[name][variant][k][0] for k in ks]
            stds = [results[name][variant][k][1] for k in ks]
            ax.errorbar([k * n for k in ks], means, yerr=stds, marker=marker,
                        capsize=3, label=variant)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"total batch k*n (n = {n})")
        ax.set_ylabel("held-out error (%)")
        ax.set_title(f"{name}: error vs total batch (mean +- std, 3 seeds)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path_error, dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.2))
    for ax, name in zip(np.atleast_1d(axes), names):
        n = CONFIG[name]["n"]
        for k, style in curves[name].items():
            mean = np.mean(style, axis=0)
            ax.plot(np.arange(1, len(mean) + 1), mean,
                    label=f"k={k}, total batch {k * n} (scaled+warmup)")
        ax.set_xlabel("epoch")
        ax.set_ylabel("training error (%)")
        ax.set_title(f"{name}: training curves (mean of 3 seeds)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path_curves, dpi=110)
    plt.close(fig)
    return [path_error, path_curves]


def run(quick=False, seed=0):
    from tfdist_ext.cluster import logical_cpus

    devices = logical_cpus(4)
    import tensorflow as tf

    log_lines = []

    def log(message):
        log_lines.append(message)
        print(message, flush=True)

    seeds = (seed,) if quick else (seed, seed + 1, seed + 2)
    ks = (1, 8) if quick else KS
    figures, rows, summary, curves = [], [], {}, {}
    mirrored = tf.distribute.MirroredStrategy(devices)
    first = _first_step_stats(mirrored, seed)
    replica_epochs = 2 if quick else 5
    replicas = _replica_experiment(mirrored, seed, replica_epochs, log)
    for name, cfg in CONFIG.items():
        data = _load(name)
        epochs = max(4, cfg["epochs"] // 4) if quick else cfg["epochs"]
        runs = _grid(name, data, cfg, ks, seeds, epochs, log)
        summary[name] = {}
        for variant in VARIANTS:
            summary[name][variant] = {}
            for k in ks:
                errors = [runs[(k, variant, s)]["test_error"] for s in seeds]
                mean, std = float(np.mean(errors)), float(np.std(errors))
                summary[name][variant][k] = (mean, std)
                figures.append(_harness.figure(
                    f"{name} k={k}", variant, "held-out error", "%", errors,
                    k=k, n=cfg["n"], total_batch=k * cfg["n"], seeds=list(seeds),
                    mean=mean, std=std,
                    diverged=sum(runs[(k, variant, s)]["diverged"] for s in seeds),
                    train_seconds=[round(runs[(k, variant, s)]["seconds"], 1) for s in seeds],
                ))
        for k in ks:
            rows.append([name, k, k * cfg["n"],
                         *(f"{summary[name][v][k][0]:.2f} ± {summary[name][v][k][1]:.2f}"
                           for v in VARIANTS)])
        curves[name] = {k: [runs[(k, VARIANTS[0], s)]["train_error_curve"] for s in seeds]
                        for k in (1, 8) if k in ks}
        for k, per_seed in curves[name].items():
            figures.append(_harness.figure(
                f"{name} k={k} curve", VARIANTS[0], "training error per epoch", "%",
                [float(np.mean([c[-1] for c in per_seed]))],
                curve_mean=[float(v) for v in np.mean(per_seed, axis=0)]))

    for norm_name, r in replicas.items():
        figures.append(_harness.figure(
            "1x4n vs 4xn", f"{norm_name} BN", "held-out accuracy difference",
            "points", [abs(r["acc_1x4n"] - r["acc_4xn"])],
            first_step_bn_output_diff=first[norm_name],
            **r))
        rows.append([f"mnist1d 1x{4 * CONFIG['mnist1d']['n']} vs 4x{CONFIG['mnist1d']['n']}",
                     f"{norm_name} BN", "",
                     f"acc {r['acc_1x4n']:.2f} vs {r['acc_4xn']:.2f}",
                     f"BN output diff {first[norm_name]:.2g}",
                     f"weights diff: step 1 {r['weight_diff_step1']:.2g}, "
                     f"step 10 {r['weight_diff_step10']:.2g}"])

    suffix = ".quick" if quick else ""
    plot_paths = _plots(
        summary, curves,
        os.path.join(_harness.RESULTS_DIR, f"large_batch_error{suffix}.png"),
        os.path.join(_harness.RESULTS_DIR, f"large_batch_curves{suffix}.png"))

    notes = [
        "k workers with per-worker batch n are simulated on one device as a total "
        "batch k*n whose batch norm is IndependentBatchNormalization(virtual_batch_size=n): "
        "the paper's k*n total batch with BN over n per worker, exactly.",
        "model: ResNet-style CNN (stem + 2 residual blocks, {}-{} channels), "
        "SGD momentum {}, momentum correction on, weight decay {} as an L2 loss "
        "term and zero-gamma on the last BN of each residual branch "
        "(apply_goyal_recipe); the rate is divided by 10 at the step-decay epochs.".format(
            CONFIG["digits"]["width"], 2 * CONFIG["mnist1d"]["width"], MOMENTUM, WEIGHT_DECAY),
        "per data set (n, eta for batch n, epochs, warm-up epochs, decay epochs): " + "; ".join(
            f"{k}: n={c['n']}, eta={c['eta']}, {c['epochs']} ep, warm-up {c['warmup']} ep, "
            f"decay at {c['decay']}" for k, c in CONFIG.items()),
        f"seeds {list(seeds)} (weights, shuffling); same number of epochs for every k, so "
        "large k means few steps (e.g. digits k=32: 5 steps per epoch).",
        "k=1 is trained once per seed: the three rules coincide there.",
        "replica experiment: MNIST-1D, global batch 4n, 1 replica vs MirroredStrategy "
        f"over 4 logical CPU devices, {replica_epochs} epochs, rate 4*eta, same seed and "
        "data order (fit on one pre-permuted tf.data pipeline; MirroredStrategy hands "
        "replica i the i-th slice of n). 'BN output diff' is the largest difference of a "
        "fresh BN layer's training-mode output on the same 4n examples. Weight "
        "differences after 1 and 10 steps show the computations agree; later, chaos "
        "amplifies float rounding (all-reduce order): the 'noise floor' run (1 replica, "
        "one kernel perturbed by 1e-7) diverges as much, so final weights are not compared.",
        "Observed here: Keras's train_on_batch under MirroredStrategy gave plain BN the "
        "whole batch's statistics on every replica (no split), so this experiment uses "
        "fit on a dataset.",
        "machine shared with other engineers' TensorFlow jobs: training seconds "
        "in the JSON are indicative only.",
        "plots: " + ", ".join(os.path.basename(p) for p in plot_paths) if plot_paths
        else "matplotlib not installed: no plots",
    ]
    notes.extend(f"log: {line}" for line in log_lines if line.startswith("replicas"))
    return {
        "candidate": "LinearScaling with gradual warm-up (+ IndependentBatchNormalization, "
                     "momentum correction, Goyal recipe)",
        "peer": "linear scaling without warm-up; no scaling",
        "figures": figures,
        "table": {
            "columns": ["data", "k", "total batch", "error % scaled+warmup",
                        "error % scaled", "error % unscaled"],
            "rows": rows,
        },
        "notes": notes,
    }
