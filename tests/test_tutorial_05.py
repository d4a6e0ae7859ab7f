"""Runs tutorials/05_model_parallelism.py end to end in a fresh interpreter."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(240)
def test_tutorial_05_runs():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(
        [sys.executable, os.path.join("tutorials", "05_model_parallelism.py")],
        cwd=REPO, capture_output=True, text=True, timeout=230, env=env,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert "reloaded predictions identical: True" in out
    assert "largest gradient difference / largest gradient" in out
    assert "needs" in out and "ColumnParallelDense" in out  # the budget error
    assert ("wide: Dense of 1,064,960 B split automatically into 2 column shards on "
            "['/device:CPU:0', '/device:CPU:1']") in out
    assert "'wide' is now a ColumnParallelDense" in out
    accuracy = float(out.split("test accuracy ")[1].split()[0])
    assert accuracy > 0.9
