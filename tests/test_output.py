"""What users see: no warnings our fit path causes, L-BFGS progress at verbose=1 only."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.programs import result_of
from tests.programs import run_program
from tfdist_ext import compression as C


def _fit_warnings(strategy, **fit_kwargs):
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(
            keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(data, epochs=2, verbose=0, **fit_kwargs)
    return [str(w.message) for w in caught if "shuffle" in str(w.message)]


@pytest.mark.timeout(120)
def test_fit_on_a_dataset_under_our_strategy_does_not_warn_about_shuffle(cpu_devices):
    strategy = C.CompressedMirroredStrategy(cpu_devices[:2], compression=C.TopK(0.5))
    assert _fit_warnings(strategy) == []
    # shuffle passed explicitly: Keras's own warning, as without tfdist_ext.
    warned = _fit_warnings(strategy, shuffle=True)
    assert len(warned) == 1 and "`shuffle=True` was passed" in warned[0], warned


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_lbfgs_progress_at_verbose_1_and_silence_at_verbose_0():
    # What is checked is the whole stdout, a user's view of the run, beside its RESULT.
    proc = run_program("sandblaster_cases", "progress", timeout=220, expect_ok=False)
    result = result_of(proc.stdout)
    assert proc.returncode == 0 and result, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    silent = out.split("SILENT-START\n")[1].split("SILENT-END")[0]
    assert silent == "", silent
    loud = out.split("SILENT-END\n")[1]
    # fit: Keras's progress bar, one epoch per L-BFGS iteration, with the gradient.
    assert "Epoch 1/2" in loud and "Epoch 2/2" in loud, loud
    assert "loss:" in loud and "grad_max:" in loud, loud
    # minimize: a line per iteration (iteration, loss, max|g|, passes, seconds), then the stop.
    lines = [l for l in loud.splitlines() if l.startswith("L-BFGS iteration")]
    assert [int(l.split()[2].rstrip(":")) for l in lines] == [1, 2, 3], loud
    assert all("max|g|" in l and "passes" in l and l.endswith(" s") for l in lines), lines
    assert float(lines[-1].split("loss ")[1].split()[0]) == pytest.approx(result["loss"])
    assert "L-BFGS stopped after 3 iterations" in loud and "ITERATIONS REACHED LIMIT" in loud
    assert "verbose must be 0 (silent) or 1" in result["bad"]
