"""One training process of the Keras matrix (tests/test_keras_matrix.py).

``python train.py STRATEGY OUT KINDS POLICIES``: under one strategy (one
cluster), builds, compiles and fits each model kind of ``user_models`` (a
comma-separated list), predicts and saves it, and writes what happened to
``OUT/results.json`` after each kind. ``POLICIES`` is JSON: the mixed
precision policy of a kind, float32 for the others. Run by path, so that
``user_models`` is imported as the user's own module beside this script.
"""

import json
import os
import sys
import time
import traceback

import keras
import numpy as np
import tensorflow as tf
import user_models

import tfdist_ext
from tfdist_ext import compression
from tfdist_ext import datasets

EPOCHS, STEPS, BATCH = 3, 6, 32
OUT = None  # the output directory (argv[2])
POLICY = {}  # kind -> mixed precision policy (argv[4])


def data(kind):
    if kind == "embedding":
        rng = np.random.default_rng(0)
        x = rng.integers(1, 50, size=(1024, 12)).astype("int32")
        return x, ((x < 25).mean(1) > 0.5).astype("int64")
    x, y = datasets.digits("train", flatten=kind != "sequential", as_numpy=True)
    if kind == "functional_two_inputs":
        return (x[:, :32], x[:, 32:]), y
    return x, y


def stream(x, y):
    ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(2048, seed=0).batch(BATCH).repeat()
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return ds.with_options(options)


class Batches(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1


def train(strategy, kind, optimizer, full_batch):
    x, y = data(kind)
    user_models.CALLS.update(layer=0, model=0)
    keras.mixed_precision.set_global_policy(POLICY.get(kind, "float32"))
    batches = Batches()
    start = time.time()
    try:
        with strategy.scope():
            model = getattr(user_models, kind)()
            model.compile(
                optimizer=optimizer(),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
            )
        if kind == "checkpoint_restart":
            model, history, extra = make_or_restore(strategy, model, x, y, full_batch, batches)
        else:
            history, extra = fit(model, x, y, full_batch, EPOCHS, [batches]).history, {}
        probe = [a[:16] for a in x] if isinstance(x, tuple) else [x[:16]]
        predictions = model.predict(probe if len(probe) > 1 else probe[0], verbose=0)
        TRAINED[:] = [model, probe, predictions]
        model.save(os.path.join(OUT, kind + ".keras"))
        np.savez(os.path.join(OUT, kind + ".npz"), *probe, predictions=predictions)
        result = {
            "history": {k: [float(v) for v in vs] for k, vs in history.items()},
            "calls": dict(user_models.CALLS),
            "policy": model.dtype_policy.name,
            **extra,
        }
    except Exception as e:
        result = {
            "error": type(e).__name__,
            "message": str(e)[:2000],
            "traceback": traceback.format_exc()[-4000:],
        }
    finally:
        keras.mixed_precision.set_global_policy("float32")
    result.update(batches=batches.seen, seconds=time.time() - start)
    return result


TRAINED = []  # the last trained model, its probe inputs and predictions


def after_cluster_block():
    """The last trained model used after its LocalCluster block has closed."""
    if not TRAINED:
        return {"error": "no model was trained"}
    model, probe, predictions = TRAINED
    try:
        again = model.predict(probe if len(probe) > 1 else probe[0], verbose=0)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[:2000]}
    return {"max_diff": float(np.max(np.abs(again - predictions)))}


def fit(model, x, y, full_batch, epochs, callbacks):
    if full_batch:
        return model.fit(x, y, epochs=epochs, verbose=0, callbacks=callbacks)
    return model.fit(
        stream(x, y), epochs=epochs, steps_per_epoch=STEPS, verbose=0, callbacks=callbacks
    )


