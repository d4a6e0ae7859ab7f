"""Tutorial 1 runs as a new user would run it."""

import pytest


@pytest.mark.timeout(300)
def test_tutorial_01_downpour_runs(tutorial):
    out = tutorial("01_downpour.py", "--quick", timeout=280)
    assert out.count("alive") == 3
    assert "Downpour (2 workers, n_fetch=n_push=2): held-out accuracy" in out
    assert "Single-process Keras, same steps" in out
    assert "Saved and reloaded outside the cluster" in out
    downpour = float(out.split("held-out accuracy ")[1].split()[0])
    assert downpour > 0.8
    verdict = out.rstrip().splitlines()[-1]
    assert verdict.startswith(
        "VERDICT: Downpour within 2 points of single-process Keras at "
        "the same steps: yes (quick run"
    ), verdict
    assert "python -m benchmarks.run downpour" in verdict
