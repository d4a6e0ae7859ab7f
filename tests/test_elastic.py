"""ElasticAveragingStrategy (asynchronous EASGD) on a real local cluster, through ``model.fit``.

The killed-worker and NaN tests are shared with Downpour (test_downpour.py,
``ASYNC_STRATEGIES``).

Each cluster test runs a case of ``tests/programs/elastic_cases.py`` in a
fresh interpreter (``run_program``): one process can connect to one
TensorFlow cluster only.
"""

import pytest

from conftest import assert_added_loss_trained
from tests.programs import run_program


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"alpha": 0.0}, "alpha"),
        ({"alpha": 1.0}, "alpha"),
        ({"alpha": -0.5}, "alpha"),
        ({"alpha": float("nan")}, "alpha"),
        ({"alpha": "0.1"}, "alpha"),
        ({"alpha": True}, "alpha"),
        ({"tau": 0}, "tau"),
        ({"tau": 2.5}, "tau"),
        ({"tau": None}, "tau"),
    ],
)
def test_bad_alpha_or_tau_is_refused_at_construction(kwargs, named):
    import tfdist_ext

    # Checked before the strategy touches the cluster: no resolver needed.
    with pytest.raises(ValueError, match=f"ElasticAveragingStrategy: {named}"):
        tfdist_ext.ElasticAveragingStrategy(None, **kwargs)


