"""DownpourStrategy on a real local cluster, through Keras 3 `model.fit`.

Each test runs a case of ``tests/programs/downpour_cases.py`` in a fresh
interpreter (``run_program``): a process can connect to one TensorFlow
cluster only, and a stuck cluster must fail the test at its deadline rather
than hang the suite.
"""

import json

import numpy as np
import pytest

from tests.programs import run_program
from tfdist_ext.cluster import LocalCluster


@pytest.mark.timeout(300)
def test_fit_evaluate_predict_save_like_keras(tmp_path):
    r = run_program("downpour_cases", "fit_evaluate_predict_save", tmp_path, timeout=280)
    h = r["history"]
    assert len(h["loss"]) == 3 and h["loss"][2] < h["loss"][0]
    assert h["val_accuracy"][-1] > 0.85
    for key in (
        "staleness_mean",
        "staleness_max",
        "pushes",
        "rejected_pushes",
        "push_bytes_per_step",
        "fetch_bytes_per_step",
        "accuracy",
    ):
        assert len(h[key]) == 3, key
    assert all(0 <= m <= x for m, x in zip(h["staleness_mean"], h["staleness_max"]))
    assert h["pushes"] == [60.0, 60.0, 60.0] and h["rejected_pushes"] == [0.0] * 3
    assert r["stats"]["steps"] == 180
    assert set(r["per_worker"]) == {"0", "1"}, "both replicas must have trained"
    assert abs(r["evaluate"][1] - h["val_accuracy"][-1]) < 1e-6
    assert abs(r["predict_accuracy"] - r["evaluate"][1]) < 1e-6
    assert r["predict_shape"] == [450, 10]
    # Parameters and optimizer state live on the ps tasks; the 32 KiB kernel
    # is split across both shards, the rest are balanced by bytes.
    assert r["sharded"] == "ShardedVariable"
    assert r["sqrt_devices"] == [f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in (0, 1)], r[
        "sqrt_devices"
    ]
    assert r["copy_devices"] == r["sqrt_devices"], r["copy_devices"]
    off_ps = {k: d for k, d in r["placement"].items() if not all("/job:ps/" in x for x in d)}
    assert not off_ps, off_ps
    assert len(r["placement"]["sequential/dense/kernel"]) == 2
    small, large = sorted(r["shard_bytes"])
    assert large - small <= 4 * 1290 + 64, r["shard_bytes"]
    assert r["batches"][0][0] == 0 and r["batches"][0][1] > 0
    assert [e[0] for e in r["epochs"]] == ["epoch"] * 3
    # Both saved models (model.save, ModelCheckpoint) reload and predict the same.
    assert r["reloaded"] is True


@pytest.mark.timeout(300)
def test_n_fetch_n_push_cut_traffic_and_optimizers_run_on_server():
    r = run_program("downpour_cases", "n_fetch_n_push_traffic", timeout=280)
    for name, n, background in (
        ("Adagrad-1", 1, False),
        ("SGD-5", 5, True),
        ("Adam-4", 4, False),
        ("SGD-2", 2, True),
    ):
        run = r[name]
        assert run["loss"][1] < run["loss"][0], name
        # A push every n steps, and at the end of each epoch's first round
        # (one batch, whose logs the callbacks' first wait for) when n > 1.
        assert 80 // n <= run["pushes"] <= 80 // n + (2 if n > 1 else 0), name
        # `iterations` counts training steps (batches), as in plain Keras.
        assert run["iterations"] == 80, name
        # One fetch per n steps. With the background fetch the last of each
        # round is for the worker's next round, and each worker's first
        # round of the fit fetches once more; after the push, each block of
        # n steps (or a round's shorter last) fetches at its start and
        # pushes at its end.
        if background:
            assert 1 <= run["fresh"] <= 4, name
        else:
            assert run["fetches"] == run["pushes"], name
        assert run["push"] == pytest.approx(run["params"] * run["pushes"] / 80), name
        assert run["fetch"] == pytest.approx(run["params"] * run["fetches"] / 80), name


