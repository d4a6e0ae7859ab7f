"""Tutorial 1 runs as a new user would run it."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(300)
def test_tutorial_01_downpour_runs():
    proc = subprocess.run(
        [sys.executable, os.path.join("tutorials", "01_downpour.py"), "--quick"],
        cwd=REPO, capture_output=True, text=True, timeout=280, stdin=subprocess.DEVNULL,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.count("alive") == 3
    assert "Downpour (2 workers, n_fetch=n_push=2): held-out accuracy" in out
    assert "Single-process Keras, same steps" in out
    assert "Saved and reloaded outside the cluster" in out
    downpour = float(out.split("held-out accuracy ")[1].split()[0])
    assert downpour > 0.8
