"""``compression``: gradient compression in ``CompressedMirroredStrategy`` vs dense all-reduce.

Four measurements, one run:

* **Accuracy parity and measured ratio.** Every compressor (and two DGC
  ablations) trains the same CNN with the same schedule on MNIST-1D and on
  the bundled digits, over 2 replicas (logical CPU devices), 3 seeds each,
  against plain ``tf.distribute.MirroredStrategy`` (dense all-reduce).
  Held-out accuracy is the mean over seeds; the compression ratio is dense
  bytes / bytes actually all-gathered, counted by the strategy from the wire
  tensors it hands to ``all_gather``.
* **Fraction of step time compressing**, from ``tf.timestamp`` around the
  compression ops inside the training step (``CompressionLogger``).
* **Cost**: compress+decompress throughput (MB/s of float32 gradient) for
  tensors of 1e4 to 1e7 elements, medians of interleaved repeats.
* **Ablation**: DGC without momentum correction, and without warm-up.
"""

import os
import statistics
import time

from benchmarks import _harness

SEEDS = (0, 1, 2)
WARMUP_EPOCHS = 4  # DGC warm-up epochs (densities 25%, 6.25%, 1.56%, 0.39%), as in the paper
DEVICES = 2


MIN_SIZE = 1024  # tensors with fewer elements go dense in the error-feedback and DGC rows


def _configs(C, steps_per_epoch, warmup):
    """name -> (compressor or None for dense, SGD momentum, learning-rate factor)."""
    dgc = dict(sparsity=0.999, momentum=0.9, clip_norm=5.0, steps_per_epoch=steps_per_epoch)
    small = dict(min_size=MIN_SIZE)
    return {
        "dense (MirroredStrategy)": (None, 0.9, 1.0),
        "fp16": (C.FP16(), 0.9, 1.0),
        "bf16": (C.BF16(), 0.9, 1.0),
        "ef-topk 1%": (C.ErrorFeedback(C.TopK(0.01), **small), 0.9, 1.0),
        "ef-randomk 1%": (C.ErrorFeedback(C.RandomK(0.01), **small), 0.9, 1.0),
        "ef-threshold 0.01": (C.ErrorFeedback(C.Threshold(0.01), **small), 0.9, 1.0),
        "qsgd 4 levels": (C.QSGD(4), 0.9, 1.0),
        "terngrad": (C.TernGrad(), 0.9, 1.0),
        "onebit (1-bit SGD + EF)": (C.OneBit(**small), 0.9, 1.0),
        "signsgd (majority vote)": (C.SignSGD(), 0.9, 0.01),
        "ef-signsgd": (C.EFSignSGD(**small), 0.9, 1.0),
        "powersgd rank 2": (C.PowerSGD(2), 0.9, 1.0),
        "dgc 99.9%": (C.DGC(warmup_epochs=warmup, **dgc, **small), 0.0, 1.0),
        "dgc 99.9% no momentum correction": (
            C.DGC(warmup_epochs=warmup, momentum_correction=False, **dgc, **small),
            0.9,
            1.0,
        ),
        "dgc 99.9% no warm-up": (C.DGC(warmup_epochs=0, **dgc, **small), 0.0, 1.0),
    }


def _datasets(quick):
    return {
        "mnist1d": dict(epochs=2 if quick else 32, batch=32, lr=0.05, cosine=True),
        "digits": dict(epochs=2 if quick else 24, batch=32, lr=0.05, cosine=True),
    }


