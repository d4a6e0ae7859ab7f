"""Shared test set-up.

TensorFlow's logical device split is fixed once per process, so the suite
splits the CPU into 4 logical devices before any test touches TensorFlow;
tests that need k <= 4 devices take ``cpu_devices[:k]``. Tests that need a
cluster or a fresh TensorFlow runtime run a program of ``tests/programs`` in
a fresh interpreter (``tests.programs.run_program``), always with a
deadline. The run gets its own temporary directory (``TMPDIR``) and fails if
it leaves ``tfdist-ext*`` entries there.
"""

import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
NUM_LOGICAL_CPUS = 4
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    from tfdist_ext.cluster import logical_cpus

    _use_private_temp_dir(config)
    logical_cpus(NUM_LOGICAL_CPUS)


def _use_private_temp_dir(config):
    """The run (and every process it starts) gets its own temporary directory,
    so that what it leaves there is its own, not another run's on this machine."""
    directory = tempfile.mkdtemp(prefix="tests-temp-")
    os.environ["TMPDIR"] = directory
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    config.stash[_TEMP_DIR] = directory


_TEMP_DIR = pytest.StashKey[str]()


def pytest_sessionfinish(session, exitstatus):
    """Fails the run if it left ``tfdist-ext*`` entries in the temporary directory."""
    directory = session.config.stash.get(_TEMP_DIR, None)
    if directory is None:
        return
    left = sorted(e for e in os.listdir(directory) if e.startswith("tfdist-ext"))
    if not left:
        shutil.rmtree(directory, ignore_errors=True)
        return
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
    message = (
        f"FAILED: the run left {len(left)} tfdist-ext entries in its temporary "
        f"directory {directory}: {', '.join(left[:10])}"
    )
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_line(message, red=True)
    else:
        print(message, file=sys.stderr)


# -- the fast lane: pytest -m "not cluster" ----------------------------------------
#
# A test that starts processes (a cluster, a program, the CLI, a tutorial) is a
# `cluster` test. It is marked at collection when its body, or a function of its
# module that it calls, names one of these; and a test left unmarked that starts
# a process anyway fails, so the fast lane stays fast and the rule stays true.
_STARTS_PROCESSES = re.compile(
    r"\b(run_script|script|run_program|run_workers|run_tutorial|tutorial|LocalCluster"
    r"|subprocess|Popen|_runs|run_in_process)\b"
)
_SPAWNED = []  # the current test's process starts (audit events)


def _spawns(function, module, seen=None):
    """Whether ``function``, or a function or class of ``module`` it names (its
    fixtures included), starts processes."""
    seen = set() if seen is None else seen
    if function in seen:
        return False
    seen.add(function)
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return False
    if _STARTS_PROCESSES.search(source):
        return True
    names = set(re.findall(r"\b([A-Za-z_]\w*)\b", source))
    helpers = (getattr(module, n, None) for n in names)
    return any(
        (inspect.isfunction(h) or inspect.isclass(h))
        and h.__module__ == module.__name__
        and _spawns(h, module, seen)
        for h in helpers
    )


def pytest_collection_modifyitems(config, items):
    for item in items:
        function = getattr(item, "function", None)
        fixtures = (getattr(item.module, n, None) for n in getattr(item, "fixturenames", ()))
        fixtures = [getattr(f, "__wrapped__", f) for f in fixtures if f is not None]
        if function is not None and (
            _spawns(function, item.module)
            or any(inspect.isfunction(f) and _spawns(f, item.module) for f in fixtures)
        ):
            item.add_marker(pytest.mark.cluster)


def _audit(event, args):
    if event == "subprocess.Popen":
        _SPAWNED.append(args[1] if len(args) > 1 else args)


sys.addaudithook(_audit)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    del _SPAWNED[:]
    yield
    if _SPAWNED and item.get_closest_marker("cluster") is None:
        pytest.fail(
            f"{item.nodeid} started a process ({_SPAWNED[0]!r}) but is not a cluster "
            "test: mark it @pytest.mark.cluster (tests/conftest.py explains the lanes)"
        )


@pytest.fixture(scope="session")
def cpu_devices():
    """Names of the 4 logical CPU devices of this test process."""
    return [f"/device:CPU:{i}" for i in range(NUM_LOGICAL_CPUS)]


def assert_added_loss_trained(result, margin=0.05):
    """What a strategy reported for a model with a layer's add_loss is plain
    Keras's loss, that term (larger than ``margin``) included.

    ``margin`` keeps the comparison telling: the term must be well above the
    agreement's tolerance (1e-4 of the loss, about 2e-4 here).
    """
    assert result["keras"] - result["without_added"] > margin, result
    assert abs(result["added_reported"] - result["keras"]) < 1e-4 * result["keras"], result


_NOISE = (
    "E0000",
    "W0000",
    "I0000",
    "Additional GRPC",
    ":UNKNOWN:",
    "This could happen",
    "WARNING: All log",
)


def _quiet(stderr):
    """stderr without TensorFlow's gRPC teardown chatter."""
    return "\n".join(l for l in stderr.splitlines() if not l.startswith(_NOISE))


def run_tutorial(filename, *args, timeout):
    """Runs ``tutorials/FILENAME`` as a user would: from the repository root, in a
    fresh interpreter, with a deadline. Returns its stdout; a non-zero exit
    fails the test with the end of its stderr."""
    proc = subprocess.run(
        [sys.executable, os.path.join("tutorials", filename), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    assert proc.returncode == 0, _quiet(proc.stderr)[-4000:]
    return proc.stdout


@pytest.fixture
def tutorial(tmp_path):
    """Runs a tutorial (``run_tutorial``) with ``--result`` a file in ``tmp_path``
    and returns the figures it wrote there (a dict): tests check those, not
    the sentences it prints (shown, as captured output, when a test fails)."""

    def run(filename, *args, timeout):
        result = tmp_path / "result.json"
        print(run_tutorial(filename, *args, "--result", str(result), timeout=timeout))
        return json.loads(result.read_text())

    return run
