"""The one door into Keras/TensorFlow internals (tfdist_ext/_integration.py)."""

import os
import re

import pytest

from conftest import REPO
from tests.programs import run_program

PACKAGE = os.path.join(REPO, "tfdist_ext")
PRIVATE_IMPORT = re.compile(r"^\s*(from|import)\s+(keras\.src|tensorflow\.python)\b", re.M)


def _package_sources():
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path, encoding="utf-8") as f:
                    yield os.path.relpath(path, REPO), f.read()


def test_private_keras_and_tensorflow_imports_only_in_the_integration_module():
    offenders = [
        path
        for path, text in _package_sources()
        if PRIVATE_IMPORT.search(text) and not path.endswith("_integration.py")
    ]
    assert offenders == [], (
        f"private Keras/TensorFlow modules imported outside tfdist_ext/_integration.py: {offenders}"
    )


def test_no_os_exit_in_the_package():
    forbidden = "os." + "_exit("  # spelled apart so that this file is not an offender
    offenders = [path for path, text in _package_sources() if forbidden in text]
    assert offenders == [], f"os._exit in {offenders}"


@pytest.mark.parametrize(
    "removed, named",
    [
        (
            "keras.src.backend.tensorflow.trainer.TensorFlowTrainer._get_metrics_result_or_logs",
            "_get_metrics_result_or_logs is missing",
        ),
        (
            "keras.src.backend.tensorflow.optimizer.TFOptimizer._all_reduce_sum_gradients",
            "_all_reduce_sum_gradients is missing",
        ),
        # StateBackupAndRestore restores a strategy's own state where Keras
        # restores the model.
        (
            "keras.src.callbacks.backup_and_restore.BackupAndRestore._load_model",
            "BackupAndRestore._load_model is missing",
        ),
        # ModelParallelStrategy's extended returns its updates' local results.
        (
            "tensorflow.python.distribute.one_device_strategy.OneDeviceExtended._local_results",
            "OneDeviceExtended._local_results is missing",
        ),
        # The compressed multi-worker strategy's ring (checked last, before the raise).
        ("tensorflow.python.ops.collective_ops.all_reduce_v2", "all_reduce_v2 is missing"),
    ],
)
def test_a_renamed_keras_internal_fails_at_import_with_one_clear_message(removed, named):
    # Simulates a Keras release that renamed one of the internals we rely on:
    # loading a strategy must fail at once, naming the versions and the symbol,
    # instead of a strategy silently skipping its hook later.
    _assert_one_clear_import_error(("removed", removed), named)


def _assert_one_clear_import_error(change, named):
    """Runs ``integration_cases`` with the arguments ``change`` (a case that
    changes an internal, then loads a strategy): it must raise the one
    ImportError naming ``named`` and the tested versions."""
    error = run_program("integration_cases", *change, timeout=120)["import_error"]
    assert error is not None, "the strategy loaded"
    assert named in error
    assert "tfdist_ext does not support Keras" in error and "tested: Keras" in error


# Each change replaces a method by one that calls it, with source of its own
# (tests/programs/integration_cases.py's rewritten): as a release whose method no
# longer sets (or contains) what the package reads.
@pytest.mark.parametrize(
    "change, named",
    [
        # LinearScalingWarmup reads the rate an optimizer was given.
        (
            ("rewritten", "keras.src.optimizers.base_optimizer", "BaseOptimizer", "__init__"),
            "BaseOptimizer.__init__ no longer sets _learning_rate",
        ),
        # apply_goyal_recipe reads a functional model's graph backwards.
        (
            ("rewritten", "keras.src.ops.operation", "Operation", "__init__"),
            "Operation.__init__ no longer sets _inbound_nodes",
        ),
        (
            ("rewritten", "keras.src.ops.node", "Node", "__init__"),
            "Node.__init__ no longer contains 'tensor._keras_history = KerasHistory('",
        ),
        # ModelParallelStrategy's extended places on TensorFlow's own device.
        (
            (
                "rewritten",
                "tensorflow.python.distribute.one_device_strategy",
                "OneDeviceExtended",
                "__init__",
            ),
            "OneDeviceExtended.__init__ no longer sets _device",
        ),
        # Keras saving reads a split variable as one array.
        (("unregister_sharded",), "ShardedVariable no longer converts to one tensor"),
    ],
    ids=["learning_rate", "inbound_nodes", "keras_history", "one_device", "sharded_variable"],
)
def test_a_rewritten_internal_fails_at_import_with_one_clear_message(change, named):
    _assert_one_clear_import_error(change, named)


