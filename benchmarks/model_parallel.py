"""``model_parallel``: partition balance, pipelined step time and numerical equality
of ``ModelParallelStrategy`` on logical CPU devices.

Three measurements, one process, seeded:

1. balance -- largest per-device parameter bytes / total parameter bytes of
   the ``"balanced"`` plan against the ideal 1/k, k = 2 and 4, for an MLP, a
   CNN and the same CNN with its large ``Dense`` split by
   ``ColumnParallelDense`` (static: no training needed);
2. step time on 2 logical CPU devices with TensorFlow limited to one thread per
   op (intra-op = 1) and two concurrent ops (inter-op = 2): one device (plain
   Keras), the partitioned model without pipelining (``microbatches=1``) and
   with GPipe micro-batches (4, 8); interleaved repeats, medians;
3. numerical equality -- loss and gradients of the partitioned model (1 and 4
   micro-batches, k = 2 and 4) against the same weights on one device.
"""

import os
import resource
import time

from benchmarks import _harness

STEP_DEVICES = 2


def _load():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def _mlp(keras, inputs=784, width=512, depth=4):
    return keras.Sequential(
        [keras.Input((inputs,))]
        + [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
        + [keras.layers.Dense(10)])


def _cnn(keras, split=0):
    from tfdist_ext.model_parallel import ColumnParallelDense

    head = (ColumnParallelDense(128, num_shards=split, activation="relu") if split
            else keras.layers.Dense(128, activation="relu"))
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        head,
        keras.layers.Dense(10),
    ])


def _balance(keras, devices, figures, rows):
    from tfdist_ext.model_parallel import plan_partition

    for k in (2, 4):
        cases = {"mlp": lambda: _mlp(keras), "cnn": lambda: _cnn(keras),
                 f"cnn+column-split({k})": lambda: _cnn(keras, split=k)}
        for case, build in cases.items():
            model = build()
            plan = plan_partition(model, devices[:k])
            frac = plan.max_fraction
            figures.append(_harness.figure(
                case, f"balanced-{k}", "max device param fraction", "fraction", [frac],
                ideal=1 / k, total_param_bytes=plan.total_param_bytes,
                plan=plan.to_dict()))
            rows.append([f"balance {case}, k={k}: max device param bytes / total",
                         round(frac, 3), f"ideal 1/k = {1 / k:.3f}",
                         f"{frac * k:.2f}x ideal"])


