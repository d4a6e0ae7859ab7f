"""Tutorial 2 runs as a new user would run it."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(300)
def test_tutorial_02_sandblaster_runs():
    proc = subprocess.run(
        [sys.executable, os.path.join("tutorials", "02_sandblaster_lbfgs.py"), "--quick"],
        cwd=REPO, capture_output=True, text=True, timeout=280, stdin=subprocess.DEVNULL,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "Sandblaster L-BFGS (2 workers, 2 ps): loss" in out
    assert "minimize, worker 1 slowed 4x" in out
    assert "Saved and reloaded outside the cluster" in out
    slowed = float(out.split("slowed 4x: loss ")[1].split()[0])
    plain = float(out.split("(unslowed ")[1].split(")")[0])
    assert abs(slowed - plain) <= 1e-5 * plain
    held_out = float(out.split("held-out accuracy ")[-1].split()[0])
    assert held_out > 0.9
