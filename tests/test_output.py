"""What users see: no warnings our fit path causes, L-BFGS progress at verbose=1 only."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from test_sandblaster import PRELUDE
from test_sandblaster import _result

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
def test_lbfgs_progress_at_verbose_1_and_silence_at_verbose_0(script):
    proc = script(
        PRELUDE
        + r"""
with LocalCluster(num_workers=1, num_ps=1) as cluster:
    strategy = tfdist_ext.SandblasterStrategy(cluster.resolver)
    with strategy.scope():
        w = tf.Variable(tf.zeros([64, 10])); b = tf.Variable(tf.zeros([10]))
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
        model.compile(optimizer=tfdist_ext.optimizers.LBFGS(memory=5),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    print("SILENT-START", flush=True)
    model.fit(x, y, epochs=2, verbose=0)
    tfdist_ext.sandblaster.minimize(loss_fn, [w, b], (x, y), strategy=strategy,
                                    max_iterations=2)
    print("SILENT-END", flush=True)
    model.fit(x, y, epochs=2, verbose=1)
    w.assign(tf.zeros([64, 10])); b.assign(tf.zeros([10]))
    r = tfdist_ext.sandblaster.minimize(loss_fn, [w, b], (x, y), strategy=strategy,
                                        max_iterations=3, verbose=1)
    try:
        tfdist_ext.sandblaster.minimize(loss_fn, [w, b], (x, y), strategy=strategy, verbose=2)
        bad = None
    except ValueError as e:
        bad = str(e)
    report(loss=r.fun, bad=bad)
""",
        timeout=220,
    )
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
    assert float(lines[-1].split("loss ")[1].split()[0]) == pytest.approx(_result(proc)["loss"])
    assert "L-BFGS stopped after 3 iterations" in loud and "ITERATIONS REACHED LIMIT" in loud
    assert "verbose must be 0 (silent) or 1" in _result(proc)["bad"]
