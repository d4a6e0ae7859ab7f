"""ModelParallelStrategy: plans, real placement, pipelined gradients, Keras workflow."""

import contextlib
import itertools
import os
import warnings

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.programs import result_of  # noqa: E402
from tests.programs import run_program  # noqa: E402
from tfdist_ext import datasets  # noqa: E402
from tfdist_ext.model_parallel import ColumnParallelDense  # noqa: E402
from tfdist_ext.model_parallel import ModelParallelStrategy  # noqa: E402
from tfdist_ext.model_parallel import apply_plan  # noqa: E402
from tfdist_ext.model_parallel import layer_costs  # noqa: E402
from tfdist_ext.model_parallel import microbatch_gradients  # noqa: E402
from tfdist_ext.model_parallel import placement_report  # noqa: E402
from tfdist_ext.model_parallel import plan_partition  # noqa: E402
from tfdist_ext.model_parallel import stage_gradients  # noqa: E402
from tfdist_ext.model_parallel._placement import same_device  # noqa: E402

pytestmark = pytest.mark.timeout(120)

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def mlp(widths=(64, 48, 32, 16), inputs=20, classes=10, reg=None):
    layers = [keras.Input((inputs,))]
    for w in widths:
        layers.append(keras.layers.Dense(w, activation="relu", kernel_regularizer=reg))
    layers.append(keras.layers.Dense(classes))
    return keras.Sequential(layers)