# The asynchronous strategies survive the same faults: the strategy (its
# name in downpour_cases.ASYNC_STRATEGIES) and the local steps each push
# (EASGD: exchange) carries.
ASYNC_STRATEGIES = [
    pytest.param("downpour", 1, id="downpour"),
    pytest.param("easgd", 2, id="easgd"),
]
# EASGD's cases of the fault tests run in the slow lane (tox -e tests-all):
# their handling is DownpourRuntime's, shared with Downpour's case, which stays.
FAULT_STRATEGIES = [
    ASYNC_STRATEGIES[0],
    pytest.param(*ASYNC_STRATEGIES[1].values, id="easgd", marks=pytest.mark.slow),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy, _steps_per_push", FAULT_STRATEGIES)
def test_killed_worker_fit_carries_on_and_restarted_worker_rejoins(strategy, _steps_per_push):
    r = run_program("downpour_cases", "killed_worker", strategy, timeout=280)
    assert r["marks"]["killed_alive"] is False
    # fit finished every epoch and every step with the surviving worker ...
    assert len(r["history"]["loss"]) == 4 and r["stats"]["steps"] == 320
    assert r["history"]["val_accuracy"][-1] > 0.85
    # ... and the restarted worker ran rounds again after it came back.
    assert r["final"]["1"] > r["marks"]["restarted"].get("1", 0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy, steps_per_push", FAULT_STRATEGIES)
@pytest.mark.slow
def test_nan_pushes_are_rejected_counted_and_reported(strategy, steps_per_push):
    # EASGD: a replica turned NaN does not exchange with the centre.
    r = run_program("downpour_cases", "nan_pushes", strategy, timeout=280)
    # A push (an exchange, for EASGD) every steps_per_push of a worker's steps.
    expected = sum(steps // steps_per_push for steps in r["per_worker"])
    assert sum(r["per_worker"]) == 30, r
    assert r["rejected"][0] > 0 and r["rejected"][0] + r["pushes"][0] == expected, r
    assert r["finite"], "server parameters must stay finite"
    assert r["warnings"] and "rejected" in r["warnings"][0]


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_warmstart_runs_first_steps_on_one_replica():
    staleness = run_program("downpour_cases", "warmstart", timeout=280)["staleness"]
    assert len(staleness) == 60
    assert staleness[:25] == [0] * 25


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_killed_ps_stops_with_clear_error_and_backup_resumes(tmp_path):
    backup = str(tmp_path / "backup")
    with LocalCluster(num_workers=2, num_ps=1) as cluster:
        # The chief runs in its own process against this cluster; with
        # KILL_PS set it kills the ps task during epoch 2.
        chief = (
            "downpour_cases",
            "killed_ps_chief",
            json.dumps(cluster.cluster_spec.as_dict()),
            cluster.pid("ps", 0),
            backup,
        )
        first = run_program(*chief, timeout=200, env={"KILL_PS": "1"})
        assert first["ok"] is False
        assert first["error"] == "ClusterError"
        assert "parameter server ps:0" in first["message"] and "unreachable" in first["message"]
        assert [e[0] for e in first["losses"]] == [0, 1]
        cluster.restart("ps", 0)
        second = run_program(*chief, timeout=200)
    assert second["ok"] is True
    # Resumed at epoch 2 from the backup (epochs 0-1 are not redone) ...
    assert [e[0] for e in second["losses"]] == [2, 3]
    # ... with the server's parameters and optimizer state restored: the
    # held-out loss is no higher than at the checkpoint.
    checkpoint_val_loss = first["losses"][-1][2]
    assert second["losses"][0][2] <= checkpoint_val_loss + 1e-6
    # The optimizer state came back too: its step counter (training steps,
    # exact at every epoch's end) continued from the backup.
    assert second["iterations"] == 200


def test_bad_cluster_and_arguments_fail_at_construction():
    import tensorflow as tf
    from tensorflow.python.distribute.cluster_resolver import SimpleClusterResolver

    import tfdist_ext
    from tfdist_ext.cluster import ClusterTimeoutError
    from tfdist_ext.cluster import free_port

    def resolver(spec):
        return SimpleClusterResolver(
            tf.train.ClusterSpec(spec), task_type="chief", task_id=0, rpc_layer="grpc"
        )

    addr = lambda: f"127.0.0.1:{free_port()}"  # noqa: E731
    with pytest.raises(ValueError, match="no 'ps' job"):
        tfdist_ext.DownpourStrategy(resolver({"chief": [addr()], "worker": [addr()]}))
    with pytest.raises(ValueError, match="no 'worker' job"):
        tfdist_ext.DownpourStrategy(resolver({"chief": [addr()], "ps": [addr()]}))
    good = {"chief": [addr()], "worker": [addr()], "ps": [addr()]}
    for kwargs, message in (
        ({"n_fetch": 0}, "n_fetch"),
        ({"n_push": 1.5}, "n_push"),
        ({"warmstart_steps": -1}, "warmstart_steps"),
        ({"deadline": 0}, "deadline"),
        ({"model_devices": "/device:CPU:0"}, "model_devices"),
        ({"model_devices": []}, "model_devices"),
        ({"compression": "zip"}, "unknown compressor"),
        ({"background_fetch": "no"}, "background_fetch"),
    ):
        with pytest.raises(ValueError, match=message):
            tfdist_ext.DownpourStrategy(resolver(good), **kwargs)
    # Nothing listens at these addresses: a clear error within the deadline.
    with pytest.raises(ClusterTimeoutError, match="did not answer"):
        tfdist_ext.DownpourStrategy(resolver(good), deadline=2)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_compressed_pushes_send_the_wire_form():
    r = run_program("downpour_cases", "compressed_pushes", timeout=280)
    # TopK(0.05) sends 5% of the entries as float32 values + int32 indices.
    assert all(0.08 * r["dense"] <= p <= 0.12 * r["dense"] for p in r["push"]), r
    assert r["val"][-1] > 0.85
    # The server-side rebuild is on the ps task; the worker's own scatter
    # (device unset, the worker's) is error feedback computing its residual.
    assert "/job:ps/replica:0/task:0/device:CPU:0" in r["scatters"], r["scatters"]
    assert all(d in ("", "/job:ps/replica:0/task:0/device:CPU:0") for d in r["scatters"])


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_each_replica_is_a_partitioned_model():
    r = run_program("downpour_cases", "partitioned_replicas", timeout=280)
    # Each backward matmul runs on its layer's stage device (d(input) of d1 is
    # not needed: 2 per layer but d1's one).
    assert len(r["backward"]) == 7, r["backward"]
    for name, device in r["backward"]:
        (layer,) = [p.split("_")[0] for p in name.split("/") if p.split("_")[0] in r["plan"]]
        assert device.endswith(r["plan"][layer]), (name, device)
    # It trains (asynchronous, so the exact value varies from run to run:
    # 0.81 after 120 steps was seen once, 0.76 after 180 once; chance is 0.1).
    assert r["val"][-1] > 0.6, r["val"]
    assert set(r["plan"].values()) == {"/device:CPU:0", "/device:CPU:1"}
    assert r["plan"]["d1"] == "/device:CPU:0" and r["plan"]["d4"] == "/device:CPU:1"
    # Forward and backward matmuls of the replica run on both of its devices ...
    assert {d for d in r["matmuls"] if d.endswith("CPU:0")} and {
        d for d in r["matmuls"] if d.endswith("CPU:1")
    }, r["matmuls"]
    # ... while the parameters stay on the parameter server.
    assert r["variables"] == ["/job:ps/replica:0/task:0/device:CPU:0"]


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_linear_scaling_schedule_and_warmup_callback_under_downpour():
    r = run_program("downpour_cases", "linear_scaling", timeout=280)
    # The schedule runs on the server with the optimizer: after warm-up the
    # rate is k * base = 2 * 0.05.
    assert r["rate_at_end"] == pytest.approx(r["expected"]) == pytest.approx(0.1)
    assert r["loss1"][1] < r["loss1"][0]
    # The callback ramps the server's rate during epoch 0 and leaves k * base.
    assert r["rates"][-1] == pytest.approx(0.1)
    assert r["loss2"][1] < r["loss2"][0]


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_split_variable_is_updated_piece_by_piece_on_its_ps_tasks():
    # A weight split across 2 ps tasks: an elementwise optimizer updates each
    # piece on its own task (the gradient's piece crosses, nothing else), and
    # the result equals Keras's update of the whole weight in one process;
    # a layer-wise optimizer (Lamb) keeps the whole-variable update.
    r = run_program("split_variable_updates", timeout=280)
    for name, error in r["errors"].items():
        assert error <= 1e-6, (name, r["errors"])
    ps0, ps1 = (f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in (0, 1))
    # Where the update's arithmetic on the kernel's pieces is placed in the
    # traced push: on both ps tasks (each piece's on its own task), nowhere
    # else; Lamb, whose norms span the pieces, has no piece-wise arithmetic.
    for name, counts in r["devices"].items():
        if name == "lamb":
            assert not counts, counts
        else:
            assert counts.get(ps0) and counts.get(ps1), (name, counts)
            assert set(counts) == {ps0, ps1}, (name, counts)


@pytest.mark.timeout(300)
def test_two_strategies_on_one_cluster_both_keep_their_models():
    # Issue 38, item 6: a notebook compares two settings on one cluster. Both
    # models train and evaluate, and leaving the cluster brings both models'
    # final parameters back (the first strategy's close must not cut the
    # second one's connection).
    r = run_program("downpour_cases", "two_strategies", timeout=280)
    np.testing.assert_allclose(r["after"], r["before"], rtol=1e-5)
    assert all(accuracy > 0.5 for _, accuracy in r["after"]), r


@pytest.mark.timeout(200)
def test_a_push_of_n_steps_is_one_sgd_step_of_n_times_the_rate():
    # n_fetch = n_push = 4, one worker, one round: the 4 gradients are taken
    # on the same fetched parameters and summed, so plain SGD moves as one
    # step of rate 4 * lr on the 4 batches' mean gradient, not as 4 steps.
    result = run_program("push_sum", 4, timeout=180)
    assert result["pushes"] == 1
    assert result["to_one_step_of_k_lr"] <= 1e-6 * max(1.0, result["moved"])
    assert result["to_k_sequential_steps"] > 100 * result["to_one_step_of_k_lr"] + 1e-6


@pytest.mark.timeout(200)
def test_without_background_fetch_one_worker_takes_keras_sgd_steps():
    # One worker, n_fetch = n_push = 1, plain SGD. Each fetch follows the
    # worker's own push: the run is Keras's sequential steps, exactly. The
    # background fetch computes each step (but the first) without the last.
    r = run_program("fetch_order", timeout=180)
    assert r["after_push"] == {"to_sequential": 0.0, "staleness": [0] * 8}, r
    assert r["background"]["staleness"] == [0] + [1] * 7, r
    assert r["background"]["to_sequential"] > 1e-2 * r["moved"], r


@pytest.mark.timeout(200)
@pytest.mark.slow
def test_a_dataset_made_before_the_strategy_is_named_as_the_cause():
    """TensorFlow's own error ("... CPU:0 unknown device") does not say that the
    dataset belongs to the runtime the strategy's connection replaced."""
    kind, message = run_program("downpour_cases", "dataset_before_strategy", timeout=180)["error"]
    assert kind == "InvalidArgumentError"
    assert "was created before the strategy connected this process" in message
    assert "Build the strategy first" in message
