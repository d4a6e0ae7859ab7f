"""Issue 12 acceptance: real Keras programs x every strategy of the project.

Each model kind is a program as Keras's own guides write it ("The Sequential
model", "The Functional API", "Making new layers and models via subclassing",
"Customizing what happens in fit()", "Mixed precision", and "Multi-GPU
distributed training with TensorFlow" with its checkpoint-restart pattern).
The user's code lives in their own module
(``tests/programs/keras_matrix/user_models.py``), which knows nothing of
tfdist_ext; ``train.py`` and ``load.py`` beside it are the training and the
loading processes. One training process
per strategy (one cluster) runs every selected kind, as
``with strategy.scope(): build + compile``, then ``fit``, ``predict`` and
``save``. Each cell then checks that

* the loss fell, and the user's own code ran where they wrote it (counters in
  ``Layer.call`` and ``Model.call``, a metric updated by the user's
  ``train_step``) -- or, where the strategy cannot honour it, that ``fit``
  was refused at once (before the first batch) with a ``ValueError`` naming
  the problem;
* the ``.keras`` file loads in a fresh process that does not import
  tfdist_ext and predicts what the training process predicted;

and one cell per strategy checks that the training process ended by itself
(exit code 0, no ``os._exit``, no gRPC connection errors) soon after its last
statement.

The default suite runs ``DEFAULT_CELLS``; the rest of the matrix is marked
``slow``. Cells that fail
today are strict xfails naming the numbered failure of issue 12, or "NEW".
"""

import json
import os
import subprocess
import sys
import time

import pytest

from tests.programs import result_of
from tfdist_ext.cluster import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROGRAMS = os.path.join(REPO, "tests", "programs", "keras_matrix")


STRATEGIES = (
    "downpour",
    "elastic",
    "sandblaster",
    "compressed_mirrored",
    "compressed_multiworker",
    "model_parallel",
)
KINDS = (
    "sequential",
    "functional_two_inputs",
    "subclassed",
    "custom_train_step",
    "bn_dropout",
    "embedding",
    "mixed_float16",
    "mixed_bfloat16",
    "checkpoint_restart",
)

# The default suite runs the asynchronous and the multi-worker strategy on the
# Keras guides' main model kinds; the other strategies' cells and the other
# kinds (bn_dropout, embedding, mixed_float16) run in the slow lane, the
# strategies' Keras features being in the default slice of test_conformance.py.
DEFAULT_CELLS = {
    ("downpour", "sequential"),
    ("downpour", "custom_train_step"),
    ("downpour", "checkpoint_restart"),
    ("compressed_multiworker", "functional_two_inputs"),
    ("compressed_multiworker", "subclassed"),
    ("compressed_multiworker", "mixed_bfloat16"),
}

# Where a strategy cannot honour the user's code, fit must be refused at once
# with a ValueError whose message contains this text.
REFUSALS = {
    ("sandblaster", "custom_train_step"): "train_step",
    ("sandblaster", "mixed_float16"): "mixed_float16",  # L-BFGS has no loss scaling
    # EASGD's replica lives on the worker; a user's train_step would update the centre.
    ("elastic", "custom_train_step"): "compute_loss override",
}

# Cells that fail today: a numbered failure of issue 12, or NEW (not in the issue).
KNOWN_FAILURES = {}

STEPS = 6  # train.py's steps_per_epoch (its EPOCHS, STEPS, BATCH line)
POLICIES = {"mixed_float16": "mixed_float16", "mixed_bfloat16": "mixed_bfloat16"}
EXIT_GRACE = 30.0  # seconds a process may take to end after its last statement


def _cell(strategy, kind):
    marks = [] if (strategy, kind) in DEFAULT_CELLS else [pytest.mark.slow]
    if (strategy, kind) in KNOWN_FAILURES:
        marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[strategy, kind]))
    return pytest.param(strategy, kind, marks=marks, id=f"{strategy}-{kind}")


AFTER_BLOCK_FAILURES = {}
EXIT_FAILURES = {}


CELLS = [_cell(s, k) for s in STRATEGIES for k in KINDS]