def cnn():
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(8, 3, activation="relu", padding="same"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(16, 3, activation="relu", padding="same"),
            keras.layers.Flatten(),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def digits(n=256, flatten=True):
    x, y = datasets.digits("train", flatten=flatten, as_numpy=True)
    if not flatten and x.ndim == 3:
        x = x[..., None]
    return x[:n], y[:n]


def built(strategy, make, **compile_kwargs):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = make()
        model.compile(
            optimizer=compile_kwargs.pop("optimizer", keras.optimizers.SGD(0.05)),
            loss=LOSS,
            **compile_kwargs,
        )
    return model


def planned_device(plan, variable_path):
    return plan.device_of(variable_path.split("/")[-2])


@contextlib.contextmanager
def creations():
    """Every tf.Variable created inside, as created (TensorFlow's own creator
    hook: it sees the variable the strategy's creator made, where it made it)."""
    log = []

    def record(next_creator, **kwargs):
        variable = next_creator(**kwargs)
        log.append(variable)
        return variable

    with tf.variable_creator_scope(record):
        yield log


def assert_created_on_their_stages(log, model, plan):
    """Each variable of each stage was created on the stage's device and is
    still the variable created then (never re-created elsewhere)."""
    created = {id(v): v.device for v in log}
    optimizer = getattr(model, "optimizer", None)
    optimizer = optimizer.variables if optimizer is not None else []
    alive = {id(v.value) for v in [*model.variables, *model.metrics_variables, *optimizer]}
    replaced = [v.name for v in log if id(v) not in alive]
    assert not replaced, f"variables re-created elsewhere after they were built: {replaced}"
    for layer in model.layers:
        for w in layer.weights:
            assert id(w.value) in created, f"{w.path} was re-created after it was built"
            assert same_device(created[id(w.value)], plan.device_of(layer.name)), w.path


# --- plans -------------------------------------------------------------------


def brute_force_bottleneck(weights, k):
    n = len(weights)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = [0, *cuts, n]
        best = min(best, max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


@pytest.mark.parametrize("k", [2, 3, 4])
def test_balanced_plan_is_contiguous_complete_and_optimal(cpu_devices, k):
    model = mlp(widths=(64, 128, 32, 96, 16, 48))
    plan = plan_partition(model, cpu_devices[:k])
    names = [layer.name for layer in model.layers]
    assert [n for s in plan.stages for n in s.layers] == names
    assert [s.device for s in plan.stages] == cpu_devices[:k]
    costs = layer_costs(model)
    assert sum(c.param_bytes for c in costs) == plan.total_param_bytes == 4 * model.count_params()
    assert max(plan.device_param_bytes.values()) == brute_force_bottleneck(
        [c.param_bytes for c in costs], k
    )


def test_plan_reports_flops_and_boundary_bytes(cpu_devices):
    model = mlp(widths=(64, 32), inputs=20)
    plan = plan_partition(model, cpu_devices[:2], balance_by="flops")
    flops = {c.name: c.flops for c in layer_costs(model)}
    assert flops[model.layers[0].name] == 2 * 20 * 64
    assert sum(s.flops for s in plan.stages) == sum(flops.values())
    first = plan.stages[0]
    assert first.boundary_bytes == 4 * model.get_layer(first.layers[-1]).output.shape[-1]
    assert "parameter bytes" in str(plan) and plan.to_dict()["stages"][0]["layers"]


def test_balanced_plan_cuts_at_the_smallest_activation(cpu_devices):
    # Conv, pool, flatten: the pool/flatten have no parameters, so any cut
    # among them keeps the same balance; the planner picks the smallest tensor.
    model = keras.Sequential(
        [
            keras.Input((16, 16, 1)),
            keras.layers.Conv2D(16, 3, padding="same"),
            keras.layers.MaxPooling2D(4),
            keras.layers.Flatten(),
            keras.layers.Dense(8),
        ]
    )
    plan = plan_partition(model, cpu_devices[:2])  # the Dense is the bottleneck
    assert plan.stages[0].layers[-1] in (model.layers[1].name, model.layers[2].name)
    assert plan.stages[0].boundary_bytes == 4 * 4 * 4 * 16


def test_cut_bytes_count_every_tensor_crossing_the_cut(cpu_devices):
    inputs = keras.Input((4,))
    a = keras.layers.Dense(8, name="a")(inputs)
    b = keras.layers.Dense(8, name="b")(a)
    c = keras.layers.Concatenate(name="c")([keras.layers.Add(name="skip")([a, b]), inputs])
    model = keras.Model(inputs, keras.layers.Dense(2, name="out")(c))
    assert [layer.name for layer in model.layers[1:]] == ["a", "b", "skip", "c", "out"]
    # after a: a (and the input, read by c); after b: a, b, input; after skip:
    # its sum, input; after c: c; after out: the output
    assert [cost.activation_bytes for cost in layer_costs(model)] == [
        32 + 16,
        32 + 32 + 16,
        32 + 16,
        48,
        8,
    ]
    plan = plan_partition(
        model,
        cpu_devices[:2],
        {"a": cpu_devices[0], "b": cpu_devices[0], "skip": cpu_devices[1], "out": cpu_devices[1]},
    )
    assert plan.stages[0].boundary_bytes == 32 + 32 + 16


# --- placement -----------------------------------------------------------------


def test_fit_places_every_variable_on_its_planned_device(cpu_devices):
    strategy = ModelParallelStrategy(cpu_devices[:4])
    model = built(strategy, mlp, optimizer=keras.optimizers.SGD(0.05, momentum=0.9))
    x, y = digits(flatten=True)
    model2 = model  # the strategy finds the model when fit starts
    x = x[:, :20]
    history = model2.fit(x, y, batch_size=32, epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    plan = strategy.plan
    assert len({s.device for s in plan.stages}) == 4
    for path, device in placement_report(model).items():
        assert same_device(device, planned_device(plan, path)), path
    by_id = {id(v.value): v for v in model.trainable_variables}
    slots = [v for v in model.optimizer.variables if "momentum" in v.path]
    assert len(slots) == len(by_id)
    for slot, var in zip(slots, model.trainable_variables):
        assert same_device(slot.value.device, var.value.device), slot.path


def test_explicit_partition_places_variables_when_created(cpu_devices):
    partition = {"a": cpu_devices[1], "b": cpu_devices[2], "c": cpu_devices[2]}
    strategy = ModelParallelStrategy(cpu_devices[:3], partition=partition)
    with strategy.scope(), creations() as log:
        model = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(5, name="a"),
                keras.layers.Dropout(0.1, name="drop"),
                keras.layers.Dense(4, name="b"),
                keras.layers.Dense(3, name="c"),
            ]
        )
    for layer in model.layers:  # before any placement pass
        for v in layer.weights:
            assert same_device(v.value.device, partition[layer.name]), v.path
    strategy.place(model)
    assert strategy.plan.layer_devices == {
        "a": cpu_devices[1],
        "drop": cpu_devices[1],
        "b": cpu_devices[2],
        "c": cpu_devices[2],
    }
    assert_created_on_their_stages(log, model, strategy.plan)


def _step_graph(strategy, model, batch_shape):
    model.optimizer.build(model.trainable_variables)

    @tf.function
    def step(x, y):
        return strategy.run(model.train_step, args=((x, y),))

    spec_x = tf.TensorSpec((None, *batch_shape), tf.float32)
    return step.get_concrete_function(spec_x, tf.TensorSpec((None,), tf.int32)).graph


@pytest.mark.parametrize("microbatches", [1, 3])
def test_forward_backward_and_update_ops_run_on_planned_devices(cpu_devices, microbatches):
    strategy = ModelParallelStrategy(cpu_devices[:2], microbatches=microbatches)
    model = built(strategy, lambda: mlp(widths=(16, 16, 16)))
    strategy.place(model)
    graph = _step_graph(strategy, model, (20,))
    ops = graph.get_operations()
    unplaced_ok = {"Placeholder", "ReadVariableOp", "NoOp", "Identity", "Const"}
    for op in ops:
        if op.type not in unplaced_ok:
            assert any(same_device(op.device, d) for d in cpu_devices[:2]), (op.name, op.type)
    dense_per_device = {d: 0 for d in cpu_devices[:2]}
    for stage in strategy.plan.stages:
        dense_per_device[stage.device] += len(stage.layers)
    for device, n_dense in dense_per_device.items():
        matmuls = [op for op in ops if op.type == "MatMul" and same_device(op.device, device)]
        first = device == strategy.plan.stages[0].device
        # forward, d(input) and d(kernel) for every Dense layer and micro-batch,
        # except d(input) of the model's first layer (the input is not watched)
        assert len(matmuls) == (3 * n_dense - first) * microbatches, device
        updates = [
            op
            for op in ops
            if op.type == "ResourceApplyGradientDescent"
            or (op.type == "AssignSubVariableOp" and same_device(op.device, device))
        ]
        assert len([u for u in updates if same_device(u.device, device)]) == 2 * n_dense


def _executed_on(lines, op_types):
    """Devices (``CPU:i``) from TensorFlow's 'Executing op T in device D' log lines."""
    out = []
    for line in lines:
        if "Executing op " in line:
            words = line.split()
            op = words[words.index("op") + 1]
            if op in op_types:
                out.append(words[-1][-5:])
    return sorted(out)


def test_executed_ops_run_on_planned_devices():
    """TensorFlow's own placement log of the ops a (run_eagerly) fit executes."""
    # Its stderr is what is checked: the log between the program's START and END.
    proc = run_program(
        "model_parallel_cases",
        "placement_log",
        timeout=120,
        env={"TF_CPP_MIN_LOG_LEVEL": "0"},
        expect_ok=False,
    )
    assert proc.returncode == 0 and result_of(proc.stdout), proc.stderr[-8000:]
    text = proc.stderr
    lines = text[text.index("START") : text.index("END")].splitlines()
    # first: forward + d(kernel); second: forward + d(input) + d(kernel)
    assert _executed_on(lines, {"MatMul", "_MklMatMul"}) == ["CPU:0"] * 2 + ["CPU:1"] * 3
    # SGD updates of kernel and bias, each on its variable's device
    assert _executed_on(lines, {"AssignSubVariableOp"}) == ["CPU:0"] * 2 + ["CPU:1"] * 2


# --- numerics ----------------------------------------------------------------


def reference_loss_and_grads(model, x, y):
    keras.utils.set_random_seed(0)
    clone = keras.models.clone_model(model)
    clone.set_weights(model.get_weights())
    clone.compile(optimizer="sgd", loss=LOSS)
    with tf.device("/device:CPU:0"):
        with tf.GradientTape() as tape:
            pred = clone(x, training=True)
            loss = clone._compute_loss(x=x, y=y, y_pred=pred, training=True)
        grads = tape.gradient(loss, clone.trainable_variables)
    return float(loss), [tf.convert_to_tensor(g).numpy() for g in grads]


@pytest.mark.parametrize(
    "make,flatten,microbatches,n",
    [
        (lambda: mlp(inputs=64, reg=keras.regularizers.L2(1e-3)), True, 1, 64),
        (lambda: mlp(inputs=64, reg=keras.regularizers.L2(1e-3)), True, 4, 64),
        (lambda: mlp(inputs=64), True, 4, 30),  # uneven micro-batches
        (lambda: mlp(inputs=64, reg=keras.regularizers.L2(1e-3)), True, 4, 3),  # one empty
        (cnn, False, 4, 32),
    ],
)
def test_pipelined_loss_and_gradients_match_single_device(
    cpu_devices, make, flatten, microbatches, n
):
    strategy = ModelParallelStrategy(cpu_devices[:2], microbatches=microbatches)
    model = built(strategy, make)
    strategy.place(model)
    x, y = digits(n, flatten=flatten)
    fn = tf.function(lambda x, y: microbatch_gradients(model, strategy.plan, (x, y), microbatches))
    loss, _, grads = fn(tf.constant(x), tf.constant(y))
    ref_loss, ref_grads = reference_loss_and_grads(model, x, y)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    assert len(grads) == len(ref_grads)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g.numpy(), r, rtol=1e-4, atol=1e-6)