def test_the_doors_accessors_read_what_keras_and_tensorflow_hold():
    import keras
    import numpy as np
    import tensorflow as tf

    from tfdist_ext import _integration

    inputs = keras.Input((3,))
    dense = keras.layers.Dense(2)
    outputs = dense(inputs)
    keras.Model(inputs, outputs)
    [node] = _integration.inbound_nodes(dense)
    assert len(node.input_tensors) == 1 and node.input_tensors[0] is inputs
    assert _integration.producer(outputs) is dense
    assert _integration.producer(tf.ones([1])) is None
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    assert _integration.given_learning_rate(keras.optimizers.SGD(schedule)) is schedule
    rate = _integration.given_learning_rate(keras.optimizers.SGD(0.1))
    assert not isinstance(rate, keras.optimizers.schedules.LearningRateSchedule)
    assert float(np.asarray(rate)) == np.float32(0.1)


def test_a_split_variable_reads_as_one_array():
    import numpy as np
    import tensorflow as tf

    from tfdist_ext import _integration

    _integration.make_sharded_variables_readable()
    split = _integration.ShardedVariable([tf.Variable([[1.0, 2.0]]), tf.Variable([[3.0, 4.0]])])
    np.testing.assert_array_equal(np.asarray(split), [[1.0, 2.0], [3.0, 4.0]])
    assert np.asarray(split, dtype="float64").dtype == np.float64
    np.testing.assert_array_equal(split.numpy(), [[1.0, 2.0], [3.0, 4.0]])


def test_trainer_hooks_dispatch_to_the_strategy_and_record_the_running_model():
    import keras
    import numpy as np
    import tensorflow as tf

    from tfdist_ext import _integration

    _integration.install_trainer_hooks()
    seen = []

    class Recording(tf.distribute.OneDeviceStrategy):
        def _tfdist_evaluate(self, model, keras_evaluate, args, kwargs):
            seen.append(("evaluate", _integration.model_in_keras_call() is model))
            return keras_evaluate(model, *args, **kwargs)

    strategy = Recording("/cpu:0")
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    x, y = np.ones((4, 3), "float32"), np.ones((4, 1), "float32")
    model.evaluate(x, y, verbose=0)
    assert seen == [("evaluate", True)]
    assert _integration.model_in_keras_call() is None
    # A model under another strategy takes Keras's own path.
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    plain.compile("sgd", "mse")
    plain.evaluate(x, y, verbose=0)
    assert seen == [("evaluate", True)]


def test_overridden_step_tells_a_custom_train_step_from_keras_own():
    import keras

    from tfdist_ext import _integration

    class Custom(keras.Model):
        def train_step(self, data):
            return super().train_step(data)

    class Child(Custom):
        pass

    plain = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    assert _integration.overridden_step(plain) is None
    assert _integration.overridden_step(Child()) is Custom
    assert _integration.overridden_step(Child(), "test_step") is None


def test_keras_tensorboard_callback_works_in_the_default_install(tmp_path):
    # Issue 12 item 9: keras.callbacks.TensorBoard raised TBNotInstalledError.
    import keras
    import numpy as np

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    model.fit(
        np.ones((8, 3), "float32"),
        np.ones((8, 1), "float32"),
        epochs=1,
        verbose=0,
        callbacks=[keras.callbacks.TensorBoard(log_dir=str(tmp_path))],
    )
    written = [f for _, _, files in os.walk(tmp_path) for f in files]
    assert any(f.startswith("events.out.tfevents") for f in written), written