class Run:
    """One training process (or two, for the multi-worker strategy) and its fresh-process load."""

    def __init__(self, strategy, kinds, directory, env=None):
        self.strategy, self.kinds, self.directory = strategy, list(kinds), directory
        self.env = dict(env or {})
        self.deadline = 120 + 90 * len(self.kinds)
        self.workers = []
        self.loaded = None

    def start(self):
        """Starts the training process (one per worker, each with its TF_CONFIG)."""
        if self.strategy != "compressed_multiworker":
            self.workers = [self._start(self.directory / "out", self.env)]
            return self
        cluster = {"worker": [f"127.0.0.1:{free_port()}" for _ in range(2)]}
        self.workers = [
            self._start(
                self.directory / f"out{i}",
                {
                    **self.env,
                    "TF_CONFIG": json.dumps(
                        {"cluster": cluster, "task": {"type": "worker", "index": i}}
                    ),
                },
            )
            for i in range(2)
        ]
        return self

    def _start(self, out, env):
        log = open(self.directory / f"{out.name}.log", "w")
        proc = subprocess.Popen(
            [
                sys.executable,
                os.path.join(PROGRAMS, "train.py"),
                self.strategy,
                str(out),
                ",".join(self.kinds),
                json.dumps(POLICIES),
            ],
            cwd=self.directory,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2", **env),
        )
        return {"proc": proc, "out": out, "log": log}

    def wait(self):
        """Waits for every process: until the deadline, then EXIT_GRACE after its last statement."""
        start = time.time()
        for w in self.workers:
            while w["proc"].poll() is None:
                finished = self._results(w).get("finished")
                if (
                    finished
                    and time.time() - finished > EXIT_GRACE
                    or time.time() - start > self.deadline
                ):
                    w["killed"] = True
                    break
                time.sleep(0.5)
        self.stop()
        return self

    def stop(self):
        """Kills whatever still runs (after the deadline, or when the test is interrupted)."""
        for w in self.workers:
            if w["proc"].poll() is None:
                w["proc"].kill()
                w["proc"].wait()
            w["log"].close()

    @staticmethod
    def _results(worker):
        try:
            return json.loads((worker["out"] / "results.json").read_text())
        except (OSError, ValueError):
            return {}

    def log(self, worker, tail=6000):
        text = (self.directory / f"{worker['out'].name}.log").read_text()
        return text[-tail:] if tail else text

    def after_cluster_block(self):
        result = self._results(self.workers[0]).get("after_cluster_block")
        if result is None:
            pytest.fail(
                f"no result after the cluster block; the log ends:\n{self.log(self.workers[0])}"
            )
        return result

    def cell(self, kind):
        """Each worker's result for ``kind``; fails with the worker's log if it has none."""
        results = []
        for w in self.workers:
            result = self._results(w).get("kinds", {}).get(kind)
            if result is None:
                pytest.fail(f"no result for {kind!r}; the process log ends:\n{self.log(w)}")
            results.append(result)
        return results

    def load(self):
        """Loads every saved model in a fresh process without tfdist_ext (once)."""
        if self.loaded is None:
            out = self.workers[0]["out"]
            saved = [k for k in self.kinds if (out / f"{k}.keras").exists()]
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            proc = subprocess.run(
                [sys.executable, os.path.join(PROGRAMS, "load.py"), str(out), ",".join(saved)],
                cwd=self.directory,
                capture_output=True,
                text=True,
                timeout=60 + 20 * len(saved),
                stdin=subprocess.DEVNULL,
                env=dict(env, TF_CPP_MIN_LOG_LEVEL="2"),
            )
            self.loaded = result_of(proc.stdout)
            assert self.loaded is not None, f"loader failed:\n{proc.stderr[-4000:]}"
        return self.loaded


_RUNS = {}


@pytest.fixture(scope="module", autouse=True)
def _stop_runs():
    yield
    for run in _RUNS.values():
        run.stop()


@pytest.fixture
def run_of(request, tmp_path_factory):
    """``run_of(strategy)``: the finished Run of that strategy, with every selected kind.

    ``run_of(strategy, after_cluster_block=True)``: a separate run of one kind that
    then uses the model after its LocalCluster block (kept apart so that what it
    prints does not count against the exit check of the main run).
    """

    def get(strategy, after_cluster_block=False):
        if after_cluster_block:
            key = (strategy, "after_cluster_block")
            if key not in _RUNS:
                _RUNS[key] = Run(
                    strategy,
                    ["sequential"],
                    tmp_path_factory.mktemp(key[1]),
                    env={"MATRIX_AFTER_CLUSTER_BLOCK": "1"},
                )
                _RUNS[key].start().wait()
            return _RUNS[key]
        if strategy not in _RUNS:
            kinds = [
                k
                for k in KINDS
                if any(_params(item) == (strategy, k) for item in request.session.items)
            ]
            _RUNS[strategy] = Run(strategy, kinds or KINDS[:1], tmp_path_factory.mktemp(strategy))
            _RUNS[strategy].start().wait()
        return _RUNS[strategy]

    return get


