"""SandblasterStrategy on a real local cluster: ``python -m tests.programs.sandblaster_cases
CASE [ARGS]``.

Each case (a function below, named by CASE) starts its own cluster and
prints one ``RESULT`` line for ``tests/test_sandblaster.py`` (``progress``:
``tests/test_output.py``) to check. The problem is an L2-regularised
logistic regression on digits; the reference is SciPy's L-BFGS-B on it
(float64, exact gradient).
"""

import os
import signal
import sys
import time

import keras
import numpy as np
import scipy.optimize
import tensorflow as tf

import tfdist_ext
from tests.programs import report
from tfdist_ext import datasets
from tfdist_ext.cluster import LocalCluster

LAM = 1e-3


def digits():
    """The digits training set: float32 features, int64 labels."""
    x, y = datasets.digits("train", flatten=True, as_numpy=True)
    return x.astype("float32"), y.astype("int64")


def scipy_reference(x, y, memory=10):
    """SciPy's L-BFGS-B on the objective, from zero parameters (float64)."""
    d, k = x.shape[1], 10
    xd = x.astype(np.float64)

    def f(w):
        W = w[: d * k].reshape(d, k)
        b = w[d * k :]
        z = xd @ W + b
        z -= z.max(1, keepdims=True)
        lse = np.log(np.exp(z).sum(1))
        p = np.exp(z - lse[:, None])
        loss = np.mean(lse - z[np.arange(len(y)), y]) + LAM * np.sum(W * W)
        p[np.arange(len(y)), y] -= 1
        p /= len(y)
        return loss, np.concatenate([(xd.T @ p + 2 * LAM * W).ravel(), p.sum(0)])

    return scipy.optimize.minimize(
        f, np.zeros(d * k + k), jac=True, method="L-BFGS-B", options=dict(maxcor=memory)
    )


def numpy_loss(x, y, W, b):
    """The objective at kernel ``W`` and bias ``b``, in float64."""
    z = x.astype(np.float64) @ W + b
    z -= z.max(1, keepdims=True)
    lse = np.log(np.exp(z).sum(1))
    return np.mean(lse - z[np.arange(len(y)), y]) + LAM * np.sum(W.astype(np.float64) ** 2)


def loss_fn(params, batch):
    """The objective as ``sandblaster.minimize`` takes it."""
    xb, yb = batch
    logits = tf.matmul(xb, params[0]) + params[1]
    return tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(yb, logits)
    ) + LAM * tf.reduce_sum(tf.square(params[0]))


def zero_parameters(strategy):
    """A zero kernel and bias on the strategy's parameter servers."""
    with strategy.scope():
        return tf.Variable(tf.zeros([64, 10])), tf.Variable(tf.zeros([10]))


def reset(w, b):
    w.assign(tf.zeros([64, 10]))
    b.assign(tf.zeros([10]))


def _regression(memory=10, metrics=("accuracy",)):
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(
                10, kernel_initializer="zeros", kernel_regularizer=keras.regularizers.L2(LAM)
            ),
        ]
    )
    model.compile(
        optimizer=tfdist_ext.optimizers.LBFGS(memory=memory),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=list(metrics),
    )
    return model


def fit_matches_scipy(path):
    """Keras fit (kernel sharded on 2 ps) to SciPy's optimum, then metrics and save/load."""
    x, y = digits()
    ref = scipy_reference(x, y)
    with LocalCluster(num_workers=2, num_ps=2) as cluster:
        strategy = tfdist_ext.SandblasterStrategy(cluster.resolver, min_shard_bytes=1024)
        with strategy.scope():
            model = _regression()
        history = model.fit(x, y, epochs=40, verbose=0)
        first = len(history.history["loss"])
        history = model.fit(x, y, epochs=300, verbose=0)  # continues the same run
        r = model.optimizer.result
        kernel, bias = model.trainable_variables
        W, b = np.asarray(kernel), np.asarray(bias)
        preds = np.argmax(model.predict(x, verbose=0), 1)
        model.save(path)
        loaded = keras.models.load_model(path, compile=True)
        same = np.allclose(
            loaded.predict(x[:20], verbose=0), model.predict(x[:20], verbose=0), atol=1e-5
        )
        report(
            {
                "fun": r.fun,
                "nit": r.nit,
                "nfev": r.nfev,
                "status": r.status,
                "message": r.message,
                "ref_fun": ref.fun,
                "ref_nit": ref.nit,
                "first": first,
                "numpy_loss": float(numpy_loss(x, y, W, b)),
                "keys": sorted(history.history),
                "accuracy": history.history["accuracy"][-1],
                "np_accuracy": float(np.mean(preds == y)),
                "converged": history.history["converged"][-1],
                "sharded": type(model.trainable_variables[0].value).__name__,
                "bytes": history.history["coordinator_bytes"],
                "evals": history.history["function_evals"],
                "evaluate": model.evaluate(x, y, verbose=0, return_dict=True),
                "loaded_optimizer": type(loaded.optimizer).__name__,
                "loaded_same": bool(same),
            }
        )


