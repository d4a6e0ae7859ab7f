"""Shared test set-up.

TensorFlow's logical device split is fixed once per process, so the suite
splits the CPU into 4 logical devices before any test touches TensorFlow;
tests that need k <= 4 devices take ``cpu_devices[:k]``. Tests that need a
cluster or a fresh TensorFlow runtime run their body in a subprocess (see
``run_script``), always with a deadline. The run gets its own temporary
directory (``TMPDIR``) and fails if it leaves ``tfdist-ext*`` entries there.
"""

import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap

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
    """Whether ``function``, or a function of ``module`` it names, starts processes."""
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
    names = set(re.findall(r"\b([A-Za-z_]\w*)\(", source))
    helpers = (getattr(module, n, None) for n in names)
    return any(inspect.isfunction(h) and _spawns(h, module, seen) for h in helpers)


def pytest_collection_modifyitems(config, items):
    for item in items:
        function = getattr(item, "function", None)
        if function is not None and _spawns(function, item.module):
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
            capture_output=True,
            text=True,
            timeout=timeout,
            env=full_env,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(
            f"script did not finish within {timeout}s\nstdout:\n{e.stdout}\nstderr:\n{e.stderr}"
        )
    if expect_ok and proc.returncode != 0:
        stderr = _quiet(proc.stderr)
        pytest.fail(
            f"script exited with {proc.returncode}\nerrors raised:\n{_raised(stderr)}\n"
            f"stdout:\n{proc.stdout[-5000:]}\nstderr:\n{stderr[-8000:]}"
        )
    return proc


#: Script code: a model whose layer adds a loss in call() (Keras's
#: ActivityRegularization; "Making new layers and models via subclassing"
#: calls add_loss the same way), plain Keras's loss at a trained model's
#: weights with and without that term, and ``fit_added_loss(strategy)``, which
#: fits that model under a strategy and returns both beside what it reported
#: (check them with :func:`assert_added_loss_trained`). Needs ``keras``,
#: ``tf`` and ``datasets`` imported.
ADDED_LOSS = """
def regularized(cls=keras.Sequential, reg=True):
    layers = [keras.Input((64,)), keras.layers.Dense(16, activation="relu")]
    if reg:
        layers.append(keras.layers.ActivityRegularization(l2=0.05))
    return cls(layers + [keras.layers.Dense(10)])

def keras_losses(model, x, y):
    out = {}
    for name, reg in (("keras", True), ("without_added", False)):
        plain = regularized(reg=reg)
        plain.set_weights(model.get_weights())
        plain.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        out[name] = plain.evaluate(x, y, batch_size=len(x), verbose=0)
    return out

def fit_added_loss(strategy, cls=keras.Sequential):
    # SGD(0) keeps the weights, so every step's loss is the same batch's loss
    # at the same weights, as plain Keras computes it.
    x, y = datasets.digits("train", flatten=True, as_numpy=True)
    x, y = x[:64], y[:64]
    # Seeded: the term is set by the initial weights alone (0.07-0.18 over
    # seeds 0-5, 0.115 at 0); unseeded, CI once drew 0.0496, under the margin.
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = regularized(cls)
        model.compile(optimizer=keras.optimizers.SGD(0.0),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    h = model.fit(tf.data.Dataset.from_tensors((x, y)).repeat(), epochs=1, steps_per_epoch=4,
                  verbose=0)
    return {"added_reported": h.history["loss"][-1], **keras_losses(model, x, y)}
"""


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


_RAISED = re.compile(r"^[\w.]*(Error|Exception|Exit)\b.*$", re.MULTILINE)


def _raised(stderr):
    """The lines of ``stderr`` that name a raised exception (a long traceback's
    tail, all that fits in the report, can leave out the message itself)."""
    return "\n".join(m.group(0)[:2000] for m in _RAISED.finditer(stderr))


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
