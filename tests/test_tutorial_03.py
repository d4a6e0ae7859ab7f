"""Tutorial 03 runs end to end (a fresh interpreter; about a minute)."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_tutorial_03_runs():
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "tutorials", "03_gradient_compression.py")],
        capture_output=True, text=True, timeout=360, cwd=REPO, stdin=subprocess.DEVNULL,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert "sent + residual == sum of gradients" in out
    assert "compression epoch 8:" in out
    assert "restored exactly: True" in out
    assert "DGC 99.9%: test accuracy" in out
