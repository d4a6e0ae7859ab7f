"""Sandblaster L-BFGS: the line search, the optimizer's config, and the strategy on a real cluster.

Cluster tests run their body in a fresh interpreter (``script`` fixture) with
a deadline; each starts one LocalCluster and checks several things on it.
The reference is SciPy's L-BFGS-B on the same L2-regularised logistic
regression (float64, exact gradient).
"""

import json
import math

import pytest

from tfdist_ext.sandblaster._line_search import LineSearchError
from tfdist_ext.sandblaster._line_search import strong_wolfe
from tfdist_ext.sandblaster._vectors import ring_order

PRELUDE = r"""
import json, os, signal, sys, time
import numpy as np
import keras
import scipy.optimize
import tensorflow as tf
import tfdist_ext
from tfdist_ext import datasets
from tfdist_ext.cluster import LocalCluster

LAM = 1e-3
x, y = datasets.digits("train", flatten=True, as_numpy=True)
x = x.astype("float32"); y = y.astype("int64")

def scipy_reference(x, y, memory=10):
    d, k = x.shape[1], 10
    xd = x.astype(np.float64)
    def f(w):
        W = w[:d * k].reshape(d, k); b = w[d * k:]
        z = xd @ W + b; z -= z.max(1, keepdims=True)
        lse = np.log(np.exp(z).sum(1)); p = np.exp(z - lse[:, None])
        loss = np.mean(lse - z[np.arange(len(y)), y]) + LAM * np.sum(W * W)
        p[np.arange(len(y)), y] -= 1; p /= len(y)
        return loss, np.concatenate([(xd.T @ p + 2 * LAM * W).ravel(), p.sum(0)])
    return scipy.optimize.minimize(f, np.zeros(d * k + k), jac=True, method="L-BFGS-B",
                                   options=dict(maxcor=memory))

def numpy_loss(W, b):
    z = x.astype(np.float64) @ W + b; z -= z.max(1, keepdims=True)
    lse = np.log(np.exp(z).sum(1))
    return np.mean(lse - z[np.arange(len(y)), y]) + LAM * np.sum(W.astype(np.float64) ** 2)

def loss_fn(params, batch):
    xb, yb = batch
    logits = tf.matmul(xb, params[0]) + params[1]
    return (tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(yb, logits))
            + LAM * tf.reduce_sum(tf.square(params[0])))

def report(**values):
    print("RESULT " + json.dumps(values), flush=True)
"""


def _result(proc):
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


# ---------------------------------------------------------------- pure Python


@pytest.mark.parametrize(
    "phi, f0, g0, step",
    [
        (lambda a: ((a - 2.0) ** 2, 2.0 * (a - 2.0)), 4.0, -4.0, 1.0),  # extrapolate
        (lambda a: ((a - 0.01) ** 2, 2.0 * (a - 0.01)), 1e-4, -0.02, 1.0),  # zoom back
        (lambda a: (math.exp(a) - 3.0 * a, math.exp(a) - 3.0), 1.0, -2.0, 1e-3),
        (lambda a: (a**4 - a, 4.0 * a**3 - 1.0), 0.0, -1.0, 50.0),  # far overshoot
    ],
)
@pytest.mark.parametrize("c2", [0.9, 0.1])
def test_line_search_meets_strong_wolfe(phi, f0, g0, step, c2):
    calls = []

    def traced(a):
        calls.append(a)
        return phi(a)

    a, f, g, evaluations = strong_wolfe(traced, f0, g0, step, c1=1e-4, c2=c2)
    assert a > 0 and evaluations == len(calls)
    assert calls[-1] == a, "the accepted step must be the one evaluated last"
    assert (f, g) == phi(a)
    assert f <= f0 + 1e-4 * a * g0
    assert abs(g) <= c2 * abs(g0)


def test_line_search_errors():
    with pytest.raises(ValueError, match="descent direction"):
        strong_wolfe(lambda a: (a, 1.0), 0.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="0 < c1 < c2 < 1"):
        strong_wolfe(lambda a: (a, 1.0), 0.0, -1.0, 1.0, c1=0.5, c2=0.4)
    # A function that never decreases enough along the direction.
    with pytest.raises(LineSearchError, match="evaluations") as e:
        strong_wolfe(lambda a: (1.0 + a, 1.0), 1.0, -1.0, 1.0, max_evaluations=5)
    assert e.value.evaluations == 5