def test_pipelined_training_follows_the_unpipelined_trajectory(cpu_devices):
    x, y = digits(128)
    weights = {}
    for m in (1, 4):
        strategy = ModelParallelStrategy(cpu_devices[:2], microbatches=m)
        model = built(
            strategy, lambda: mlp(inputs=64), optimizer=keras.optimizers.SGD(0.1, momentum=0.9)
        )
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        weights[m] = model.get_weights()
    for a, b in zip(weights[1], weights[4]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_a_loss_added_in_call_is_trained_or_refused(cpu_devices):
    # ActivityRegularization adds its loss in call() (add_loss), inside a
    # stage's tape: one step must equal plain Keras's (its gradient was
    # dropped), and micro-batches, which cannot split it, refuse it.
    def make():
        return keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.ActivityRegularization(l2=0.05, name="act_reg"),
                keras.layers.Dense(10),
            ]
        )

    x, y = digits(64)
    data = tf.data.Dataset.from_tensors((x, y)).repeat()
    keras.utils.set_random_seed(0)
    plain = make()
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS)
    start = plain.get_weights()
    expected = plain.fit(data, epochs=1, steps_per_epoch=1, verbose=0).history["loss"]
    for microbatches in (1, 4):
        strategy = ModelParallelStrategy(cpu_devices[:2], microbatches=microbatches)
        model = built(strategy, make, optimizer=keras.optimizers.SGD(0.1))
        model.set_weights(start)
        if microbatches > 1:
            with pytest.raises(ValueError, match="act_reg add a loss in call"):
                model.fit(data, epochs=1, steps_per_epoch=1, verbose=0)
            for a, b in zip(model.get_weights(), start):
                np.testing.assert_array_equal(a, b)
            continue
        loss = model.fit(data, epochs=1, steps_per_epoch=1, verbose=0).history["loss"]
        np.testing.assert_allclose(loss, expected, rtol=1e-6)
        for a, b in zip(model.get_weights(), plain.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


# --- Keras workflow -----------------------------------------------------------


def test_fit_evaluate_predict_save_load(cpu_devices, tmp_path):
    strategy = ModelParallelStrategy(cpu_devices[:2], microbatches=2)
    model = built(strategy, cnn, metrics=["accuracy"], optimizer=keras.optimizers.Adam(0.01))
    x, y = digits(256, flatten=False)
    model.fit(x, y, batch_size=32, epochs=3, verbose=0)
    loss, acc = model.evaluate(x, y, verbose=0)
    assert acc > 0.5
    pred = model.predict(x[:16], verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    other = ModelParallelStrategy(cpu_devices[2:4])
    with other.scope():
        loaded = keras.models.load_model(path)
    np.testing.assert_allclose(loaded.predict(x[:16], verbose=0), pred, rtol=1e-5, atol=1e-5)
    assert loaded.evaluate(x, y, verbose=0)[0] == pytest.approx(loss, rel=1e-5)
    for path_, device in placement_report(loaded).items():
        assert same_device(device, planned_device(other.plan, path_)), path_
    assert {s.device for s in other.plan.stages} == set(cpu_devices[2:4])
    loaded.fit(x, y, batch_size=32, epochs=1, verbose=0)  # restored optimizer moved too


def test_functional_branching_model_trains(cpu_devices):
    inputs = keras.Input((64,))
    a = keras.layers.Dense(32, activation="relu", name="a")(inputs)
    b = keras.layers.Dense(32, activation="relu", name="b")(inputs)
    out = keras.layers.Dense(10, name="out")(keras.layers.Concatenate(name="cat")([a, b]))
    strategy = ModelParallelStrategy(cpu_devices[:2])
    with strategy.scope():
        model = keras.Model(inputs, out)
        model.compile("adam", LOSS)
    x, y = digits(64)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    for path, device in placement_report(model).items():
        assert same_device(device, planned_device(strategy.plan, path))


def test_apply_plan_on_a_plain_keras_model(cpu_devices):
    """The engine other strategies use: plan + apply on a model built anywhere."""
    keras.utils.set_random_seed(0)
    model = mlp(inputs=64)
    plan = plan_partition(model, cpu_devices[1:3])
    apply_plan(model, plan)
    for path, device in placement_report(model).items():
        assert same_device(device, planned_device(plan, path))

    @tf.function
    def forward(x):
        return model(x)

    graph = forward.get_concrete_function(tf.TensorSpec((None, 64))).graph
    matmul_devices = [op.device for op in graph.get_operations() if op.type == "MatMul"]
    assert len(matmul_devices) == len(model.layers)
    for stage in plan.stages:
        assert sum(same_device(d, stage.device) for d in matmul_devices) == len(stage.layers)
    model.compile("sgd", LOSS)
    x, y = digits(64)
    model.fit(x, y, epochs=1, verbose=0)


# --- column split ---------------------------------------------------------------


def test_column_parallel_dense_matches_dense_and_places_shards(cpu_devices, tmp_path):
    strategy = ModelParallelStrategy(cpu_devices[:3], partition="balanced")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((64,)),
                ColumnParallelDense(96, num_shards=3, activation="relu", name="wide"),
                keras.layers.Dense(10, name="head"),
                keras.layers.Dense(10, name="head2"),
            ]
        )
        model.compile("sgd", LOSS)
    strategy.place(model)
    wide = model.get_layer("wide")
    for shard, device in zip(wide.shard_variables(), cpu_devices[:3]):
        for v in shard:
            assert same_device(v.value.device, device), v.path
    assert strategy.plan.shard_devices["wide"] == tuple(cpu_devices[:3])
    x, _ = digits(8)
    kernel = np.concatenate([k.numpy() for k in wide.kernels], axis=1)
    bias = np.concatenate([b.numpy() for b in wide.biases])
    np.testing.assert_allclose(
        wide(x).numpy(), np.maximum(x @ kernel + bias, 0), rtol=1e-5, atol=1e-5
    )
    graph = tf.function(wide).get_concrete_function(tf.TensorSpec((None, 64))).graph
    devices = sorted(op.device[-5:] for op in graph.get_operations() if op.type == "MatMul")
    assert devices == sorted(d[-5:] for d in cpu_devices[:3])
    config = wide.get_config()
    clone = ColumnParallelDense.from_config(config)
    assert clone.units == 96 and clone.num_shards == 3
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-5, atol=1e-5
    )


