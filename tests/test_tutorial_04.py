"""tutorials/04_large_batch.py runs end to end (its --quick size)."""

import pytest


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tutorial_04_runs_quick(tutorial):
    out = tutorial("04_large_batch.py", "--quick", timeout=280)
    assert "k=8 (batch 128, rate 0.02 -> 0.16" in out
    assert "replicas 2, global batch 128 (k = 8)" in out
    assert (
        "schedule LinearScaling, BN IndependentBatchNormalization(virtual_batch_size=16), "
        "same predictions: True" in out
    )
    verdict = out.rstrip().splitlines()[-1]
    assert verdict.startswith("VERDICT: k = 8 within 1 point of k = 1"), verdict
    assert "needs the full run" in verdict and "python -m benchmarks.run large_batch" in verdict