def test_ring_order_is_newest_first():
    assert ring_order(3, 3, 5) == [2, 1, 0]
    assert ring_order(1, 5, 5) == [0, 4, 3, 2, 1]
    assert ring_order(0, 0, 5) == []


def test_a_loss_found_after_its_pass_ended_is_reported_by_the_next_pass():
    """A backup copy can outlive its pass; its worker's loss is still named in a report."""
    import threading

    import tensorflow as tf

    from tfdist_ext.sandblaster._engine import Evaluator

    ev = Evaluator.__new__(Evaluator)  # the scheduler's bookkeeping alone, no cluster
    ev.slices, ev._cv, ev._pass, ev._passes = [(0, 4), (4, 4)], threading.Condition(), None, 0
    ev._dead, ev._unreported = set(), []
    unreachable = tf.errors.UnavailableError(None, None, "connection refused")
    with ev._cv:
        first = ev._begin_pass()
    first.pending.popleft()
    first.running[0].add(1)
    first.finished = True  # reported while worker 1's backup copy still ran
    ev._lose(1, first, 0, unreachable)
    assert first.lost == [] and ev.lost_workers == [1]
    with ev._cv:
        second = ev._begin_pass()
    assert second.lost == [1]
    # Found while a pass runs: that pass names it, and the slice goes back.
    second.pending.popleft()
    second.running[0].add(2)
    ev._lose(2, second, 0, unreachable)
    assert second.lost == [1, 2] and list(second.pending) == [0, 1]
    with ev._cv:
        assert ev._begin_pass().lost == []


def test_lbfgs_optimizer_config_and_errors():
    import keras

    import tfdist_ext

    opt = tfdist_ext.optimizers.LBFGS(memory=7, gtol=1e-6, max_iterations=50, c2=0.8)
    again = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert isinstance(again, tfdist_ext.optimizers.LBFGS)
    assert (again.memory, again.gtol, again.max_iterations, again.c2) == (7, 1e-6, 50, 0.8)
    for kwargs, message in [
        (dict(memory=0), "memory must be an integer >= 1"),
        (dict(memory=2.5), "memory must be an integer"),
        (dict(gtol=-1.0), "gtol must be a number >= 0"),
        (dict(c1=0.9, c2=0.5), "0 < c1 < c2 < 1"),
        (dict(max_line_search=0), "max_line_search"),
        (dict(clipnorm=1.0), "clipnorm is not supported"),
        (dict(line_search="backtracking"), "line_search must be one of"),
    ]:
        with pytest.raises(ValueError, match=message):
            tfdist_ext.optimizers.LBFGS(**kwargs)
    with pytest.raises(NotImplementedError, match="SandblasterStrategy"):
        opt.update_step(None, None, None)


def test_a_model_compiled_with_lbfgs_loads_compiled_where_tfdist_ext_is_imported(tmp_path):
    import keras
    import numpy as np

    import tfdist_ext

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=tfdist_ext.optimizers.LBFGS(memory=4), loss="mse")
    path = str(tmp_path / "lbfgs.keras")
    model.save(path)
    again = keras.models.load_model(path)
    assert isinstance(again.optimizer, tfdist_ext.optimizers.LBFGS)
    assert again.optimizer.memory == 4
    x = np.ones((2, 3), "float32")
    np.testing.assert_allclose(again.predict(x, verbose=0), model.predict(x, verbose=0))


def test_a_saved_lbfgs_model_loads_in_a_fresh_process_after_import_tfdist_ext(script, tmp_path):
    # Issue 38, item 8: the user's loading script imports keras and tfdist_ext
    # (nothing of tfdist_ext's submodules) and loads the file compiled.
    path = str(tmp_path / "lbfgs.keras")
    script(
        f"""
import keras, numpy as np, tfdist_ext
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
model.compile(optimizer=tfdist_ext.optimizers.LBFGS(memory=4), loss="mse")
model.save({path!r})
np.save({path!r} + ".npy", model.predict(np.ones((2, 3), "float32"), verbose=0))
"""
    )
    proc = script(
        f"""
import keras, numpy as np
import tfdist_ext
model = keras.models.load_model({path!r})
assert type(model.optimizer).__name__ == "LBFGS" and model.optimizer.memory == 4
np.testing.assert_allclose(model.predict(np.ones((2, 3), "float32"), verbose=0),
                           np.load({path!r} + ".npy"))
print("LOADED")
"""
    )
    assert "LOADED" in proc.stdout