# --- errors -------------------------------------------------------------------------


def test_construction_errors(cpu_devices):
    with pytest.raises(ValueError, match="does not exist"):
        ModelParallelStrategy(["/device:CPU:0", "/device:CPU:99"])
    with pytest.raises(ValueError, match="distinct"):
        ModelParallelStrategy([cpu_devices[0], cpu_devices[0]])
    with pytest.raises(ValueError, match="non-empty list"):
        ModelParallelStrategy([])
    with pytest.raises(ValueError, match="microbatches"):
        ModelParallelStrategy(cpu_devices[:2], microbatches=0)
    with pytest.raises(ValueError, match="partition"):
        ModelParallelStrategy(cpu_devices[:2], partition="random")
    with pytest.raises(ValueError, match="not in devices"):
        ModelParallelStrategy(cpu_devices[:2], partition={"a": cpu_devices[3]})
    with pytest.raises(ValueError, match="balance_by"):
        ModelParallelStrategy(cpu_devices[:2], balance_by="time")
    with pytest.raises(ValueError, match="num_shards"):
        ColumnParallelDense(4, num_shards=5)
    with pytest.raises(ValueError, match="split_large_layers"):
        ModelParallelStrategy(cpu_devices[:2], split_large_layers="yes")
    with pytest.raises(ValueError, match="device_budget_bytes"):
        ModelParallelStrategy(cpu_devices[:2], device_budget_bytes=0)


def test_planning_errors(cpu_devices):
    model = mlp(widths=(8,))  # two layers
    with pytest.raises(ValueError, match="cannot make 3 stages from the 2 layer"):
        ModelParallelStrategy(cpu_devices[:3]).make_plan(model)
    big = keras.Sequential(
        [keras.Input((256,)), keras.layers.Dense(256, name="big"), keras.layers.Dense(4)]
    )
    with pytest.raises(
        ValueError, match="'big' needs 263,168 parameter bytes.*ColumnParallelDense"
    ):
        plan_partition(big, cpu_devices[:4], device_budget_bytes=200_000, split_large_layers=False)
    with pytest.raises(ValueError, match="does not have"):
        plan_partition(model, cpu_devices[:2], {"nope": cpu_devices[0]})
    with pytest.raises(ValueError, match="does not place the layers with parameters"):
        plan_partition(model, cpu_devices[:2], {model.layers[0].name: cpu_devices[0]})
    three = mlp(widths=(8, 8))
    names = [l.name for l in three.layers]
    with pytest.raises(ValueError, match="contiguous"):
        plan_partition(
            three,
            cpu_devices[:2],
            {names[0]: cpu_devices[0], names[1]: cpu_devices[1], names[2]: cpu_devices[0]},
        )
    with pytest.raises(ValueError, match="not built"):
        plan_partition(keras.Sequential([keras.layers.Dense(3)]), cpu_devices[:2])


# --- automatic column split of a Dense over the device budget ---------------------

BIG_BYTES = (32 * 300 + 300) * 4  # the "big" Dense of wide_model: 39,600 B


def wide_model(reg=None):
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(32, activation="relu", name="a"),
            keras.layers.Dense(300, activation="relu", name="big", kernel_regularizer=reg),
            keras.layers.Dense(10, name="head"),
        ]
    )