@pytest.mark.timeout(300)
def test_centre_and_replica_follow_the_easgd_rule_exactly():
    # One worker, so the order of exchanges is fixed: the centre after three
    # fits must be what EASGD's update (SGD with momentum locally, the
    # elastic exchange every tau steps, the replica and its momentum kept
    # between rounds and between fits, but started afresh from the centre
    # once the centre was set between fits) gives in NumPy.
    r = run_program("elastic_cases", "easgd_rule", timeout=280)
    import numpy as np

    lr, momentum, alpha, tau, batch = 0.05, 0.5, 0.3, 3, 4
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 2)).astype("float32")
    y = (x @ np.array([[2.0], [-1.0]], "float32") + 0.5).astype("float32")
    centre = [np.ones((2, 1)), np.zeros(1)]
    step = 0
    for fit_steps, afresh in ((24, True), (12, False), (12, True)):
        if fit_steps == 12 and afresh:
            np.testing.assert_allclose(r["centre_2"][0], centre[0], rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(r["centre_2"][1], centre[1], rtol=1e-4, atol=1e-5)
            centre = [np.full((2, 1), 0.5), np.ones(1)]
        if afresh:
            replica = [c.copy() for c in centre]
            velocity = [np.zeros_like(c) for c in centre]
        for _ in range(fit_steps):
            start = (step * batch) % len(x)
            xb, yb = x[start : start + batch], y[start : start + batch]
            err = xb @ replica[0] + replica[1] - yb
            grads = [2 * xb.T @ err / batch, 2 * err.sum(0) / batch]
            velocity = [momentum * v - lr * g for v, g in zip(velocity, grads)]
            replica = [w + v for w, v in zip(replica, velocity)]
            step += 1
            if step % tau == 0:
                moves = [alpha * (w - c) for w, c in zip(replica, centre)]
                replica = [w - d for w, d in zip(replica, moves)]
                centre = [c + d for c, d in zip(centre, moves)]
    np.testing.assert_allclose(r["kernel"], centre[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(r["bias"], centre[1], rtol=1e-4, atol=1e-5)
    assert r["iterations"] == 48
    # 16 exchanges, none stale (one worker), bytes of the model each way per exchange.
    assert r["stats"]["pushes"] == 16 and r["stats"]["staleness_max"] == 0
    # The replica crossed from the ps only when it started: in the first fit
    # and after set_weights; every other round began from the one it held.
    stats = r["stats"]
    assert stats["fetches"] == 16 + 2, stats
    assert stats["prefetched_rounds"] == stats["rounds"] - 2, stats


# The compiled optimizers (elastic_cases.EXACT_OPTIMIZERS), as plain Keras
# would build them; options Keras applies itself (weight decay, clipping,
# loss scaling) included.
# Adam in the default suite; the others in the slow lane (tox -e tests-all).
EXACT_OPTIMIZERS = [
    "adam",
    pytest.param("adagrad", marks=pytest.mark.slow),
    pytest.param("loss_scale", marks=pytest.mark.slow),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("optimizer", EXACT_OPTIMIZERS)
def test_replica_takes_plain_keras_optimizer_steps_between_exchanges(optimizer):
    # One worker: the centre after three epochs of tau=3 steps must be what a
    # plain Keras model (the replica, its optimizer state kept between
    # exchanges) trained with train_on_batch gives, with the elastic exchange
    # done by hand every tau steps. A callback halves the learning rate before
    # the last epoch: the replica's update must see it.
    r = run_program("elastic_cases", "plain_keras_steps", optimizer, timeout=280)
    import numpy as np

    for got, expected in zip(r["centre"], r["expected"]):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    # The replica moved: the centre is not where it started.
    assert abs(r["expected"][0][0][0] - 1.0) > 1e-2
    assert r["iterations"] == 9 and r["pushes"] == 3


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_two_workers_train_digits_with_adaptive_optimizers():
    # DistBelief's Adagrad, Adam, and Adam under mixed_float16 (Keras wraps it
    # in a LossScaleOptimizer, whose loss scale each replica keeps).
    results = run_program("elastic_cases", "adaptive_optimizers", timeout=280)["results"]
    assert results["mixed_float16"]["optimizer"] == "LossScaleOptimizer"
    for r in results.values():
        assert r["loss"][-1] < 0.7 * r["loss"][0], results
        # Ten classes: chance is 0.1.
        assert r["accuracy"] > 0.85, results
        assert r["rejected"] == [0, 0, 0], results


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_two_workers_train_digits_and_evaluate_the_centre():
    r = run_program("elastic_cases", "digits_and_centre", timeout=280)
    assert r["accuracy"] > 0.9, r
    assert r["history"]["loss"][-1] < r["history"]["loss"][0]
    assert set(r["per_worker"]) == {"0", "1"}
    # Each replica exchanges every tau=4 of its own steps, a period spanning
    # rounds and epochs: 180 steps, 44 or 45 exchanges.
    assert r["stats"]["pushes"] == sum(n // 4 for n in r["per_worker"].values()), r
    assert r["stats"]["rejected_pushes"] == 0
    # The loss a layer adds in call() is part of what the replicas train
    # (it was dropped: the reported loss lacked it).
    assert_added_loss_trained(r)
    assert r["config"] == {
        "alpha": 0.45,
        "tau": 4,
        "min_shard_bytes": 256 << 20,
        "deadline": 60.0,
    }


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_what_easgd_cannot_train_is_refused_before_the_first_step():
    refused = run_program("elastic_cases", "refused_before_the_first_step", timeout=280)["refused"]
    expected = {
        "ema": "use_ema=True",
        "ema_inner": "SGD has use_ema=True",
        "accumulation": "gradient_accumulation_steps=2",
        "train_step": "compute_loss override",
    }
    for name, words in expected.items():
        assert refused[name] is not None, f"{name} was not refused"
        message, batches = refused[name]
        assert message.startswith("ElasticAveragingStrategy:") and words in message, message
        assert batches == 0, f"{name} refused only after {batches} batches"


@pytest.mark.timeout(300)
@pytest.mark.slow  # four clusters, one after another: about a minute
def test_a_run_resumed_in_a_fresh_process_continues_each_replica(tmp_path):
    # Keras's own BackupAndRestore, as a user passes it: a run preempted at
    # epoch 2 and resumed by a new process (on a new cluster) ends where the
    # uninterrupted run ends (one worker: the order of exchanges is fixed).
    # Resumed without the replicas' backup, the worker restarts from the
    # centre with no momentum and ends elsewhere: the replicas' state is
    # what makes the two equal.
    import shutil

    import numpy as np

    whole = run_program("elastic_cases", "resume", str(tmp_path / "whole"), timeout=120)
    backup = tmp_path / "backup"
    first = run_program("elastic_cases", "resume", str(backup), "2", timeout=120)
    assert whole["epochs"] == [0, 1, 2, 3] and first["epochs"] == [0, 1]
    assert "easgd_replicas" in first["backup"]
    without = tmp_path / "without"
    shutil.copytree(backup, without)
    shutil.rmtree(without / "easgd_replicas")
    resumed = run_program("elastic_cases", "resume", str(backup), timeout=120)
    assert resumed["epochs"] == [2, 3]
    for got, expected in zip(resumed["centre"], whole["centre"]):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    restarted = run_program("elastic_cases", "resume", str(without), timeout=120)
    assert restarted["epochs"] == [2, 3]
    assert not np.allclose(restarted["centre"][0], whole["centre"][0], rtol=1e-4, atol=1e-5)


def test_backed_up_replicas_are_fitted_to_the_cluster_or_refused_naming_what_differs():
    import keras
    import numpy as np

    from tfdist_ext.downpour._elastic_backup import RESTORED
    from tfdist_ext.downpour._elastic_backup import fitted

    kernel = keras.Variable(np.zeros((2, 1), "float32"), name="kernel")
    bias = keras.Variable(np.zeros(1, "float32"), name="bias")
    saved = {  # two workers; worker 1's row is of an old generation
        "row_0": np.arange(4, dtype="float32").reshape(2, 2, 1),
        "row_1": np.array([[5.0], [6.0]], "float32"),
        "since": np.array([2, 1]),
        "valid": np.array([True, False]),
    }
    rows, since, born = fitted(saved, [kernel, bias], workers=3)
    np.testing.assert_array_equal(rows[0][:2], saved["row_0"])
    np.testing.assert_array_equal(rows[0][2], 0.0)  # a third worker starts afresh
    assert since.tolist() == [2, 1, 0] and born.tolist() == [RESTORED, -1, -1]
    rows, since, born = fitted(saved, [kernel, bias], workers=1)
    assert rows[1].shape == (1, 1) and born.tolist() == [RESTORED]
    with pytest.raises(ValueError, match="replicas of 2 variables .* have 3"):
        fitted(saved, [kernel, bias, bias], workers=2)
    wide = keras.Variable(np.zeros((3, 1), "float32"), name="kernel")
    with pytest.raises(ValueError, match=r"'kernel' has shape \(2, 1\), this model's \(3, 1\)"):
        fitted(saved, [wide, bias], workers=2)