def test_strategy_argument_errors():
    import tensorflow as tf

    import tfdist_ext

    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": ["127.0.0.1:1"]}), task_type="chief", task_id=0
    )
    for kwargs, message in [
        (dict(slices_per_worker=0), "slices_per_worker must be an integer >= 1"),
        (dict(max_copies=1), "max_copies must be an integer >= 2"),
        (dict(backup_tasks="yes"), "backup_tasks must be True or False"),
        (dict(deadline=0), "deadline must be a number > 0"),
        (dict(), "no 'ps' job"),
    ]:
        with pytest.raises(ValueError, match=message):
            tfdist_ext.SandblasterStrategy(resolver, **kwargs)


# ---------------------------------------------------------------- on a cluster


def test_fit_matches_scipy_lbfgs_b(script, tmp_path):
    """Keras fit on digits (sharded kernel on 2 ps) reaches SciPy's optimum; metrics, save/load."""
    proc = script(
        PRELUDE
        + f"path = {str(tmp_path / 'fit.keras')!r}\n"
        + r"""
ref = scipy_reference(x, y)
with LocalCluster(num_workers=2, num_ps=2) as cluster:
    strategy = tfdist_ext.SandblasterStrategy(cluster.resolver, min_shard_bytes=1024)
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(
            10, kernel_initializer="zeros", kernel_regularizer=keras.regularizers.L2(LAM))])
        model.compile(optimizer=tfdist_ext.optimizers.LBFGS(memory=10),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    history = model.fit(x, y, epochs=40, verbose=0)
    first = len(history.history["loss"])
    history = model.fit(x, y, epochs=300, verbose=0)        # continues the same run
    r = model.optimizer.result
    kernel, bias = model.trainable_variables
    W, b = np.asarray(kernel), np.asarray(bias)
    preds = np.argmax(model.predict(x, verbose=0), 1)
    model.save(path)
    loaded = keras.models.load_model(path, compile=True)
    report(fun=r.fun, nit=r.nit, nfev=r.nfev, status=r.status, message=r.message,
           ref_fun=ref.fun, ref_nit=ref.nit, first=first,
           numpy_loss=float(numpy_loss(W, b)), keys=sorted(history.history),
           accuracy=history.history["accuracy"][-1], np_accuracy=float(np.mean(preds == y)),
           converged=history.history["converged"][-1],
           sharded=type(model.trainable_variables[0].value).__name__,
           bytes=history.history["coordinator_bytes"],
           evals=history.history["function_evals"],
           evaluate=model.evaluate(x, y, verbose=0, return_dict=True),
           loaded_optimizer=type(loaded.optimizer).__name__,
           loaded_same=bool(np.allclose(loaded.predict(x[:20], verbose=0),
                                        model.predict(x[:20], verbose=0), atol=1e-5)))
""",
        timeout=280,
    )
    r = _result(proc)
    assert r["first"] == 40 and r["status"] == 0, r
    assert r["sharded"] == "ShardedVariable"
    assert abs(r["fun"] - r["ref_fun"]) / r["ref_fun"] < 1e-6, r
    assert r["nit"] <= 1.5 * r["ref_nit"], r
    # The reported loss is the objective at the model's parameters.
    assert abs(r["numpy_loss"] - r["fun"]) / r["fun"] < 1e-5, r
    assert abs(r["accuracy"] - r["np_accuracy"]) < 1e-6
    assert abs(r["evaluate"]["loss"] - r["fun"]) < 1e-4
    assert r["converged"] == 1.0
    for key in (
        "loss",
        "accuracy",
        "grad_max",
        "step_size",
        "function_evals",
        "coordinator_bytes",
        "backup_slices",
        "wasted_slices",
        "converged",
    ):
        assert key in r["keys"], key
    # Scalars only: under 1 kB per pass (20 slices' results, probe and
    # commit scalars); the kernel alone is 2,560 bytes.
    per_pass = [b / max(e, 1) for b, e in zip(r["bytes"], r["evals"])]
    assert 0 < max(per_pass) < 1024, per_pass
    assert r["loaded_optimizer"] == "LBFGS" and r["loaded_same"]


