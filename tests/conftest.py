"""Shared test set-up.

TensorFlow's logical device split is fixed once per process, so the suite
splits the CPU into 4 logical devices before any test touches TensorFlow;
tests that need k <= 4 devices take ``cpu_devices[:k]``. Tests that need a
cluster or a fresh TensorFlow runtime run their body in a subprocess (see
``run_script``), always with a deadline.
"""

import os
import subprocess
import sys
import textwrap

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
NUM_LOGICAL_CPUS = 4
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    from tfdist_ext.cluster import logical_cpus

    logical_cpus(NUM_LOGICAL_CPUS)


@pytest.fixture(scope="session")
def cpu_devices():
    """Names of the 4 logical CPU devices of this test process."""
    return [f"/device:CPU:{i}" for i in range(NUM_LOGICAL_CPUS)]


def run_script(source, *, timeout=240, env=None, expect_ok=True):
    """Runs Python ``source`` in a fresh interpreter with a deadline.

    Returns the ``CompletedProcess`` (text stdout/stderr). A script that runs
    past ``timeout`` is killed and the test fails with its output so far.
    """
    full_env = dict(os.environ)
    full_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    full_env.update(env or {})
    try:
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(source)],
            capture_output=True, text=True, timeout=timeout, env=full_env,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(
            f"script did not finish within {timeout}s\nstdout:\n{e.stdout}\n"
            f"stderr:\n{e.stderr}"
        )
    if expect_ok and proc.returncode != 0:
        pytest.fail(
            f"script exited with {proc.returncode}\nstdout:\n{proc.stdout[-5000:]}\n"
            f"stderr:\n{_quiet(proc.stderr)[-8000:]}"
        )
    return proc


_NOISE = ("E0000", "W0000", "I0000", "Additional GRPC", ":UNKNOWN:", "This could happen",
          "WARNING: All log")


def _quiet(stderr):
    """stderr without TensorFlow's gRPC teardown chatter."""
    return "\n".join(l for l in stderr.splitlines() if not l.startswith(_NOISE))


@pytest.fixture
def script():
    """The ``run_script`` helper as a fixture."""
    return run_script


def run_tutorial(filename, *args, timeout):
    """Runs ``tutorials/FILENAME`` as a user would: from the repository root, in a
    fresh interpreter, with a deadline. Returns its stdout; a non-zero exit
    fails the test with the end of its stderr."""
    proc = subprocess.run(
        [sys.executable, os.path.join("tutorials", filename), *args],
        cwd=REPO, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    assert proc.returncode == 0, _quiet(proc.stderr)[-4000:]
    return proc.stdout


@pytest.fixture
def tutorial():
    """The ``run_tutorial`` helper as a fixture."""
    return run_tutorial