def _step_times(keras, tf, devices, seed, quick, figures, rows, notes):
    from tfdist_ext import datasets
    from tfdist_ext.model_parallel import ModelParallelStrategy

    batch, inputs, width = (256, 512, 512) if quick else (512, 1024, 1024)
    steps = 2 if quick else 4
    repeats = 2 if quick else 9
    ds = (datasets.synthetic(batch * steps, input_shape=(inputs,), seed=seed)
          .batch(batch).repeat())
    systems, builds = {}, {
        "one device": None,
        "partitioned, M=1": 1,
        "partitioned, M=4": 4,
        "partitioned, M=8": 8,
    }
    usage = {}
    for name, microbatches in builds.items():
        keras.utils.set_random_seed(seed)
        strategy = (tf.distribute.get_strategy() if microbatches is None else
                    ModelParallelStrategy(devices[:STEP_DEVICES], microbatches=microbatches,
                                          balance_by="flops"))
        with strategy.scope():
            model = _mlp(keras, inputs=inputs, width=width, depth=4)
            model.compile(optimizer=keras.optimizers.SGD(0.01),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        usage[name] = []

        def measure(model=model, name=name):
            cpu0 = resource.getrusage(resource.RUSAGE_SELF)
            start = time.perf_counter()
            model.fit(ds, epochs=1, steps_per_epoch=steps, verbose=0)
            wall = time.perf_counter() - start
            cpu1 = resource.getrusage(resource.RUSAGE_SELF)
            cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
            usage[name].append(cpu / wall)
            return wall / steps * 1000

        systems[name] = measure
    load_before = _load()
    samples = _harness.interleaved(systems, repeats)
    load_after = _load()
    for name in systems:  # drop the warm-up round's utilisation sample
        usage[name] = usage[name][1:]
    for name, values in samples.items():
        figures.append(_harness.figure(
            "mlp 1024x4", name, "step time", "ms", values, batch_size=batch,
            steps=steps, cpu_utilisation=_harness.median(usage[name])))
    base = _harness.median(samples["partitioned, M=1"])
    one = _harness.median(samples["one device"])
    for name, values in samples.items():
        t = _harness.median(values)
        rows.append([f"step time {name} (ms, median)", round(t, 1),
                     f"M=1: {base:.1f} ms; one device: {one:.1f} ms",
                     f"{base / t:.2f}x vs M=1, {one / t:.2f}x vs one device"])
    notes.append(
        f"step time: MLP {inputs}-{width}x4-10, batch {batch}, {steps} steps per sample, "
        f"medians of {repeats} interleaved repeats after a warm-up round; TensorFlow "
        "intra-op threads = 1 (each op single-threaded), inter-op threads = 2; "
        "partitions balanced by estimated FLOPs over 2 logical CPU devices. Process "
        "CPU-time / wall-time (median) per system: "
        + ", ".join(f"{k}: {_harness.median(v):.2f}" for k, v in usage.items())
        + f". 1-minute load average {load_before:.1f} before, {load_after:.1f} after "
        f"on a {os.cpu_count()}-core machine shared with other TensorFlow jobs.")
    return samples


def _gradients(tf, microbatch_gradients, model, plan, microbatches, x, y):
    fn = tf.function(lambda a, b: microbatch_gradients(model, plan, (a, b), microbatches))
    return fn(tf.constant(x), tf.constant(y))


def _equality(keras, tf, devices, seed, figures, rows):
    import numpy as np

    from tfdist_ext import datasets
    from tfdist_ext.model_parallel import ModelParallelStrategy
    from tfdist_ext.model_parallel import microbatch_gradients

    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x_img, y = datasets.synthetic(128, input_shape=(28, 28, 1), seed=seed, as_numpy=True)
    cases = {"mlp": (lambda: _mlp(keras), x_img.reshape(128, -1)),
             "cnn": (lambda: _cnn(keras), x_img)}
    for case, (build, x) in cases.items():
        keras.utils.set_random_seed(seed)
        reference = build()
        reference.compile(optimizer="sgd", loss=loss_fn)
        with tf.GradientTape() as tape:
            pred = reference(x, training=True)
            ref_loss = reference._compute_loss(x=x, y=y, y_pred=pred, training=True)
        ref_grads = tape.gradient(ref_loss, reference.trainable_variables)
        for k in (2, 4):
            for m in (1, 4):
                strategy = ModelParallelStrategy(devices[:k], microbatches=m)
                with strategy.scope():
                    model = build()
                    model.compile(optimizer="sgd", loss=loss_fn)
                model.set_weights(reference.get_weights())
                strategy.place(model)
                loss, _, grads = _gradients(tf, microbatch_gradients, model,
                                            strategy.plan, m, x, y)
                loss_err = abs(float(loss) - float(ref_loss)) / abs(float(ref_loss))
                grad_err = max(
                    float(np.max(np.abs(g.numpy() - r.numpy()))
                          / (np.max(np.abs(r.numpy())) + 1e-12))
                    for g, r in zip(grads, ref_grads))
                system = f"partitioned k={k}, M={m}"
                figures.append(_harness.figure(case, system, "loss relative error", "1",
                                               [loss_err]))
                figures.append(_harness.figure(case, system,
                                               "max gradient error / max |gradient|", "1",
                                               [grad_err]))
                rows.append([f"equality {case}, k={k}, M={m}: loss rel. err / grad err",
                             f"{loss_err:.1e} / {grad_err:.1e}",
                             "one device, same weights", "float32 eps = 1.2e-07"])


def run(quick=False, seed=0):
    import tensorflow as tf

    from tfdist_ext.cluster import logical_cpus

    devices = logical_cpus(4)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    import keras

    figures, rows, notes = [], [], []
    _balance(keras, devices, figures, rows)
    _equality(keras, tf, devices, seed, figures, rows)
    samples = _step_times(keras, tf, devices, seed, quick, figures, rows, notes)
    speedup = (_harness.median(samples["partitioned, M=1"])
               / min(_harness.median(samples[f"partitioned, M={m}"]) for m in (4, 8)))
    notes.insert(0, (
        f"goal: pipelining >= 1.5x the unpipelined partitioned step; measured best "
        f"{speedup:.2f}x -> {'met' if speedup >= 1.5 else 'NOT met'}. The GPipe bound "
        "for 2 equal stages is 2M/(M+1): 1.6x (M=4), 1.78x (M=8), reachable only "
        "if the process gets both cores; see the CPU-time / wall-time figures below."))
    notes.append(
        "balance: parameter bytes are exact; 'balanced' minimises the largest "
        "device's share over contiguous stages (optimal by dynamic programming), so "
        "the gap to 1/k comes from layer granularity (one layer holds most of the "
        "CNN's parameters until ColumnParallelDense splits it).")
    notes.append(
        "equality: float32, synthetic 28x28 data (seed), gradients of every variable "
        "compared elementwise against one device with identical weights.")
    return {
        "candidate": "tfdist_ext ModelParallelStrategy (balanced plan, GPipe micro-batches)",
        "peer": "ideal 1/k balance; unpipelined partitioned step; one device",
        "figures": figures,
        "table": {
            "columns": ["measurement", "value", "reference", "ratio"],
            "rows": rows,
        },
        "notes": notes,
    }