def test_backups_stragglers_and_a_killed_worker_keep_results_exact(script):
    """Backup copies beat a throttled worker, a killed worker's slices are redone; identical iterates."""
    proc = script(
        PRELUDE
        + r"""
with LocalCluster(num_workers=3, num_ps=1) as cluster:
    strategy = tfdist_ext.SandblasterStrategy(cluster.resolver, slices_per_worker=4, deadline=30)
    with strategy.scope():
        w = tf.Variable(tf.zeros([64, 10])); b = tf.Variable(tf.zeros([10]))
    def run(n):
        w.assign(tf.zeros([64, 10])); b.assign(tf.zeros([10]))
        r = tfdist_ext.sandblaster.minimize(loss_fn, [w, b], (x, y), strategy=strategy,
                                            max_iterations=n)
        return r, [h["loss"] for h in r.history]
    clean, clean_losses = run(12)
    start = len(strategy.passes)
    with cluster.throttle("worker", 2, slowdown=8):
        slow, slow_losses = run(12)
    throttled = strategy.passes[start:]
    start = len(strategy.passes)
    w.assign(tf.zeros([64, 10])); b.assign(tf.zeros([10]))
    records = []
    def kill_after_three(record):
        records.append(record)
        if len(records) == 3:
            cluster.kill("worker", 1)
    killed = tfdist_ext.sandblaster.minimize(loss_fn, [w, b], (x, y), strategy=strategy,
                                             max_iterations=12, callback=kill_after_three)
    after = strategy.passes[start:]
    report(clean=clean_losses, slow=slow_losses, killed=[h["loss"] for h in killed.history],
           backups=sum(p.backups for p in throttled), wasted=sum(p.wasted for p in throttled),
           slices=[p.slices for p in strategy.passes],
           counted=[sum(p.slices_per_worker) for p in strategy.passes],
           lost=sorted({w for p in after for w in p.lost_workers}),
           last_per_worker=after[-1].slices_per_worker,
           loss_now=float(numpy_loss(w.numpy(), b.numpy())), fun=killed.fun)
""",
        timeout=280,
    )
    r = _result(proc)
    # Every pass counted each of its 12 slices exactly once.
    assert set(r["slices"]) == {12} and r["counted"] == r["slices"]
    assert r["backups"] > 0, r
    # The accumulator sums slice gradients in float64 (exact in practice), so
    # the order slices finish in does not matter: the very same iterates.
    assert r["slow"] == r["clean"], (r["clean"], r["slow"])
    assert r["killed"] == r["clean"], (r["clean"], r["killed"])
    # The killed worker counts no slice at the end, and a report names its
    # loss (the pass that found it, or the next one when the failing copy had
    # outlived its own pass).
    assert r["lost"] == [1] and r["last_per_worker"][1] == 0, r
    assert abs(r["loss_now"] - r["fun"]) / r["fun"] < 1e-5


def test_nan_stops_with_the_iteration_and_keeps_good_parameters(script):
    proc = script(
        PRELUDE
        + r"""
with LocalCluster(num_workers=2, num_ps=1) as cluster:
    strategy = tfdist_ext.SandblasterStrategy(cluster.resolver, slices_per_worker=2)
    with strategy.scope():
        w = tf.Variable(tf.zeros([64, 10])); b = tf.Variable(tf.zeros([10]))
    # The loss turns NaN once the kernel's norm passes a bound the path crosses.
    def poisoned(params, batch):
        norm = tf.norm(params[0])
        return loss_fn(params, batch) + tf.where(norm > 1.0, np.nan, 0.0)
    records = []
    try:
        tfdist_ext.sandblaster.minimize(poisoned, [w, b], (x, y), strategy=strategy,
                                        callback=records.append)
        message = None
    except FloatingPointError as e:
        message = str(e)
    good = records[-1]["loss"] if records else None
    bad_x = x.copy(); bad_x[5, 3] = np.nan
    w2 = None
    with strategy.scope():
        w2 = tf.Variable(tf.ones([64, 10])); b2 = tf.Variable(tf.zeros([10]))
    try:
        tfdist_ext.sandblaster.minimize(loss_fn, [w2, b2], (bad_x, y), strategy=strategy)
        message2 = None
    except FloatingPointError as e:
        message2 = str(e)
    report(message=message, iterations=len(records), good=good,
           loss_now=float(numpy_loss(w.numpy(), b.numpy())),
           norm=float(np.linalg.norm(w.numpy())), message2=message2,
           w2_untouched=bool(np.all(w2.numpy() == 1.0)))
""",
        timeout=240,
    )
    r = _result(proc)
    assert r["message"] and "NaN or Inf" in r["message"], r
    assert f"iteration {r['iterations'] + 1}" in r["message"]
    assert f"parameters of iteration {r['iterations']}" in r["message"]
    assert r["iterations"] >= 1 and r["norm"] <= 1.0
    assert abs(r["loss_now"] - r["good"]) / r["good"] < 1e-5
    assert "iteration 1" in r["message2"] and "initial parameters" in r["message2"]
    assert r["w2_untouched"]


