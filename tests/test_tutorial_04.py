"""tutorials/04_large_batch.py runs end to end (its --quick size)."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tutorial_04_runs_quick():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(
        [sys.executable, os.path.join("tutorials", "04_large_batch.py"), "--quick"],
        cwd=REPO, capture_output=True, text=True, timeout=280, env=env,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert "k=8 (batch 128, rate 0.02 -> 0.16" in out
    assert "replicas 2, global batch 128 (k = 8)" in out
    assert "schedule LinearScaling, BN IndependentBatchNormalization(virtual_batch_size=16), " \
           "same predictions: True" in out
    assert out.rstrip().endswith("done")
