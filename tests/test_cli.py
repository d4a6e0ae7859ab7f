"""The `tfdist-ext` command line and the main job."""

import os
import subprocess
import sys

import pytest


def _run(*args, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "tfdist_ext.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )


def test_usage_and_unknown_command():
    assert _run("--help").returncode == 0
    proc = _run("frobnicate")
    assert proc.returncode == 2 and "unknown command 'frobnicate'" in proc.stderr
    assert _run().returncode == 2


@pytest.mark.timeout(400)
def test_demo_runs_and_reports_accuracy():
    proc = _run("demo", "--quick", timeout=380)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for task in ("worker:0", "worker:1", "ps:0"):
        assert f"{task}" in out and "alive" in out
    assert "held-out accuracy" in out
    assert "why Downpour is slower here" in out and "python -m benchmarks.run downpour" in out
    assert "what this shows" in out and "staleness mean" in out
    # Quiet: neither TensorFlow's start-up notices nor Keras's shuffle warning.
    for noise in ("absl::InitializeLog", "oneDNN custom operations", "shuffle=True"):
        assert noise not in proc.stderr, proc.stderr[-3000:]