def backups_stragglers_and_a_killed_worker():
    """The same 12 iterations clean, with worker 2 throttled, and with worker 1 killed."""
    x, y = digits()
    with LocalCluster(num_workers=3, num_ps=1) as cluster:
        strategy = tfdist_ext.SandblasterStrategy(
            cluster.resolver, slices_per_worker=4, deadline=30
        )
        w, b = zero_parameters(strategy)

        def run(n):
            reset(w, b)
            r = tfdist_ext.sandblaster.minimize(
                loss_fn, [w, b], (x, y), strategy=strategy, max_iterations=n
            )
            return r, [h["loss"] for h in r.history]

        clean, clean_losses = run(12)
        start = len(strategy.passes)
        with cluster.throttle("worker", 2, slowdown=8):
            slow, slow_losses = run(12)
        throttled = strategy.passes[start:]
        start = len(strategy.passes)
        reset(w, b)
        records = []

        def kill_after_three(record):
            records.append(record)
            if len(records) == 3:
                cluster.kill("worker", 1)

        killed = tfdist_ext.sandblaster.minimize(
            loss_fn, [w, b], (x, y), strategy=strategy, max_iterations=12, callback=kill_after_three
        )
        after = strategy.passes[start:]
        report(
            {
                "clean": clean_losses,
                "slow": slow_losses,
                "killed": [h["loss"] for h in killed.history],
                "backups": sum(p.backups for p in throttled),
                "wasted": sum(p.wasted for p in throttled),
                "slices": [p.slices for p in strategy.passes],
                "counted": [sum(p.slices_per_worker) for p in strategy.passes],
                "lost": sorted({t for p in after for t in p.lost_workers}),
                "last_per_worker": after[-1].slices_per_worker,
                "loss_now": float(numpy_loss(x, y, w.numpy(), b.numpy())),
                "fun": killed.fun,
            }
        )


def raised(errors, fn, *args, **kwargs):
    """The message of the ``errors`` ``fn(*args, **kwargs)`` raises, or None when it returns."""
    try:
        fn(*args, **kwargs)
    except errors as e:
        return str(e)
    return None


def nan_stops():
    """A loss that turns NaN mid-run, then data with a NaN from the start."""
    x, y = digits()
    with LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = tfdist_ext.SandblasterStrategy(cluster.resolver, slices_per_worker=2)
        w, b = zero_parameters(strategy)

        # The loss turns NaN once the kernel's norm passes a bound the path crosses.
        def poisoned(params, batch):
            norm = tf.norm(params[0])
            return loss_fn(params, batch) + tf.where(norm > 1.0, np.nan, 0.0)

        records = []
        minimize = tfdist_ext.sandblaster.minimize
        message = raised(
            FloatingPointError,
            minimize,
            poisoned,
            [w, b],
            (x, y),
            strategy=strategy,
            callback=records.append,
        )
        good = records[-1]["loss"] if records else None
        bad_x = x.copy()
        bad_x[5, 3] = np.nan
        with strategy.scope():
            w2 = tf.Variable(tf.ones([64, 10]))
            b2 = tf.Variable(tf.zeros([10]))
        message2 = raised(
            FloatingPointError, minimize, loss_fn, [w2, b2], (bad_x, y), strategy=strategy
        )
        report(
            {
                "message": message,
                "iterations": len(records),
                "good": good,
                "loss_now": float(numpy_loss(x, y, w.numpy(), b.numpy())),
                "norm": float(np.linalg.norm(w.numpy())),
                "message2": message2,
                "w2_untouched": bool(np.all(w2.numpy() == 1.0)),
            }
        )