def make_or_restore(strategy, model, x, y, full_batch, batches):
    """The guide's pattern: checkpoint every epoch, restore the latest under the scope, go on."""
    # Beside OUT: one directory for a multi-worker job's workers, as on the
    # shared file system the guide assumes; only the chief writes to it.
    checkpoint_dir = os.path.join(os.path.dirname(OUT), "ckpt")
    checkpoint = keras.callbacks.ModelCheckpoint(os.path.join(checkpoint_dir, "ckpt-{epoch}.keras"))
    first = fit(model, x, y, full_batch, EPOCHS, [batches, checkpoint]).history
    _all_workers_here(strategy)
    checkpoints = [os.path.join(checkpoint_dir, name) for name in os.listdir(checkpoint_dir)]
    latest = max(checkpoints, key=lambda path: int(path.split("-")[-1].split(".")[0]))
    with strategy.scope():
        model = keras.models.load_model(latest)
    restored = int(model.optimizer.iterations.numpy())
    second = fit(model, x, y, full_batch, 1, [batches]).history
    return model, {k: first[k] + second[k] for k in first}, {"restored_iterations": restored}


def _all_workers_here(strategy):
    """A collective every worker of a multi-worker job joins: past it, the
    chief's callbacks of its last epoch (its checkpoint) have run."""
    if "TF_CONFIG" in os.environ:
        one = strategy.run(tf.function(lambda: tf.constant(1.0)))
        strategy.reduce("SUM", one, axis=None)


def run_all(strategy, kinds, optimizer, full_batch=False):
    results = {}
    for kind in kinds:
        results[kind] = train(strategy, kind, optimizer, full_batch)
        write(results)
    return results


def write(results, **extra):
    with open(os.path.join(OUT, "results.json.tmp"), "w") as f:
        json.dump({"kinds": results, **extra}, f)
    os.replace(os.path.join(OUT, "results.json.tmp"), os.path.join(OUT, "results.json"))


def adam(learning_rate=0.01):
    return keras.optimizers.Adam(learning_rate)


def sgd():
    return keras.optimizers.SGD(0.05, momentum=0.9)


def ef_topk():
    return compression.get("ef_topk", ratio=0.1)


def run(strategy_name, kinds):
    """Runs every kind under the named strategy; the results by kind."""
    if strategy_name == "downpour":
        with tfdist_ext.LocalCluster(num_workers=2, num_ps=1) as cluster:
            # n_fetch=1: a custom train_step reads the server's variables at every
            # step (n_fetch > 1 is refused for it, with that advice).
            strategy = tfdist_ext.DownpourStrategy(cluster.resolver, n_fetch=1, n_push=2)
            # A smaller rate than the synchronous strategies': with every push a
            # step stale, Adam(0.01) on these 6-step epochs oscillates, and about
            # one fit in five ends an epoch above where it started.
            return run_all(strategy, kinds, lambda: adam(0.003))
    if strategy_name == "elastic":
        with tfdist_ext.LocalCluster(num_workers=2, num_ps=1) as cluster:
            strategy = tfdist_ext.ElasticAveragingStrategy(cluster.resolver, tau=4)
            return run_all(strategy, kinds, sgd)
    if strategy_name == "sandblaster":
        with tfdist_ext.LocalCluster(num_workers=2, num_ps=1) as cluster:
            strategy = tfdist_ext.SandblasterStrategy(cluster.resolver)
            lbfgs = lambda: tfdist_ext.optimizers.LBFGS(memory=10)  # noqa: E731
            return run_all(strategy, kinds, lbfgs, full_batch=True)
    if strategy_name == "compressed_mirrored":
        devices = tfdist_ext.cluster.logical_cpus(2)
        strategy = tfdist_ext.CompressedMirroredStrategy(devices, compression=ef_topk())
        return run_all(strategy, kinds, adam)
    if strategy_name == "compressed_multiworker":
        strategy = tfdist_ext.CompressedMultiWorkerMirroredStrategy(compression=ef_topk())
        return run_all(strategy, kinds, adam)
    if strategy_name == "model_parallel":
        devices = tfdist_ext.cluster.logical_cpus(2)
        strategy = tfdist_ext.ModelParallelStrategy(devices)
        return run_all(strategy, kinds, adam)
    raise ValueError(f"unknown strategy {strategy_name!r}")


def main(strategy_name, out, kinds, policies):
    global OUT, POLICY
    OUT, POLICY = out, json.loads(policies)
    os.makedirs(OUT, exist_ok=True)
    results = run(strategy_name, kinds.split(","))
    extra = {}
    if os.environ.get("MATRIX_AFTER_CLUSTER_BLOCK"):
        extra["after_cluster_block"] = after_cluster_block()
    write(results, finished=time.time(), **extra)


if __name__ == "__main__":
    main(*sys.argv[1:5])