def test_plan_splits_a_dense_over_the_budget(cpu_devices):
    model = wide_model()
    # 2 shards of 19,800 B fit a 30,000 B budget next to "a" (8,320 B).
    plan = plan_partition(model, cpu_devices[:3], device_budget_bytes=30_000)
    assert plan.splits == {"big": 2}
    assert plan.shard_bytes["big"] == (BIG_BYTES // 2,) * 2
    assert len(set(plan.shard_devices["big"])) == 2
    assert plan.total_param_bytes == 4 * model.count_params()
    assert max(plan.device_param_bytes.values()) <= 30_000
    assert "split automatically into 2 column shards" in str(plan)
    assert plan.to_dict()["splits"] == {"big": 2}
    # At 26,000 B two shards fit alone but not next to "a": the plan takes 3.
    plan = plan_partition(model, cpu_devices[:3], device_budget_bytes=26_000)
    assert plan.splits == {"big": 3}
    assert plan.shard_devices["big"] == tuple(cpu_devices[:3])
    assert max(plan.device_param_bytes.values()) <= 26_000
    # Without a budget, or under it, nothing is split.
    assert plan_partition(model, cpu_devices[:3]).splits == {}
    assert plan_partition(model, cpu_devices[:3], device_budget_bytes=40_000).splits == {}


def test_plan_errors_for_layers_that_cannot_fit(cpu_devices):
    model = wide_model()
    with pytest.raises(
        ValueError,
        match=r"'big' needs 39,600 parameter bytes on one device, "
        r"more than the device budget of 30,000 bytes, and "
        r"split_large_layers is off",
    ):
        plan_partition(model, cpu_devices[:3], device_budget_bytes=30_000, split_large_layers=False)
    with pytest.raises(
        ValueError,
        match=r"'big' needs 39,600 .* over all 3 devices its "
        r"largest shard would still need 13,200 bytes",
    ):
        plan_partition(model, cpu_devices[:3], device_budget_bytes=10_000)
    with pytest.raises(
        ValueError,
        match="the balanced plan puts .* more than the device "
        "budget of 16,000 bytes; 'big' is split into 3",
    ):
        plan_partition(model, cpu_devices[:3], device_budget_bytes=16_000)
    with pytest.raises(
        ValueError, match="cannot be split automatically: it has a kernel regularizer"
    ):
        plan_partition(
            wide_model(reg=keras.regularizers.L2(1e-3)), cpu_devices[:3], device_budget_bytes=30_000
        )
    conv = keras.Sequential(
        [
            keras.Input((8, 8, 64)),
            keras.layers.Conv2D(64, 3, name="conv"),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ]
    )
    with pytest.raises(ValueError, match="'conv' needs 147,712 .* it is a Conv2D"):
        plan_partition(conv, cpu_devices[:3], device_budget_bytes=100_000)
    inputs = keras.Input((64,))
    functional = keras.Model(inputs, keras.layers.Dense(300, name="big")(inputs))
    with pytest.raises(ValueError, match="not a Sequential model.*ColumnParallelDense"):
        plan_partition(functional, cpu_devices[:2], device_budget_bytes=30_000)
    # Through the strategy the error comes when fit places the model, before any step.
    strategy = ModelParallelStrategy(
        cpu_devices[:3], device_budget_bytes=30_000, split_large_layers=False
    )
    model = built(strategy, wide_model)
    x, y = digits(32)
    with pytest.raises(ValueError, match="'big' needs 39,600 parameter bytes"):
        model.fit(x, y, epochs=1, verbose=0)
    assert not model.optimizer.built


def merged_shard_grads(model, grads):
    """Gradients of ``model`` with each ColumnParallelDense's shards concatenated."""
    out, i = [], 0
    for layer in model.layers:
        n = len(layer.trainable_weights)
        mine = [g.numpy() for g in grads[i : i + n]]
        i += n
        if isinstance(layer, ColumnParallelDense):
            out += [np.concatenate(mine[0::2], axis=1), np.concatenate(mine[1::2])]
        else:
            out += mine
    return out


@pytest.mark.parametrize("microbatches", [1, 2])
def test_strategy_splits_a_large_dense_automatically(cpu_devices, tmp_path, microbatches):
    strategy = ModelParallelStrategy(
        cpu_devices[:3], device_budget_bytes=30_000, microbatches=microbatches
    )
    model = built(strategy, wide_model)
    reference = keras.models.clone_model(model)  # the unsplit Dense, same weights
    reference.set_weights(model.get_weights())
    reference.compile(optimizer="sgd", loss=LOSS)
    strategy.place(model)
    plan = strategy.plan
    big = model.get_layer("big")
    assert isinstance(big, ColumnParallelDense) and big.num_shards == 2
    # Variables really live on the planned devices: shards on theirs, the rest
    # on their stage's.
    for shard, device in zip(big.shard_variables(), plan.shard_devices["big"]):
        for v in shard:
            assert same_device(v.value.device, device), v.path
    for layer in (model.get_layer("a"), model.get_layer("head")):
        for v in layer.weights:
            assert same_device(v.value.device, plan.device_of(layer.name)), v.path
    # Numerics equal the unsplit Dense: forward and gradients.
    x, y = digits(24)
    np.testing.assert_allclose(model(x).numpy(), reference(x).numpy(), rtol=1e-5, atol=1e-6)
    fn = tf.function(lambda a, b: microbatch_gradients(model, plan, (a, b), microbatches))
    loss, _, grads = fn(tf.constant(x), tf.constant(y))
    ref_loss, ref_grads = reference_loss_and_grads(reference, x, y)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    for g, r in zip(merged_shard_grads(model, grads), ref_grads):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)
    # Forward and backward matmuls of each shard (x @ K_i, dy_i @ K_i^T,
    # x^T @ dy_i) run on the shard's device, in every micro-batch.
    graph = _step_graph(strategy, model, (64,))
    shard_matmuls = {}
    for op in graph.get_operations():
        if op.type == "MatMul" and _layer_of(op, {"big"}) == "big":
            key = op.device[-5:]
            shard_matmuls[key] = shard_matmuls.get(key, 0) + 1
    assert shard_matmuls == {d[-5:]: 3 * microbatches for d in plan.shard_devices["big"]}
    if microbatches == 1:
        return
    # Training, save and load.
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    pred = model.predict(x, verbose=0)
    path = str(tmp_path / "split.keras")
    model.save(path)
    other = ModelParallelStrategy(cpu_devices[1:4], device_budget_bytes=30_000)
    with other.scope():
        loaded = keras.models.load_model(path)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), pred, rtol=1e-5, atol=1e-6)
    loaded_big = loaded.get_layer("big")
    for shard, device in zip(loaded_big.shard_variables(), other.plan.shard_devices["big"]):
        for v in shard:
            assert same_device(v.value.device, device), v.path
    assert set(other.plan.shard_devices["big"]) <= set(cpu_devices[1:4])
    loaded.fit(x, y, batch_size=8, epochs=1, verbose=0)  # restored optimizer state
    plain = keras.models.load_model(path)  # no strategy: still the same function
    np.testing.assert_allclose(plain.predict(x, verbose=0), pred, rtol=1e-5, atol=1e-6)


# --- backward placement without placing variables (the Downpour combination) ------