def _params(item):
    params = getattr(getattr(item, "callspec", None), "params", {})
    return params.get("strategy"), params.get("kind")


def _check_trained(strategy, kind, result):
    if "error" in result:
        expected = REFUSALS.get((strategy, kind))
        assert expected is not None, (
            f"{strategy} x {kind}: fit failed with {result['error']}: {result['message']}\n"
            f"{result['traceback']}"
        )
        assert result["error"] == "ValueError", result["traceback"]
        assert expected in result["message"], result["message"]
        assert result["batches"] == 0, "refused only after training had started"
        return False
    loss = result["history"]["loss"]
    assert loss[-1] < loss[0], f"the loss did not fall: {loss}"
    if kind == "custom_train_step":
        steps = result["history"].get("user_steps")
        assert steps and steps[-1] > 0, (
            f"the user's train_step did not run (user_steps: {steps}; logs: "
            f"{sorted(result['history'])})"
        )
        # The same steps every epoch, each counted (once per replica): a
        # metric update lost between concurrent workers shows here.
        assert len(set(steps)) == 1 and steps[0] >= STEPS, f"user_steps per epoch: {steps}"
    if kind == "subclassed":
        assert result["calls"]["model"] > 0, "the user's Model.call() never ran"
        assert result["calls"]["layer"] > 0, "the user's Layer.call() never ran"
    if kind == "checkpoint_restart":
        assert result["restored_iterations"] > 0, "the optimizer state was not restored"
    assert result["policy"] == POLICIES.get(kind, "float32"), result["policy"]
    return True


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("strategy,kind", CELLS)
def test_keras_program_runs_under_strategy(run_of, strategy, kind):
    run = run_of(strategy)
    trained = [_check_trained(strategy, kind, result) for result in run.cell(kind)]
    if not trained[0]:
        return
    loaded = run.load()
    assert loaded["imported_tfdist_ext"] is False
    assert "error" not in loaded[kind], loaded[kind]["error"]
    if strategy != "sandblaster":  # see test_sandblaster_model_loads_compiled_without_tfdist_ext
        assert "compile_error" not in loaded[kind], loaded[kind]["compile_error"]
    tolerance = 1e-2 if kind.startswith("mixed") else 1e-4
    assert loaded[kind]["max_diff"] <= tolerance, loaded[kind]


@pytest.mark.timeout(1800)
@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param(
            s,
            marks=[pytest.mark.xfail(strict=True, reason=EXIT_FAILURES[s])]
            if s in EXIT_FAILURES
            else []
            if any(cell[0] == s for cell in DEFAULT_CELLS)
            else [pytest.mark.slow],
            id=s,
        )
        for s in STRATEGIES
    ],
)
def test_training_process_exits_by_itself(run_of, strategy):
    run = run_of(strategy)
    for w in run.workers:
        assert "killed" not in w, (
            f"the process did not end within {EXIT_GRACE:.0f} s of its last statement "
            f"(or the {run.deadline} s deadline); its log ends:\n{run.log(w)}"
        )
        assert w["proc"].returncode == 0, run.log(w)
        assert "Connection refused" not in run.log(w, tail=None), run.log(w)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_sandblaster_model_without_tfdist_ext_loads_uncompiled_or_names_lbfgs(run_of):
    # A Sandblaster model is compiled with tfdist_ext.optimizers.LBFGS, a custom
    # Keras object: like any custom object, a process without tfdist_ext cannot
    # rebuild it. Keras says so by name, and compile=False loads the model
    # (the cells above compare its predictions); with tfdist_ext.optimizers
    # imported it loads compiled (test_sandblaster.py).
    loaded = run_of("sandblaster").load()
    errors = {
        kind: r["compile_error"]
        for kind, r in loaded.items()
        if isinstance(r, dict) and "compile_error" in r
    }
    assert errors, "expected Keras to name the LBFGS class it cannot find"
    for kind, error in errors.items():
        assert "LBFGS" in error, (kind, error)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param(
            s,
            marks=[pytest.mark.xfail(strict=True, reason=AFTER_BLOCK_FAILURES[s])]
            if s in AFTER_BLOCK_FAILURES
            else [],
            id=s,
        )
        for s in ("downpour", "sandblaster")
    ],
)
def test_model_after_cluster_block(run_of, strategy):
    """Predicts as before once the LocalCluster has closed, or says what happened (item 6)."""
    result = run_of(strategy, after_cluster_block=True).after_cluster_block()
    if "error" in result:
        assert "failed to connect" not in result["error"], result["error"]
        assert "cluster" in result["error"].lower(), result["error"]
    else:
        assert result["max_diff"] <= 1e-5, result
