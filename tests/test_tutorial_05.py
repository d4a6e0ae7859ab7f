"""Runs tutorials/05_model_parallelism.py end to end in a fresh interpreter."""

import pytest

CPUS = ["/device:CPU:0", "/device:CPU:1"]


def short(device):
    return device.split("device:")[-1]


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_tutorial_05_runs(tutorial):
    r = tutorial("05_model_parallelism.py", timeout=230)
    # 1. The partitioned model trains; its plan uses both devices.
    assert r["test_accuracy"] > 0.9, r
    assert [stage["device"] for stage in r["plan"]["stages"]] == CPUS, r["plan"]
    # 2. Variables and the step's matmuls are on both devices.
    assert set(r["placement"].values()) == {"CPU:0", "CPU:1"}, r["placement"]
    ops = r["ops_per_device"]
    assert all(ops.get(short(d), {}).get("MatMul", 0) > 0 for d in CPUS), ops
    # 3. The verdict is the comparison it reports: pipelined gradients (and
    # loss) equal one device's.
    assert r["gradients_equal"] is (r["gradient_difference"] < 1e-5), r
    assert r["gradients_equal"] is True, r
    assert abs(r["pipelined_loss"] - r["one_device_loss"]) <= 1e-5 * r["one_device_loss"], r
    # 4a. The explicit map is the plan.
    explicit = r["explicit_plan"]
    assert explicit["partition"] == "explicit", explicit
    assert [stage["device"] for stage in explicit["stages"]] == CPUS, explicit
    # 4b. With splitting off, the wide layer is refused at plan time, by name;
    # by default it is split column-wise into shards that fit the budget.
    assert r["refusal"] is not None and "'wide'" in r["refusal"], r["refusal"]
    wide = r["wide_plan"]
    assert wide["splits"] == {"wide": 2} and wide["shards"] == {"wide": CPUS}, wide
    assert sum(wide["shard_bytes"]["wide"]) == 1_064_960, wide
    assert max(wide["shard_bytes"]["wide"]) <= 800_000, wide
    assert r["wide_layer"] == "ColumnParallelDense", r
    # 4c. A model over one device's budget: each layer created on its stage's
    # device, the devices filled in order, each within the budget.
    assert r["large_parameter_bytes"] == 340_008, r
    assert r["large_created_on"] == {"l1": "CPU:0", "l2": "CPU:1", "l3": "CPU:1"}, r
    large = r["large_plan"]
    assert {
        layer: short(stage["device"]) for stage in large["stages"] for layer in stage["layers"]
    } == r["large_created_on"], large
    assert max(stage["param_bytes"] for stage in large["stages"]) <= 300_000, large
    # 5. Reloaded under the strategy, the same predictions.
    assert r["reloaded_predictions_identical"] is True, r
    # 6. The engine alone plans and places a plain Keras model over both devices.
    assert [stage["device"] for stage in r["engine_plan"]["stages"]] == CPUS, r["engine_plan"]