def test_a_stuck_worker_without_backups_fails_at_the_deadline(script):
    proc = script(
        PRELUDE
        + r"""
with LocalCluster(num_workers=2, num_ps=1) as cluster:
    strategy = tfdist_ext.SandblasterStrategy(cluster.resolver, backup_tasks=False,
                                              slices_per_worker=2, deadline=5)
    with strategy.scope():
        w = tf.Variable(tf.zeros([64, 10])); b = tf.Variable(tf.zeros([10]))
    tfdist_ext.sandblaster.minimize(loss_fn, [w, b], (x, y), strategy=strategy, max_iterations=1)
    os.kill(cluster.pid("worker", 1), signal.SIGSTOP)
    t0 = time.time()
    try:
        tfdist_ext.sandblaster.minimize(loss_fn, [w, b], (x, y), strategy=strategy)
        error = None
    except tfdist_ext.cluster.ClusterTimeoutError as e:
        error = str(e)
    report(error=error, seconds=time.time() - t0)
    os.kill(cluster.pid("worker", 1), signal.SIGCONT)
""",
        timeout=120,
    )
    r = _result(proc)
    assert r["error"] and "no slice finished for 5 s" in r["error"], r
    assert r["seconds"] < 30


def test_bad_inputs_are_clear_errors(script):
    proc = script(
        PRELUDE
        + r"""
errors = {}
def catch(name, fn):
    try:
        fn()
        errors[name] = None
    except (ValueError, TypeError) as e:
        errors[name] = str(e)
with LocalCluster(num_workers=1, num_ps=1) as cluster:
    strategy = tfdist_ext.SandblasterStrategy(cluster.resolver)
    local = tf.Variable(tf.zeros([64, 10]))      # not under strategy.scope()
    catch("local", lambda: tfdist_ext.sandblaster.minimize(
        loss_fn, [local], (x, y), strategy=strategy))
    with strategy.scope():
        w = tf.Variable(tf.zeros([64, 10])); b = tf.Variable(tf.zeros([10]))
    catch("infinite", lambda: tfdist_ext.sandblaster.minimize(
        loss_fn, [w, b], tf.data.Dataset.from_tensor_slices((x, y)).batch(10).repeat(),
        strategy=strategy))
    catch("sizes", lambda: tfdist_ext.sandblaster.minimize(
        loss_fn, [w, b], (x, y[:10]), strategy=strategy))
    catch("strategy", lambda: tfdist_ext.sandblaster.minimize(
        loss_fn, [w, b], (x, y), strategy=tf.distribute.get_strategy()))
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
        model.compile(optimizer="sgd", loss="mse")
    catch("optimizer", lambda: model.fit(x, y, epochs=1, verbose=0))
    # A finite dataset works and gives the same optimum as arrays.
    r1 = tfdist_ext.sandblaster.minimize(loss_fn, [w, b], (x, y), strategy=strategy,
                                         max_iterations=5)
    w.assign(tf.zeros([64, 10])); b.assign(tf.zeros([10]))
    r2 = tfdist_ext.sandblaster.minimize(
        loss_fn, [w, b], tf.data.Dataset.from_tensor_slices((x, y)).batch(100),
        strategy=strategy, max_iterations=5)
    report(errors=errors, f1=r1.fun, f2=r2.fun, nit=r2.nit)
""",
        timeout=200,
    )
    r = _result(proc)
    e = r["errors"]
    assert "not on a 'ps' task" in e["local"] and "strategy.scope()" in e["local"]
    assert "infinite" in e["infinite"]
    assert "different numbers of examples" in e["sizes"]
    assert "must be a SandblasterStrategy" in e["strategy"]
    assert "tfdist_ext.optimizers.LBFGS" in e["optimizer"]
    assert r["nit"] == 5 and abs(r["f1"] - r["f2"]) < 1e-6 * r["f1"]
