"""Sandblaster L-BFGS: the line search, the optimizer's config, and the strategy on a real cluster.

Cluster tests run a case of ``tests/programs/sandblaster_cases.py`` in a
fresh interpreter (``run_program``) with a deadline; each starts one
LocalCluster and checks several things on it. The reference is SciPy's
L-BFGS-B on the same L2-regularised logistic regression (float64, exact
gradient).
"""

import math

import numpy as np
import pytest

from tests.programs import run_program
from tfdist_ext.sandblaster._line_search import LineSearchError
from tfdist_ext.sandblaster._line_search import strong_wolfe
from tfdist_ext.sandblaster._vectors import ring_order

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


def test_a_saved_lbfgs_model_loads_in_a_fresh_process_after_import_tfdist_ext(tmp_path):
    # Issue 38, item 8: the user's loading script imports keras and tfdist_ext
    # (nothing of tfdist_ext's submodules) and loads the file compiled.
    path = str(tmp_path / "lbfgs.keras")
    run_program("saved_optimizers", "save_lbfgs", path, timeout=240)
    r = run_program("saved_optimizers", "load_lbfgs", path, timeout=240)
    assert r["optimizer"] == "LBFGS" and r["memory"] == 4
    np.testing.assert_allclose(r["predicted"], r["saved"])


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


@pytest.mark.slow
def test_fit_matches_scipy_lbfgs_b(tmp_path):
    """Keras fit on digits (sharded kernel on 2 ps) reaches SciPy's optimum; metrics, save/load."""
    r = run_program(
        "sandblaster_cases", "fit_matches_scipy", str(tmp_path / "fit.keras"), timeout=280
    )
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


def test_backups_stragglers_and_a_killed_worker_keep_results_exact():
    """Backup copies beat a throttled worker, a killed worker's slices are redone; identical iterates."""
    r = run_program("sandblaster_cases", "backups_stragglers_and_a_killed_worker", timeout=280)
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


@pytest.mark.slow
def test_nan_stops_with_the_iteration_and_keeps_good_parameters():
    r = run_program("sandblaster_cases", "nan_stops", timeout=240)
    assert r["message"] and "NaN or Inf" in r["message"], r
    assert f"iteration {r['iterations'] + 1}" in r["message"]
    assert f"parameters of iteration {r['iterations']}" in r["message"]
    assert r["iterations"] >= 1 and r["norm"] <= 1.0
    assert abs(r["loss_now"] - r["good"]) / r["good"] < 1e-5
    assert "iteration 1" in r["message2"] and "initial parameters" in r["message2"]
    assert r["w2_untouched"]


@pytest.mark.slow
def test_a_stuck_worker_without_backups_fails_at_the_deadline():
    r = run_program("sandblaster_cases", "stuck_worker", timeout=120)
    assert r["error"] and "no slice finished for 5 s" in r["error"], r
    assert r["seconds"] < 30


@pytest.mark.slow
def test_bad_inputs_are_clear_errors():
    r = run_program("sandblaster_cases", "bad_inputs", timeout=200)
    e = r["errors"]
    assert "not on a 'ps' task" in e["local"] and "strategy.scope()" in e["local"]
    assert "infinite" in e["infinite"]
    assert "different numbers of examples" in e["sizes"]
    assert "must be a SandblasterStrategy" in e["strategy"]
    assert "tfdist_ext.optimizers.LBFGS" in e["optimizer"]
    assert r["nit"] == 5 and abs(r["f1"] - r["f2"]) < 1e-6 * r["f1"]