def _gradient_ops(graph, types=("MatMul", "BiasAddGrad", "ReluGrad")):
    return [
        op
        for op in graph.get_operations()
        if op.type in types and op.name.startswith("gradient_tape/")
    ]


def _layer_of(op, names):
    for part in op.name.split("/"):
        base = part.rsplit("_", 1)[0] if part.rsplit("_", 1)[-1].isdigit() else part
        if part in names or base in names:
            return part if part in names else base
    return None


@pytest.mark.parametrize("scoped", [False, True])
def test_backward_ops_follow_stages_when_variables_stay_put(cpu_devices, scoped):
    """``apply_plan(place_variables=False)`` + a Downpour-style step: parameters are
    read into tensors, the model runs in a StatelessScope, one tape.gradient call."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((20,)),
            keras.layers.Dense(16, activation="relu", name="l0"),
            keras.layers.Dense(16, activation="relu", name="l1"),
            keras.layers.Dense(16, activation="relu", name="l2"),
            keras.layers.Dense(10, name="l3"),
        ]
    )
    model.compile("sgd", LOSS)
    before = placement_report(model)
    plan = plan_partition(model, cpu_devices[1:3])
    apply_plan(model, plan, place_variables=False)
    assert placement_report(model) == before  # variables stayed where they were
    trainable = model.trainable_variables

    @tf.function
    def step(x, y):
        params = [tf.identity(v.value) for v in trainable]
        with tf.GradientTape() as tape:
            tape.watch(params)
            with keras.StatelessScope(state_mapping=list(zip(trainable, params))):
                loss = model._compute_loss(x=x, y=y, y_pred=model(x, training=True), training=True)
        if scoped:
            with stage_gradients():
                return tape.gradient(loss, params)
        return tape.gradient(loss, params)

    graph = step.get_concrete_function(
        tf.TensorSpec((None, 20)), tf.TensorSpec((None,), tf.int32)
    ).graph
    ops = _gradient_ops(graph)
    names = set(plan.layer_devices)
    assert len(ops) == 2 * 4 - 1 + 4 + 3  # d(kernel), d(input) but the first's, biases, relus
    if not scoped:
        # What TensorFlow does by itself: every backward op is unplaced, so it
        # runs on the function's default device, not on its stage's.
        assert {op.device for op in ops} == {""}
        return
    for op in ops:
        assert same_device(op.device, plan.device_of(_layer_of(op, names))), (op.name, op.device)


def test_backward_ops_follow_stages_in_an_unpipelined_keras_step(cpu_devices):
    """A non-chain model trains with Keras' own train_step (one tape.gradient)."""
    inputs = keras.Input((64,))
    a = keras.layers.Dense(32, activation="relu", name="a")(inputs)
    b = keras.layers.Dense(32, activation="relu", name="b")(inputs)
    out = keras.layers.Dense(10, name="out")(keras.layers.Concatenate(name="cat")([a, b]))
    strategy = ModelParallelStrategy(cpu_devices[:2])
    with strategy.scope():
        model = keras.Model(inputs, out)
        model.compile("sgd", LOSS)
    strategy.place(model)
    ops = _gradient_ops(_step_graph(strategy, model, (64,)))
    names = set(strategy.plan.layer_devices)
    assert len({op.device for op in ops}) == 2
    for op in ops:
        assert same_device(op.device, strategy.plan.device_of(_layer_of(op, names))), op.name


# --- real Keras programs (issue 12, item 7) -------------------------------------


def test_a_model_larger_than_one_device_is_built_on_its_stages_and_trains(cpu_devices):
    budget = 20_000  # bytes per device; each Dense(64) below needs 16,640
    strategy = ModelParallelStrategy(cpu_devices, device_budget_bytes=budget)
    keras.utils.set_random_seed(0)
    with strategy.scope(), creations() as log:
        model = mlp(widths=(64, 64, 64), inputs=64)
    assert 4 * model.count_params() > 2 * budget
    model_variables = {id(w.value) for w in model.weights}
    assert {id(v) for v in log} == model_variables  # nothing else, nothing twice
    with strategy.scope():
        model.compile(keras.optimizers.SGD(0.05), LOSS)
    x, y = digits(256)
    history = model.fit(x, y, batch_size=32, epochs=3, verbose=0)
    plan = strategy.plan
    assert_created_on_their_stages(log, model, plan)
    assert plan.partition == "filled" and len(plan.stages) >= 3
    assert max(plan.device_param_bytes.values()) <= budget
    assert {id(w.value) for w in model.weights} == model_variables  # none moved in fit
    assert history.history["loss"][-1] < history.history["loss"][0]


