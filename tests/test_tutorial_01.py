"""Tutorial 1 runs as a new user would run it."""

import pytest


# Under tests-all with tutorials 2, 3, 4 and 6 (20-25 s here): the README's
# Downpour block, `tfdist-ext demo` (tests/test_cli.py) and tests/test_downpour.py
# (fit, evaluate, predict, save and load, a killed worker) keep that API in
# the default suite.
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tutorial_01_downpour_runs(tutorial):
    r = tutorial("01_downpour.py", "--quick", timeout=280)
    assert r["tasks_alive"] == ["ps:0", "worker:0", "worker:1"], r
    downpour, keras_accuracy = r["downpour_accuracy"], r["keras_accuracy"]
    assert downpour > 0.8, r
    # The verdict is the comparison it reports.
    assert r["within_2_points"] is (downpour >= keras_accuracy - 0.02), r
    # The quick run is asynchronous and short (3 x 80 steps): Downpour got
    # 0.900-0.949 against Keras's 0.949 in 6 runs (4 of them more than 2
    # points behind, before and after the 2026-11-24 changes); the verdict
    # reports which, and this bounds how far behind.
    assert downpour >= keras_accuracy - 0.08, r
    # Saved and reloaded outside the cluster, the same model: the same digits
    # right (1e-3 is under one of the 450 test digits).
    assert abs(r["reloaded_accuracy"] - downpour) < 1e-3, r
    # Both workers trained, and every step of fit was run once, by one of them.
    per_worker = r["steps_per_worker"]
    assert set(per_worker) == {"0", "1"} and min(per_worker.values()) > 0, r
    assert sum(per_worker.values()) == r["fit_steps"] == 3 * 80, r