def stuck_worker():
    """Worker 1 stopped (SIGSTOP) with backups off and a 5 s deadline."""
    x, y = digits()
    with LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = tfdist_ext.SandblasterStrategy(
            cluster.resolver, backup_tasks=False, slices_per_worker=2, deadline=5
        )
        w, b = zero_parameters(strategy)
        tfdist_ext.sandblaster.minimize(
            loss_fn, [w, b], (x, y), strategy=strategy, max_iterations=1
        )
        os.kill(cluster.pid("worker", 1), signal.SIGSTOP)
        t0 = time.time()
        error = raised(
            tfdist_ext.cluster.ClusterTimeoutError,
            tfdist_ext.sandblaster.minimize,
            loss_fn,
            [w, b],
            (x, y),
            strategy=strategy,
        )
        report({"error": error, "seconds": time.time() - t0})
        os.kill(cluster.pid("worker", 1), signal.SIGCONT)


def _value_error(fn):
    """The message of the ValueError or TypeError ``fn()`` raises, or None."""
    return raised((ValueError, TypeError), fn)


def bad_inputs():
    """Each wrong input's error, then a finite dataset against arrays."""
    x, y = digits()
    minimize = tfdist_ext.sandblaster.minimize
    errors = {}
    with LocalCluster(num_workers=1, num_ps=1) as cluster:
        strategy = tfdist_ext.SandblasterStrategy(cluster.resolver)
        local = tf.Variable(tf.zeros([64, 10]))  # not under strategy.scope()
        errors["local"] = _value_error(
            lambda: minimize(loss_fn, [local], (x, y), strategy=strategy)
        )
        w, b = zero_parameters(strategy)
        infinite = tf.data.Dataset.from_tensor_slices((x, y)).batch(10).repeat()
        errors["infinite"] = _value_error(
            lambda: minimize(loss_fn, [w, b], infinite, strategy=strategy)
        )
        errors["sizes"] = _value_error(
            lambda: minimize(loss_fn, [w, b], (x, y[:10]), strategy=strategy)
        )
        errors["strategy"] = _value_error(
            lambda: minimize(loss_fn, [w, b], (x, y), strategy=tf.distribute.get_strategy())
        )
        with strategy.scope():
            model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
            model.compile(optimizer="sgd", loss="mse")
        errors["optimizer"] = _value_error(lambda: model.fit(x, y, epochs=1, verbose=0))
        # A finite dataset works and gives the same optimum as arrays.
        r1 = minimize(loss_fn, [w, b], (x, y), strategy=strategy, max_iterations=5)
        reset(w, b)
        finite = tf.data.Dataset.from_tensor_slices((x, y)).batch(100)
        r2 = minimize(loss_fn, [w, b], finite, strategy=strategy, max_iterations=5)
        report({"errors": errors, "f1": r1.fun, "f2": r2.fun, "nit": r2.nit})


def progress():
    """fit and minimize at verbose=0 between SILENT-START and SILENT-END, then at verbose=1."""
    x, y = digits()
    with LocalCluster(num_workers=1, num_ps=1) as cluster:
        strategy = tfdist_ext.SandblasterStrategy(cluster.resolver)
        w, b = zero_parameters(strategy)
        with strategy.scope():
            model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
            model.compile(
                optimizer=tfdist_ext.optimizers.LBFGS(memory=5),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        print("SILENT-START", flush=True)
        model.fit(x, y, epochs=2, verbose=0)
        tfdist_ext.sandblaster.minimize(
            loss_fn, [w, b], (x, y), strategy=strategy, max_iterations=2
        )
        print("SILENT-END", flush=True)
        model.fit(x, y, epochs=2, verbose=1)
        reset(w, b)
        r = tfdist_ext.sandblaster.minimize(
            loss_fn, [w, b], (x, y), strategy=strategy, max_iterations=3, verbose=1
        )
        bad = raised(
            ValueError,
            tfdist_ext.sandblaster.minimize,
            loss_fn,
            [w, b],
            (x, y),
            strategy=strategy,
            verbose=2,
        )
        report({"loss": r.fun, "bad": bad})


CASES = {
    fn.__name__: fn
    for fn in (
        fit_matches_scipy,
        backups_stragglers_and_a_killed_worker,
        nan_stops,
        stuck_worker,
        bad_inputs,
        progress,
    )
}


def main(argv):
    """``CASE [ARGS]``: runs the case of that name with ARGS."""
    name, *args = argv
    CASES[name](*args)


if __name__ == "__main__":
    main(sys.argv[1:])