class Tower(keras.Model):
    """A subclassed model without an Input: Keras builds it inside fit."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d1 = keras.layers.Dense(48, activation="relu", name="d1")
        self.d2 = keras.layers.Dense(32, activation="relu", name="d2")
        self.head = keras.layers.Dense(10, name="head")

    def call(self, x):
        return self.head(self.d2(self.d1(x)))


def test_subclassed_model_built_inside_fit_is_created_and_run_on_its_stages(cpu_devices):
    strategy = ModelParallelStrategy(cpu_devices[:2])
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = Tower()
        model.compile(keras.optimizers.SGD(0.1), LOSS)
    assert not model.built
    x, y = digits(256)
    with creations() as log:
        history = model.fit(x, y, batch_size=32, epochs=3, verbose=0)
    plan = strategy.plan
    assert plan.layer_devices == {
        "d1": cpu_devices[0],
        "d2": cpu_devices[1],
        "head": cpu_devices[1],
    }
    assert_created_on_their_stages(log, model, plan)
    assert history.history["loss"][-1] < history.history["loss"][0]
    # Forward and backward matmuls of each sub-layer run on its stage's device.
    ops = [op for op in _step_graph(strategy, model, (64,)).get_operations() if op.type == "MatMul"]
    assert len(ops) == 3 * 3 - 1
    for op in ops:
        assert same_device(op.device, plan.device_of(_layer_of(op, set(plan.layer_devices)))), (
            op.name
        )
    assert model.evaluate(x, y, verbose=0) < history.history["loss"][0]
    assert model.predict(x[:4], verbose=0).shape == (4, 10)


def test_subclassed_model_with_microbatches_evaluates_predicts_and_refuses_fit(cpu_devices):
    strategy = ModelParallelStrategy(cpu_devices[:2], microbatches=2)
    with strategy.scope():
        model = Tower()
        model.compile("sgd", LOSS)
    x, y = digits(64)
    assert np.isfinite(model.evaluate(x, y, verbose=0))
    assert model.predict(x[:4], verbose=0).shape == (4, 10)
    weights = [w.numpy() for w in model.weights]
    for train in (lambda: model.fit(x, y, epochs=1, verbose=0), lambda: model.train_on_batch(x, y)):
        with pytest.raises(
            ValueError,
            match="microbatches=2 cannot train model .* is a subclassed model .* microbatches=1",
        ):
            train()
    assert model.train_function is None  # refused before anything ran
    for w, before in zip(model.weights, weights):
        np.testing.assert_array_equal(w.numpy(), before)


def branching_model():
    """Branches from the input, a skip connection over two stages, a concat."""
    inputs = keras.Input((64,))
    h1 = keras.layers.Dense(32, activation="relu", name="h1")(inputs)
    h2 = keras.layers.Dense(32, activation="tanh", name="h2")(h1)
    h3 = keras.layers.Dense(32, activation="relu", name="h3")(h2)
    side = keras.layers.Dense(16, activation="relu", name="side")(inputs)
    skip = keras.layers.Add(name="skip")([h1, h3])
    joined = keras.ops.concatenate([skip, side], axis=-1)  # an op, not a layer
    return keras.Model(inputs, keras.layers.Dense(10, name="out")(joined))


def two_input_model():
    a, b = keras.Input((40,), name="a"), keras.Input((24,), name="b")
    ha = keras.layers.Dense(32, activation="relu", name="ha")(a)
    hb = keras.layers.Dense(32, activation="relu", name="hb")(b)
    h = keras.layers.Dense(32, activation="relu", name="h")(
        keras.layers.Concatenate(name="cat")([ha, hb])
    )
    return keras.Model(
        [a, b], keras.layers.Dense(10, name="out")(keras.layers.Add(name="skip")([h, ha]))
    )


@pytest.mark.parametrize("make,split_inputs", [(branching_model, False), (two_input_model, True)])
@pytest.mark.parametrize("microbatches", [1, 3])
def test_pipelined_gradients_of_branching_functional_models_match(
    cpu_devices, make, split_inputs, microbatches
):
    from tfdist_ext.model_parallel import _pipeline

    strategy = ModelParallelStrategy(cpu_devices[:3], microbatches=microbatches)
    model = built(strategy, make)
    strategy.place(model)
    x, y = digits(32)
    if split_inputs:
        x = [x[:, :40], x[:, 40:]]
    fn = tf.function(lambda x, y: microbatch_gradients(model, strategy.plan, (x, y), microbatches))
    loss, _, grads = fn(tf.nest.map_structure(tf.constant, x), tf.constant(y))
    ref_loss, ref_grads = reference_loss_and_grads(model, x, y)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    assert len(grads) == len(ref_grads)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g.numpy(), r, rtol=1e-4, atol=1e-6)
    stages, _, _ = _pipeline._stages(model, strategy.plan)
    assert len(stages) == 3
    assert any(len(stage.inputs) > 1 for stage in stages)  # several tensors cross a cut


@pytest.mark.parametrize("microbatches", [1, 2])
def test_keras_masks_cross_stage_cuts(cpu_devices, microbatches):
    """Embedding(mask_zero=True) on one stage, the masked pooling on the next."""
    partition = {"emb": cpu_devices[0], "pool": cpu_devices[1], "out": cpu_devices[1]}
    strategy = ModelParallelStrategy(cpu_devices[:2], partition, microbatches=microbatches)
    model = built(
        strategy,
        lambda: keras.Sequential(
            [
                keras.Input((10,), dtype="int32"),
                keras.layers.Embedding(50, 8, mask_zero=True, name="emb"),
                keras.layers.GlobalAveragePooling1D(name="pool"),
                keras.layers.Dense(10, name="out"),
            ]
        ),
    )
    strategy.place(model)
    rng = np.random.default_rng(0)
    x = rng.integers(1, 50, (16, 10)).astype("int32")
    x[:, 6:] = 0  # padding the mask hides
    y = rng.integers(0, 10, 16).astype("int32")
    fn = tf.function(lambda a, b: microbatch_gradients(model, strategy.plan, (a, b), microbatches))
    loss, _, grads = fn(tf.constant(x), tf.constant(y))
    ref_loss, ref_grads = reference_loss_and_grads(model, x, y)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g.numpy(), r, rtol=1e-4, atol=1e-6)


def test_branching_functional_model_fits_evaluates_predicts_with_microbatches(cpu_devices):
    x, y = digits(128)
    weights = {}
    for m in (1, 4):
        strategy = ModelParallelStrategy(cpu_devices[:3], microbatches=m)
        model = built(strategy, branching_model, metrics=["accuracy"])
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        weights[m] = model.get_weights()
        loss, _ = model.evaluate(x, y, verbose=0)
        assert np.isfinite(loss)
        assert model.predict(x[:5], verbose=0).shape == (5, 10)
    for a, b in zip(weights[1], weights[4]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


class CountingSequential(keras.Sequential):
    """A user's own train_step with its own loss and a step counter."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps_run = keras.Variable(0, dtype="int64", trainable=False, name="steps_run")

    def train_step(self, data):
        x, y = data
        self.steps_run.assign_add(1)
        with tf.GradientTape() as tape:
            loss = LOSS(y, self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"my_loss": loss}


