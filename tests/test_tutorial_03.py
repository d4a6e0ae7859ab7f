"""Tutorial 03 runs end to end (a fresh interpreter; about a minute)."""

import pytest


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_tutorial_03_runs(tutorial):
    out = tutorial("03_gradient_compression.py", timeout=360)
    assert "sent + residual == sum of gradients" in out
    assert "compression epoch 12:" in out
    assert "restored exactly: True" in out
    assert "DGC 99.9%: test accuracy" in out
    verdict = out.rstrip().splitlines()[-1]
    assert verdict.startswith("VERDICT: DGC 99.9% within 0.5 points of dense: yes"), verdict