def _model(keras, name):
    if name == "mnist1d":
        return keras.Sequential(
            [
                keras.Input((40, 1)),
                keras.layers.Conv1D(32, 5, activation="relu"),
                keras.layers.Conv1D(32, 5, strides=2, activation="relu"),
                keras.layers.Conv1D(32, 3, strides=2, activation="relu"),
                keras.layers.Flatten(),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def _data(name):
    from tfdist_ext import datasets

    if name == "mnist1d":
        return (
            datasets.mnist1d("train", channels=True, as_numpy=True),
            datasets.mnist1d("test", channels=True, as_numpy=True),
        )
    return datasets.digits("train", as_numpy=True), datasets.digits("test", as_numpy=True)


class _Trainer:
    """One strategy and one traced model per (data set, method); seeds reset its state.

    Tracing dominates short runs, so the seeds of one method reuse the traced
    training function: weights are re-drawn from the seed, the optimizer's
    slots and step and the compressor state are reset, and the data are
    reshuffled with the seed.
    """

    def __init__(self, tf, keras, C, devices, data_name, spec, compressor, momentum, lr_factor):
        (self.x, self.y), (self.x_test, self.y_test) = _data(data_name)
        self.tf, self.keras, self.spec, self.data_name = tf, keras, spec, data_name
        self.compressed = compressor is not None
        steps = len(self.x) // spec["batch"]
        # One-device copies instead of collectives: many strategies in one
        # process would otherwise collide on collective instance keys.
        cross = tf.distribute.ReductionToOneDevice()
        if compressor is None:
            self.strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=cross)
        else:
            self.strategy = C.CompressedMirroredStrategy(
                devices, cross_device_ops=cross, compression=compressor
            )
        lr = spec["lr"] * lr_factor
        if spec.get("cosine"):
            # Cosine decay to 0 over the whole run (the same for every method).
            lr = keras.optimizers.schedules.CosineDecay(lr, steps * spec["epochs"])
        with self.strategy.scope():
            self.model = _model(keras, data_name)
            self.model.compile(
                keras.optimizers.SGD(lr, momentum=momentum),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
                steps_per_execution=steps,
            )

    def _reset(self, seed):
        self.keras.utils.set_random_seed(seed)
        self.model.set_weights(_model(self.keras, self.data_name).get_weights())
        for var in self.model.optimizer.variables:
            if "learning_rate" not in var.path:
                var.assign(self.tf.zeros_like(var))
        if self.compressed:
            self.strategy.reset_compression_state()
            self.strategy.reset_compression_stats()

    def run(self, seed):
        from tfdist_ext.callbacks._compression import CompressionLogger

        tf = self.tf
        self._reset(seed)
        train = (
            tf.data.Dataset.from_tensor_slices((self.x, self.y))
            .shuffle(len(self.x), seed=seed)
            .batch(self.spec["batch"], drop_remainder=True)
        )
        callbacks = [CompressionLogger()] if self.compressed else []
        start = time.perf_counter()
        self.model.fit(train, epochs=self.spec["epochs"], verbose=0, callbacks=callbacks)
        seconds = time.perf_counter() - start
        accuracy = float(
            self.model.evaluate(self.x_test, self.y_test, verbose=0, batch_size=500)[1]
        )
        out = {"accuracy": accuracy, "seconds": seconds, "ratio": 1.0, "fraction": 0.0}
        if self.compressed:
            stats = self.strategy.compression_stats()
            out["ratio"] = stats["ratio"]
            out["wire_bytes"] = stats["wire_bytes"]
            out["dense_bytes"] = stats["dense_bytes"]
            # Fraction of step time compressing, epochs 2.. (epoch 1 may trace).
            rows = callbacks[0].history[1:] or callbacks[0].history
            out["fraction"] = statistics.median(r["compress_fraction"] for r in rows)
            out["final_ratio"] = callbacks[0].history[-1]["compression_ratio"]
        else:
            out["final_ratio"] = 1.0
        return out


def _throughput(tf, C, quick):
    sizes = (10_000, 100_000, 1_000_000) if quick else (10_000, 100_000, 1_000_000, 10_000_000)
    compressors = {
        "fp16": C.FP16(),
        "ef-topk 1%": C.ErrorFeedback(C.TopK(0.01)),
        "ef-randomk 1%": C.ErrorFeedback(C.RandomK(0.01)),
        "qsgd 4": C.QSGD(4),
        "terngrad": C.TernGrad(),
        "onebit": C.OneBit(),
        "signsgd": C.SignSGD(),
        "powersgd 2": C.PowerSGD(2),
        "dgc 99.9%": C.DGC(warmup_epochs=0),
    }
    figures, table = [], {}
    for n in sizes:
        shape = (n // 100, 100)  # a matrix, so that PowerSGD compresses it
        grad = tf.random.stateless_normal(shape, [0, n])
        systems = {}
        for name, c in compressors.items():
            state = c.init(shape)

            @tf.function
            def roundtrip(g, state, c=c):
                wire, state = c.compress(g, state, tf.constant(5, tf.int64))
                return c.decompress(wire, g.shape), state, c.wire_bytes(wire)

            roundtrip(grad, state)  # trace

            def measure(roundtrip=roundtrip, state=state):
                start = time.perf_counter()
                out = roundtrip(grad, state)
                out[0].numpy()
                return 4 * n / 1e6 / (time.perf_counter() - start)

            systems[name] = measure
        samples = _harness.interleaved(systems, 3)
        for name, values in samples.items():
            figures.append(
                _harness.figure(
                    f"{n:.0e} elements", name, "compress+decompress", "MB/s", values, elements=n
                )
            )
            table.setdefault(name, {})[n] = _harness.median(values)
    return figures, table, sizes


def _accuracy_section(tf, keras, C, devices, seeds, quick):
    """Every compressor trained on each data set: ``(figures, {(data, name): runs})``."""
    figures, results = [], {}
    for data_name, spec in _datasets(quick).items():
        (x, _), _ = _data(data_name)
        steps = len(x) // spec["batch"]
        for name, (compressor, momentum, lr_factor) in _configs(C, steps, WARMUP_EPOCHS).items():
            trainer = _Trainer(
                tf, keras, C, devices, data_name, spec, compressor, momentum, lr_factor
            )
            runs = [trainer.run(s) for s in seeds]
            results[(data_name, name)] = runs
            for metric, unit in (
                ("accuracy", "fraction"),
                ("ratio", "x"),
                ("final_ratio", "x"),
                ("fraction", "of step time"),
                ("seconds", "s"),
            ):
                figures.append(
                    _harness.figure(
                        data_name, name, metric, unit, [r[metric] for r in runs], seeds=list(seeds)
                    )
                )
            print(
                f"{data_name:8s} {name:34s} acc {statistics.mean(r['accuracy'] for r in runs):.4f}"
                f" ratio {statistics.mean(r['ratio'] for r in runs):8.1f}"
                f" frac {statistics.mean(r['fraction'] for r in runs):.3f}",
                flush=True,
            )
    return figures, results


def _accuracy_rows(names, results, quick):
    """One row per compressor: accuracy, its difference to dense and the
    ratio on each data set, and the compression's share of the step."""
    rows = []
    for name in names:
        row = [name]
        for data_name in _datasets(quick):
            runs = results[(data_name, name)]
            base = results[(data_name, names[0])]
            acc = 100 * statistics.mean(r["accuracy"] for r in runs)
            delta = acc - 100 * statistics.mean(r["accuracy"] for r in base)
            row += [
                round(acc, 2),
                round(delta, 2),
                round(statistics.mean(r["ratio"] for r in runs), 1),
            ]
        fractions = [r["fraction"] for d in _datasets(quick) for r in results[(d, name)]]
        row.append(round(100 * statistics.mean(fractions), 2))
        rows.append(row)
    return rows


def _notes(seeds, spec):
    return [
        f"seeds {list(seeds)}; accuracy = held-out test accuracy after "
        f"{spec['mnist1d']['epochs']} epochs on MNIST-1D and {spec['digits']['epochs']} on digits (MNIST-1D: 4000/1000, Conv1D CNN, global batch "
        f"{spec['mnist1d']['batch']}; digits: 1347/450, Conv2D CNN, global batch "
        f"{spec['digits']['batch']}), mean over seeds; Δ is against the dense peer.",
        "One epoch per tf.function call (steps_per_execution = steps per epoch) for "
        "every system. Schedule: SGD lr 0.05 with cosine decay to 0 over the run, momentum 0.9, "
        "the same for every method except DGC with "
        "momentum correction (momentum 0.9 lives in the compressor, optimizer momentum 0) "
        "and signSGD (lr x0.01, since the majority vote has magnitude 1 per entry).",
        f"DGC: sparsity 0.999, momentum 0.9, clip_norm 5, {WARMUP_EPOCHS} warm-up epochs as in "
        "the paper (densities 25%, 6.25%, 1.56%, 0.39%) then 0.1%; the ratio column averages "
        "over all epochs "
        "including warm-up (the per-epoch ratio after warm-up is in the figures as "
        "final_ratio).",
        "ratio = dense float32 bytes / bytes of the wire tensors handed to all_gather "
        "(counted per replica per step inside the training step), dense tensors included.",
        f"Error-feedback rows (ef-*, onebit, ef-signsgd) and DGC rows send tensors of fewer "
        f"than {MIN_SIZE} elements dense (min_size={MIN_SIZE}: biases, the first conv "
        "kernel, the 640-entry output kernel), as DGC's reference implementation does. "
        "(The earlier 'every tensor compressed/sparsified' rows, min_size=0, are left out "
        "to keep the run time affordable; on the old 8/6-epoch schedule they were 31% "
        "(EF-TopK) and 31% (DGC) on MNIST-1D.)",
        f"Steps per run: {(4000 // spec['mnist1d']['batch']) * spec['mnist1d']['epochs']} "
        f"(MNIST-1D) and {(1347 // spec['digits']['batch']) * spec['digits']['epochs']} "
        "(digits), up from 250 / 126: at 99.9% a 14,336-entry kernel sends ~14 entries per "
        "step, so DGC needs thousands of steps. Shorter schedules (1250-2000 MNIST-1D "
        "steps) were measured too, in an earlier full run and pilots (see README).",
        "compress % of step: tf.timestamp around the compression ops in the step, over the "
        "epoch's wall time, median over epochs 2.., mean over seeds and both data sets.",
        "The seeds of one method share one traced model: weights re-drawn from the seed, "
        "optimizer slots/step and compressor state reset, data reshuffled with the seed.",
        "Within one process the wire tensors cross logical CPU devices through "
        "ReductionToOneDevice copies (no collectives: many strategies share the process); "
        "across processes, tests/test_compression_multiworker.py runs the collective path.",
        f"The machine ({os.cpu_count()} cores) is shared with other engineers' TensorFlow "
        "jobs; seconds and MB/s are noisy (medians of interleaved repeats for MB/s).",
    ]


def run(quick=False, seed=0):
    from tfdist_ext.cluster import logical_cpus

    devices = logical_cpus(DEVICES)
    import keras
    import tensorflow as tf

    from tfdist_ext import compression as C

    seeds = tuple(seed + s for s in (SEEDS[:2] if quick else SEEDS))
    figures, results = _accuracy_section(tf, keras, C, devices, seeds, quick)
    tput_figures, tput, sizes = _throughput(tf, C, quick)
    figures += tput_figures
    rows = _accuracy_rows(list(_configs(C, 1, 1)), results, quick)
    tput_rows = [[name] + [round(tput[name][n], 1) for n in sizes] for name in tput]
    ds = list(_datasets(quick))
    return {
        "candidate": "tfdist_ext.CompressedMirroredStrategy (2 logical CPU devices), each compressor",
        "peer": "tf.distribute.MirroredStrategy dense all-reduce, same model, schedule and seeds",
        "figures": figures,
        "table": {
            "columns": ["method"]
            + [f"{d} {c}" for d in ds for c in ("acc %", "Δ vs dense (pts)", "ratio")]
            + ["compress % of step"],
            "rows": rows,
        },
        "throughput_table": {
            "columns": ["compressor"] + [f"{n:.0e} el. MB/s" for n in sizes],
            "rows": tput_rows,
        },
        "notes": _notes(seeds, _datasets(quick)),
    }
