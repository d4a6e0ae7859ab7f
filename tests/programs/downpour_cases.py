"""DownpourStrategy on a real local cluster, through Keras 3 ``model.fit``:
``python -m tests.programs.downpour_cases CASE [ARGS]``.

Each case (a function below, named by CASE) starts its own cluster, trains
and prints one ``RESULT`` line for ``tests/test_downpour.py`` to check. A
process can connect to one TensorFlow cluster only, hence one case a
process. ``killed_worker`` and ``nan_pushes`` also run EASGD
(:data:`ASYNC_STRATEGIES`): their faults are handled by the same runtime.
"""

import json
import os
import sys
import time
import warnings

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.distribute.cluster_resolver import SimpleClusterResolver

import tfdist_ext
from tests.programs import report
from tests.programs.downpour_common import compiled
from tests.programs.downpour_common import digits_test
from tests.programs.downpour_common import digits_train
from tests.programs.downpour_common import mlp
from tests.programs.downpour_common import op_devices
from tests.programs.downpour_common import round_ops
from tfdist_ext import compression
from tfdist_ext import datasets
from tfdist_ext.callbacks import LinearScalingWarmup
from tfdist_ext.cluster import LocalCluster
from tfdist_ext.schedules import LinearScaling

#: The asynchronous strategies that survive the same faults, by name:
#: (strategy on a resolver, the optimizer to compile; None: Adagrad(0.05)).
ASYNC_STRATEGIES = {
    "downpour": (lambda resolver: tfdist_ext.DownpourStrategy(resolver, deadline=20), None),
    "easgd": (
        lambda resolver: tfdist_ext.ElasticAveragingStrategy(resolver, tau=2, deadline=20),
        lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    ),
}


def _async_model(cluster, name):
    make_strategy, make_optimizer = ASYNC_STRATEGIES[name]
    strategy = make_strategy(cluster.resolver)
    with strategy.scope():
        model = compiled(mlp(), make_optimizer and make_optimizer())
    return strategy, model


# -- fit, evaluate, predict, save ---------------------------------------------------