@pytest.mark.parametrize("microbatches", [1, 2])
def test_a_custom_train_step_runs(cpu_devices, microbatches):
    strategy = ModelParallelStrategy(cpu_devices[:2], microbatches=microbatches)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = CountingSequential(
            [keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)]
        )
        model.compile(keras.optimizers.SGD(0.1))
    x, y = digits(128)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, y, batch_size=32, epochs=3, verbose=0)
    mine = [w for w in caught if "overrides train_step" in str(w.message)]
    assert len(mine) == (microbatches > 1)
    assert int(model.steps_run.numpy()) == 3 * 4
    assert history.history["my_loss"][-1] < history.history["my_loss"][0]
    for path, device in placement_report(model).items():
        if path != "steps_run":
            assert same_device(device, planned_device(strategy.plan, path)), path


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize(
    "entry", ["fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch"]
)
def test_any_keras_entry_point_places_the_model(cpu_devices, entry, lazy):
    """The first Keras call of a model places it, whichever it is; a model built
    by that call (no Input) is created on its stages."""
    strategy = ModelParallelStrategy(cpu_devices[:2])
    model = built(strategy, Tower if lazy else lambda: mlp(widths=(32,), inputs=64))
    x, y = digits(32)
    call = getattr(model, entry)
    with creations() as log:
        if entry.startswith("predict"):
            call(x)
        elif entry == "fit":
            call(x, y, verbose=0)
        else:
            call(x, y)
    assert strategy.plan is not None and len(strategy.plan.stages) == 2
    for path, device in placement_report(model).items():
        assert same_device(device, planned_device(strategy.plan, path)), path
    if lazy:
        assert_created_on_their_stages(log, model, strategy.plan)
    assert model.predict(x[:4], verbose=0).shape == (4, 10)


def shared_layer_model():
    """One Dense applied twice in a row, then again after a later stage's layer."""
    inputs = keras.Input((64,))
    shared = keras.layers.Dense(64, activation="relu", name="shared")
    mid = keras.layers.Dense(64, activation="tanh", name="mid")(shared(shared(inputs)))
    return keras.Model(inputs, keras.layers.Dense(10, name="out")(shared(mid)))


@pytest.mark.parametrize("microbatches", [1, 3])
def test_a_shared_layer_trains_like_plain_keras(cpu_devices, microbatches):
    # Three stages, one layer each: the last call of 'shared' (stage 0) reads
    # what 'mid' made on stage 1.
    strategy = ModelParallelStrategy(cpu_devices[:3], microbatches=microbatches)
    model = built(strategy, shared_layer_model, optimizer=keras.optimizers.SGD(0.1))
    strategy.place(model)
    assert [s.layers for s in strategy.plan.stages] == [("shared",), ("mid",), ("out",)]
    x, y = digits(64)
    fn = tf.function(lambda a, b: microbatch_gradients(model, strategy.plan, (a, b), microbatches))
    loss, _, grads = fn(tf.constant(x), tf.constant(y))
    ref_loss, ref_grads = reference_loss_and_grads(model, x, y)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g.numpy(), r, rtol=1e-4, atol=1e-6)
    keras.utils.set_random_seed(0)
    plain = shared_layer_model()
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS)
    plain.set_weights(model.get_weights())
    plain.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    for path, device in placement_report(model).items():
        assert same_device(device, planned_device(strategy.plan, path)), path


@pytest.mark.parametrize(
    "optimizer",
    [lambda: keras.optimizers.SGD(0.1), lambda: keras.optimizers.Adam(0.01)],
    ids=["sgd", "adam_with_slots"],
)
def test_a_model_built_outside_the_scope_is_refused_or_trained_in_the_scope(cpu_devices, optimizer):
    x, y = digits(64)
    keras.utils.set_random_seed(0)
    plain = mlp(inputs=64)
    plain.compile(optimizer=optimizer(), loss=LOSS)
    start = plain.get_weights()
    plain.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    strategy = ModelParallelStrategy(cpu_devices[:2], microbatches=2)
    model = mlp(inputs=64)  # built before the scope
    model.set_weights(start)
    with strategy.scope():
        model.compile(optimizer=optimizer(), loss=LOSS)
    with pytest.raises(
        ValueError, match=r"built outside strategy\.scope\(\).*Build the model inside"
    ):
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), start):  # refused before any step ran
        np.testing.assert_array_equal(a, b)
    with strategy.scope():  # what the message says to do
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert len(strategy.plan.stages) == 2
    for path, device in placement_report(model).items():
        assert same_device(device, planned_device(strategy.plan, path)), path


def batch_norm_model(trainable=True):
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(32, name="d"),
            keras.layers.BatchNormalization(name="bn", trainable=trainable),
            keras.layers.Activation("relu", name="relu"),
            keras.Sequential(
                [keras.layers.BatchNormalization(name="inner_bn", trainable=trainable)],
                name="block",
            ),
            keras.layers.Dense(10, name="out"),
        ]
    )


def fit_like_plain_keras(strategy, make, x, y):
    """Fits ``make()`` under ``strategy`` and in plain Keras from the same
    weights; asserts the weights (moving statistics included) end equal."""
    keras.utils.set_random_seed(0)
    plain = make()
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS)
    model = built(strategy, make, optimizer=keras.optimizers.SGD(0.1))
    model.set_weights(plain.get_weights())
    plain.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_batch_normalization_is_refused_with_microbatches_and_trains_with_one(cpu_devices):
    x, y = digits(128)
    strategy = ModelParallelStrategy(cpu_devices[:2], microbatches=4)
    model = built(strategy, batch_norm_model)
    weights = model.get_weights()
    for train in (lambda: model.fit(x, y, epochs=1, verbose=0), lambda: model.train_on_batch(x, y)):
        with pytest.raises(
            ValueError,
            match=r"microbatches=4 cannot train .*'bn' \(BatchNormalization\), "
            r"'inner_bn' .*microbatches=1.*LayerNormalization or GroupNormalization",
        ):
            train()
    assert model.train_function is None  # refused before anything ran
    for a, b in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(a, b)
    fit_like_plain_keras(ModelParallelStrategy(cpu_devices[:2]), batch_norm_model, x, y)


def test_frozen_batch_normalization_trains_with_microbatches(cpu_devices):
    # trainable=False: the layer normalizes with its moving statistics, per example.
    x, y = digits(128)
    strategy = ModelParallelStrategy(cpu_devices[:2], microbatches=4)
    fit_like_plain_keras(strategy, lambda: batch_norm_model(trainable=False), x, y)
