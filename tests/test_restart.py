"""State that survives a restart (issue 41): Keras's own BackupAndRestore.

A run interrupted at an epoch boundary and resumed -- a new model, optimizer
and callbacks, as a fresh process builds them -- through
``keras.callbacks.BackupAndRestore`` ends with the uninterrupted run's
weights, for the methods whose state lives in the optimizer or is derived
from it: LARS's momenta and the warm-up callback's position in its ramp
(with momentum correction at the first resumed step). The compressors'
state under a compressed strategy is checked in
``test_compression_strategy.py``
(``test_keras_backup_and_restore_resumes_the_compressor_state``).
"""

import keras
import numpy as np
import pytest

from tfdist_ext import datasets
from tfdist_ext.callbacks import LinearScalingWarmup
from tfdist_ext.optimizers import LARS

EPOCHS, BATCH = 4, 32


class _Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2:
            raise RuntimeError("simulated preemption")


def _lars():
    return LARS(learning_rate=1.0, momentum=0.9, weight_decay=1e-4, eta=0.01), []


def _warmup():
    # k = 32 / 8: the rate ramps from 0.02 to 0.08 over 3 of the 4 epochs,
    # so the interruption falls inside the ramp.
    callback = LinearScalingWarmup(
        0.02, 8, batch_size=BATCH, warmup_epochs=3, momentum_correction=True
    )
    return keras.optimizers.SGD(0.02, momentum=0.9), [callback]


def _fit(method, callbacks=()):
    x, y = datasets.digits("train", flatten=True, as_numpy=True)
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)]
    )
    optimizer, own = method()
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(
        x[:256],
        y[:256],
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[*callbacks, *own],
    )
    return model


@pytest.mark.parametrize("method", [_lars, _warmup], ids=["lars", "warmup_callback"])
def test_resumed_run_ends_with_the_uninterrupted_runs_weights(tmp_path, method):
    straight = _fit(method)
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="simulated preemption"):
        _fit(method, [keras.callbacks.BackupAndRestore(backup), _Interrupt()])
    resumed = _fit(method, [keras.callbacks.BackupAndRestore(backup)])
    assert int(resumed.optimizer.iterations.numpy()) == EPOCHS * 256 // BATCH
    for a, b in zip(straight.get_weights(), resumed.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
