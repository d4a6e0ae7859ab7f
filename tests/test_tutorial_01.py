"""Tutorial 1 runs as a new user would run it."""

import pytest


# Under tests-all with tutorials 2, 3, 4 and 6 (20-25 s here): the README's
# Downpour block, `tfdist-ext demo` (tests/test_cli.py) and tests/test_downpour.py
# (fit, evaluate, predict, save and load, a killed worker) keep that API in
# the default suite.
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tutorial_01_downpour_runs(tutorial):
    out = tutorial("01_downpour.py", "--quick", timeout=280)
    assert out.count("alive") == 3
    assert "Downpour (2 workers, n_fetch=n_push=2): held-out accuracy" in out
    assert "Single-process Keras, same steps" in out
    assert "Saved and reloaded outside the cluster" in out
    downpour = float(out.split("held-out accuracy ")[1].split()[0])
    assert downpour > 0.8
    keras_accuracy = float(out.split("Single-process Keras, same steps:")[1].split()[2])
    verdict = out.rstrip().splitlines()[-1]
    close = "yes" if downpour >= keras_accuracy - 0.02 else "no"
    assert verdict.startswith(
        "VERDICT: Downpour within 2 points of single-process Keras at "
        f"the same steps: {close} (quick run"
    ), verdict
    # The quick run is asynchronous and short (3 x 80 steps): Downpour got
    # 0.900-0.949 against Keras's 0.949 in 6 runs (4 of them more than 2
    # points behind, before and after the 2026-11-24 changes); the verdict
    # reports which, and this bounds how far behind.
    assert downpour >= keras_accuracy - 0.08, (downpour, keras_accuracy)
    assert "python -m benchmarks.run downpour_throughput" in verdict