class _Watch(keras.callbacks.Callback):
    """What the callbacks see: (batch, loss) and ("epoch", staleness mean, max)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append((batch, float(logs["loss"])))

    def on_epoch_end(self, epoch, logs=None):
        self.seen.append(("epoch", logs["staleness_mean"], logs["staleness_max"]))


def _split_kernel_devices(strategy, kernel):
    """Where fit's traced round computes Adagrad's update of the split kernel
    (piece by piece, each piece's on its own ps task), and where its pieces
    are copied before they cross to the worker (a value sent straight from
    its read stalls the round: _round.pack)."""
    pieces = {tuple(p.shape) for p in kernel.variables}
    sqrt_devices, copy_devices = set(), set()
    for op in round_ops(strategy):
        if op.type == "Sqrt" and tuple(op.outputs[0].shape) in pieces:
            sqrt_devices.add(op.device)
        if op.type == "Snapshot" and tuple(op.outputs[0].shape) in pieces:
            copy_devices.add(op.device)
    return {"sqrt_devices": sorted(sqrt_devices), "copy_devices": sorted(copy_devices)}


def _reloads(directory, x_test, logits):
    """Whether both saved models predict what the trained one did."""
    reloaded = keras.models.load_model(os.path.join(directory, "m.keras"))
    np.testing.assert_allclose(reloaded.predict(x_test, verbose=0), logits, rtol=1e-5, atol=1e-5)
    # ModelCheckpoint wrote the server's parameters after the last epoch.
    checkpointed = keras.models.load_model(os.path.join(directory, "ckpt.keras"))
    np.testing.assert_allclose(
        checkpointed.predict(x_test, verbose=0), logits, rtol=1e-5, atol=1e-5
    )
    assert int(checkpointed.optimizer.iterations.numpy()) > 0
    return True


def fit_evaluate_predict_save(directory):
    """2 workers, 2 ps, the 32 KiB kernel split over both; saves under DIRECTORY."""
    keras.utils.set_random_seed(0)
    with LocalCluster(num_workers=2, num_ps=2) as cluster:
        strategy = tfdist_ext.DownpourStrategy(cluster.resolver, min_shard_bytes=8 << 10)
        with strategy.scope():
            model = compiled(mlp(128))
        watch = _Watch()
        checkpoint = keras.callbacks.ModelCheckpoint(os.path.join(directory, "ckpt.keras"))
        history = model.fit(
            digits_train(),
            epochs=3,
            steps_per_epoch=60,
            validation_data=digits_test(),
            callbacks=[watch, checkpoint],
            verbose=0,
        )
        loss, acc = model.evaluate(digits_test(), verbose=0)
        x_test, y_test = datasets.digits("test", flatten=True, as_numpy=True)
        logits = model.predict(x_test, verbose=0)
        kernel = model.layers[0].kernel.value
        placement = {
            v.path: [s.device for s in getattr(v.value, "variables", [v.value])]
            for v in model.variables + model.optimizer.variables
        }
        model.save(os.path.join(directory, "m.keras"))
        report(
            {
                "history": history.history,
                "evaluate": [loss, acc],
                "predict_accuracy": float((logits.argmax(1) == y_test).mean()),
                "predict_shape": list(logits.shape),
                "placement": placement,
                "sharded": type(kernel).__name__,
                "shard_bytes": strategy.shard_bytes(),
                **_split_kernel_devices(strategy, kernel),
                "batches": [s for s in watch.seen if s[0] != "epoch"][:3],
                "epochs": [s for s in watch.seen if s[0] == "epoch"],
                "stats": strategy.stats.summary(),
                "per_worker": strategy.stats.steps_per_worker,
                "reloaded": _reloads(directory, x_test, logits),
            }
        )


# -- n_fetch, n_push and the server's optimizers ------------------------------------


def n_fetch_n_push_traffic():
    """Four fits of 80 steps on 2 workers, each with its own n, optimizer and fetch."""
    keras.utils.set_random_seed(1)
    out = {}
    with LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = tfdist_ext.DownpourStrategy(cluster.resolver)
        for n, opt, background in (
            (1, keras.optimizers.Adagrad(0.05), False),
            (5, keras.optimizers.SGD(0.02, momentum=0.9), True),
            (4, keras.optimizers.Adam(0.005), False),
            (2, keras.optimizers.SGD(0.1), True),
        ):
            strategy.n_fetch = strategy.n_push = n
            strategy.background_fetch = background
            strategy.stats.reset()
            with strategy.scope():
                model = compiled(mlp(), opt)
            h = model.fit(digits_train(), epochs=2, steps_per_epoch=40, verbose=0)
            s = strategy.stats.summary()
            out[f"{type(opt).__name__}-{n}"] = {
                "loss": h.history["loss"],
                "pushes": s["pushes"],
                "fetches": s["fetches"],
                "push": s["push_bytes_per_step"],
                "fetch": s["fetch_bytes_per_step"],
                "fresh": s["fetches"] - 80 // n,
                "params": sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables),
                "iterations": int(model.optimizer.iterations.numpy()),
            }
        report(out)


# -- faults ----------------------------------------------------------------------


class _Chaos(keras.callbacks.Callback):
    """Kills worker 1 after epoch 0's batch 31 and restarts it as epoch 2 begins."""

    def __init__(self, cluster, strategy, marks):
        super().__init__()
        self.cluster, self.strategy, self.marks = cluster, strategy, marks

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        if epoch == 2:
            self.cluster.restart("worker", 1)
            self.marks["restarted"] = dict(self.strategy.stats.steps_per_worker)

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 0 and batch == 31:
            self.cluster.kill("worker", 1)
            self.marks["killed_alive"] = self.cluster.alive("worker", 1)


def killed_worker(name):
    """Strategy NAME (of :data:`ASYNC_STRATEGIES`) loses worker 1 and gets it back."""
    keras.utils.set_random_seed(0)
    marks = {}
    with LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy, model = _async_model(cluster, name)
        # Rounds of 2 steps (not the default ~40 here): many dispatches, so the
        # coordinator hands the restarted worker rounds within this short fit.
        model.steps_per_execution = 2
        h = model.fit(
            digits_train(),
            epochs=4,
            steps_per_epoch=80,
            validation_data=digits_test(),
            verbose=0,
            callbacks=[_Chaos(cluster, strategy, marks)],
        )
        report(
            {
                "history": h.history,
                "stats": strategy.stats.summary(),
                "marks": marks,
                "final": dict(strategy.stats.steps_per_worker),
            }
        )


def nan_pushes(name):
    """Strategy NAME (of :data:`ASYNC_STRATEGIES`) trains on data with NaN examples."""
    keras.utils.set_random_seed(0)
    x, y = datasets.digits("train", flatten=True, as_numpy=True)
    x = x.copy()
    x[::97] = np.nan  # poison every 97th example: about a third of the batches
    with LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy, model = _async_model(cluster, name)
        poisoned = tf.data.Dataset.from_tensor_slices((x, y)).batch(32).repeat()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            h = model.fit(poisoned, epochs=1, steps_per_epoch=30, verbose=0)
        report(
            {
                "rejected": h.history["rejected_pushes"],
                "pushes": h.history["pushes"],
                "finite": all(bool(np.isfinite(v.numpy()).all()) for v in model.variables),
                "warnings": [str(w.message) for w in caught if "NaN" in str(w.message)],
                "per_worker": list(strategy.stats.steps_per_worker.values()),
            }
        )


class _KillPs(keras.callbacks.Callback):
    """Kills process PID (the ps task) at epoch 2's batch 10 when KILL_PS is set."""

    def __init__(self, pid):
        super().__init__()
        self.pid = pid

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if os.environ.get("KILL_PS") and self.epoch == 2 and batch == 10:
            os.kill(self.pid, 9)


class _Losses(keras.callbacks.Callback):
    """(epoch, training loss, held-out loss) at each epoch's end."""

    def __init__(self):
        super().__init__()
        self.losses = []

    def on_epoch_end(self, epoch, logs=None):
        self.losses.append((epoch, logs["loss"], self.model.evaluate(digits_test(), verbose=0)[0]))
        print("EPOCH " + json.dumps(self.losses[-1]), flush=True)


def killed_ps_chief(spec, ps_pid, backup):
    """The chief of the running cluster SPEC (JSON), with BackupAndRestore at
    BACKUP; with KILL_PS set in its environment it kills process PS_PID (the
    ps task) during epoch 2. Reports how fit ended instead of raising."""
    spec = json.loads(spec)
    resolver = SimpleClusterResolver(
        tf.train.ClusterSpec(spec),
        master=spec["chief"][0],
        task_type="chief",
        task_id=0,
        rpc_layer="grpc",
    )
    keras.utils.set_random_seed(0)
    strategy = tfdist_ext.DownpourStrategy(resolver, deadline=10)
    with strategy.scope():
        model = compiled(mlp())
    losses = _Losses()
    start = time.time()
    callbacks = [keras.callbacks.BackupAndRestore(backup), _KillPs(int(ps_pid)), losses]
    try:
        model.fit(digits_train(), epochs=4, steps_per_epoch=50, verbose=0, callbacks=callbacks)
        report(
            {
                "ok": True,
                "losses": losses.losses,
                "iterations": int(model.optimizer.iterations.numpy()),
            }
        )
    except Exception as e:
        report(
            {
                "ok": False,
                "error": type(e).__name__,
                "message": str(e),
                "seconds": time.time() - start,
                "losses": losses.losses,
            }
        )


# -- strategy options -------------------------------------------------------------


def warmstart():
    """warmstart_steps=25 of a 60-step fit on 2 workers: each step's staleness."""
    with LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = tfdist_ext.DownpourStrategy(cluster.resolver, warmstart_steps=25)
        with strategy.scope():
            model = compiled(mlp())
        model.fit(digits_train(), epochs=1, steps_per_epoch=60, verbose=0)
        report({"staleness": strategy.stats.staleness})


def compressed_pushes():
    """Pushes compressed by error feedback over TopK(0.05), 2 workers."""
    keras.utils.set_random_seed(0)
    with LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = tfdist_ext.DownpourStrategy(
            cluster.resolver, compression=compression.ErrorFeedback(compression.TopK(0.05))
        )
        with strategy.scope():
            model = compiled(mlp(128))
        h = model.fit(
            digits_train(),
            epochs=3,
            steps_per_epoch=60,
            validation_data=digits_test(),
            verbose=0,
        )
        dense = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
        # Where the traced round decompresses: the scatter that rebuilds the
        # dense gradient runs on the ps task, so only values + indices cross.
        scatters = set(op_devices(strategy, "ScatterNd"))
        report(
            {
                "push": h.history["push_bytes_per_step"],
                "dense": dense,
                "val": h.history["val_accuracy"],
                "scatters": sorted(scatters),
            }
        )


def partitioned_replicas():
    """Each worker's replica split over its 2 devices (model_devices)."""
    keras.utils.set_random_seed(0)
    with LocalCluster(num_workers=2, num_ps=1, devices_per_worker=2) as cluster:
        assert len(cluster.ping()["worker:0"]) == 2
        strategy = tfdist_ext.DownpourStrategy(
            cluster.resolver, model_devices=["/device:CPU:0", "/device:CPU:1"]
        )
        with strategy.scope():
            dense = [keras.layers.Dense(128, activation="relu", name=f"d{i}") for i in (1, 2, 3)]
            model = compiled(
                keras.Sequential([keras.Input((64,)), *dense, keras.layers.Dense(10, name="d4")])
            )
        h = model.fit(
            digits_train(),
            epochs=3,
            steps_per_epoch=60,
            validation_data=digits_test(),
            verbose=0,
        )
        # (name, device) of the backward matmuls of the traced round.
        backward = [
            (op.name, op.device)
            for op in round_ops(strategy)
            if op.type == "MatMul" and op.name.startswith("gradient_tape/")
        ]
        report(
            {
                "val": h.history["val_accuracy"],
                "plan": strategy.plan.layer_devices,
                "matmuls": op_devices(strategy, "MatMul"),
                "variables": sorted({v.value.device for v in model.trainable_variables}),
                "backward": backward,
            }
        )


def linear_scaling():
    """LinearScaling as the server's schedule, then LinearScalingWarmup as a callback."""
    keras.utils.set_random_seed(0)
    with LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = tfdist_ext.DownpourStrategy(cluster.resolver)
        schedule = LinearScaling(
            0.05, base_batch_size=32, batch_size=64, warmup_epochs=1, steps_per_epoch=40
        )
        with strategy.scope():
            scheduled = compiled(mlp(), keras.optimizers.SGD(schedule))
        h1 = scheduled.fit(digits_train(), epochs=2, steps_per_epoch=40, verbose=0)
        step = int(scheduled.optimizer.iterations.numpy())
        with strategy.scope():
            plain = compiled(mlp(), keras.optimizers.SGD(0.05))
        warmup = LinearScalingWarmup(0.05, base_batch_size=32, batch_size=64, warmup_epochs=1)
        h2 = plain.fit(digits_train(), epochs=2, steps_per_epoch=40, verbose=0, callbacks=[warmup])
        report(
            {
                "loss1": h1.history["loss"],
                "rate_at_end": float(scheduled.optimizer.learning_rate.numpy()),
                "expected": float(schedule(step)),
                "loss2": h2.history["loss"],
                "rates": h2.history["learning_rate"],
            }
        )


def two_strategies():
    """Two strategies, one after the other, on one cluster; both models evaluated
    before and after leaving it."""
    keras.utils.set_random_seed(0)
    x_test, y_test = datasets.digits("test", flatten=True, as_numpy=True)
    models = []
    with LocalCluster(num_workers=2, num_ps=1) as cluster:
        for n in (1, 2):
            strategy = tfdist_ext.DownpourStrategy(cluster.resolver, n_fetch=n, n_push=n)
            with strategy.scope():
                model = compiled(mlp())
            model.fit(digits_train(), epochs=1, steps_per_epoch=40, verbose=0)
            models.append(model)
        before = [m.evaluate(x_test, y_test, verbose=0) for m in models]
    after = [m.evaluate(x_test, y_test, verbose=0) for m in models]
    report({"before": before, "after": after})


def dataset_before_strategy():
    """A dataset made before the strategy connects this process: fit's error."""
    with LocalCluster(num_workers=1, num_ps=1) as cluster:
        train = digits_train()
        strategy = tfdist_ext.DownpourStrategy(cluster.resolver)
        with strategy.scope():
            model = compiled(mlp())
        try:
            model.fit(train, epochs=1, steps_per_epoch=4, verbose=0)
            error = None
        except tf.errors.OpError as e:
            error = [type(e).__name__, e.message]
    report({"error": error})


CASES = {
    fn.__name__: fn
    for fn in (
        fit_evaluate_predict_save,
        n_fetch_n_push_traffic,
        killed_worker,
        nan_pushes,
        killed_ps_chief,
        warmstart,
        compressed_pushes,
        partitioned_replicas,
        linear_scaling,
        two_strategies,
        dataset_before_strategy,
    )
}


def main(argv):
    """``CASE [ARGS]``: runs the case of that name with ARGS."""
    name, *args = argv
    CASES[name](*args)


if __name__ == "__main__":
    main(sys.argv[1:])
