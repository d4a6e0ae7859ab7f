"""A script on a LocalCluster ends by itself, quietly, with a live model (issue 12, items 5-6).

Each test runs a README-style script in a fresh interpreter with a deadline,
with TensorFlow's default log level (so that any RPC error TensorFlow's
runtime logs shows up on stderr), and checks what a user sees: the exit
status, how long the process takes to end after the ``with LocalCluster``
block, stderr, and the model after the block.
"""

import json
import textwrap
import time

import pytest

LEFT = "LEFT_CLUSTER_BLOCK"

# The start both scripts share: imports, test data, and a callback that kills
# worker 1 at the end of epoch `kill_at` (when the test asks for a kill).
HEAD = """
import sys, time
import numpy as np
import keras
import tfdist_ext
from tfdist_ext import datasets

KILL = {{kill}}
x_test, y_test = datasets.digits("test", flatten=True, as_numpy=True)

class KillWorker(keras.callbacks.Callback):
    def __init__(self, cluster):
        super().__init__()
        self.cluster = cluster
    def on_epoch_end(self, epoch, logs=None):
        if KILL and epoch == {kill_at}:
            print("KILLED", self.cluster.address("worker", 1), flush=True)
            self.cluster.kill("worker", 1)
"""

DOWNPOUR = (
    HEAD.format(kill_at=0)
    + """
keras.utils.set_random_seed(0)
with tfdist_ext.LocalCluster(num_workers=2, num_ps=1) as cluster:
    strategy = tfdist_ext.DownpourStrategy(cluster.resolver, n_fetch=2, n_push=2)
    train = datasets.digits("train", flatten=True).shuffle(2048, seed=0).batch(32).repeat()
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.Adagrad(0.05),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    model.fit(train, epochs=3, steps_per_epoch=25, verbose=0, callbacks=[KillWorker(cluster)])
{after_fit}
print("{left}", time.time(), flush=True)
print("{left}", file=sys.stderr, flush=True)
{after_block}
"""
)

SANDBLASTER = (
    HEAD.format(kill_at=2)
    + """
x, y = datasets.digits("train", flatten=True, as_numpy=True)

with tfdist_ext.LocalCluster(num_workers=2, num_ps=1) as cluster:
    strategy = tfdist_ext.SandblasterStrategy(cluster.resolver, slices_per_worker=4)
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(
            10, kernel_regularizer=keras.regularizers.L2(1e-3))])
        model.compile(optimizer=tfdist_ext.optimizers.LBFGS(memory=10),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    model.fit(x, y, epochs=6, verbose=0, callbacks=[KillWorker(cluster)])
{after_fit}
print("{left}", time.time(), flush=True)
print("{left}", file=sys.stderr, flush=True)
{after_block}
"""
)

SCRIPTS = {"downpour": DOWNPOUR, "sandblaster": SANDBLASTER}

# What a user's model is at the end of fit, read while the cluster still runs ...
AFTER_FIT = """
    final_weights = model.get_weights()
    final_eval = model.evaluate(x_test, y_test, verbose=0)
    final_logits = model.predict(x_test, verbose=0)
"""
# ... and after the block, in plain single-process mode.
AFTER_BLOCK = """
import json
weights = model.get_weights()
logits = model.predict(x_test, verbose=0)
evaluated = model.evaluate(x_test, y_test, verbose=0)
model.save("{path}")
reloaded = keras.models.load_model("{path}")
try:
    model.fit(x_test[:8], np.zeros(8), epochs=1, verbose=0)
    refused = ""
except RuntimeError as e:
    refused = str(e)
print("RESULT " + json.dumps(dict(
    same_weights=all(np.array_equal(a, b) for a, b in zip(weights, final_weights)),
    n_weights=[len(weights), len(final_weights)],
    logits_diff=float(np.abs(logits - final_logits).max()),
    evaluated=evaluated, final_eval=final_eval,
    reloaded_diff=float(np.abs(reloaded.predict(x_test, verbose=0) - logits).max()),
    refused=refused)), flush=True)
print("{left}", time.time(), flush=True)
"""

# RPC errors as TensorFlow's runtime and its coordinator log them.
RPC_ERROR = (
    "Connection refused",
    "failed to connect",
    "Failed to connect",
    "E0000",
    "W0000",
    "ERROR:tensorflow",
    "UNAVAILABLE",
    "Traceback",
)


def _run(script, source, timeout):
    """Runs ``source``; returns (process, seconds from its last ``LEFT`` line to exit).

    That line is printed on leaving the cluster block, and again as the last
    line of a script that goes on after it (``AFTER_BLOCK``).
    """
    proc = script(source, timeout=timeout, env={"TF_CPP_MIN_LOG_LEVEL": "0"})
    ended = time.time()
    left = [l for l in proc.stdout.splitlines() if l.startswith(LEFT)]
    assert left, proc.stdout[-3000:]
    return proc, ended - float(left[-1].split()[1])


def _rpc_errors(lines, allowed=()):
    return [l for l in lines if any(s in l for s in RPC_ERROR) and not any(a in l for a in allowed)]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("kill", [False, True], ids=["plain", "worker_killed"])
@pytest.mark.parametrize("algorithm", ["downpour", "sandblaster"])
def test_script_ends_by_itself_without_rpc_errors(script, tmp_path, algorithm, kill):
    # Without a kill the script also goes on after the block, as a user's
    # does: the model keeps its final parameters (checked below).
    source = SCRIPTS[algorithm].format(
        kill=kill,
        left=LEFT,
        after_fit="" if kill else AFTER_FIT,
        after_block="" if kill else AFTER_BLOCK.format(path=tmp_path / "after.keras", left=LEFT),
    )
    proc, seconds = _run(script, source, timeout=400)
    assert seconds < 30, f"the process ended {seconds:.1f}s after the script's last line"
    before, _, after = proc.stderr.partition(LEFT)
    assert not _rpc_errors(after.splitlines()), after[-4000:]
    # Until the block ends, TensorFlow may report the killed worker, and only it.
    allowed = ()
    if kill:
        (address,) = [l.split()[1] for l in proc.stdout.splitlines() if l.startswith("KILLED ")]
        allowed = (address, "/job:worker/replica:0/task:1", "This could happen")
    assert not _rpc_errors(before.splitlines(), allowed), before[-4000:]
    if not kill:
        _check_final_parameters(proc)


def _check_final_parameters(proc):
    """After the block, the model is the one ``fit`` ended with, and saves, loads and
    refuses to train on the closed cluster with a message."""
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert line, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(line[-1][len("RESULT ") :])
    assert r["same_weights"] and r["n_weights"][0] == r["n_weights"][1] > 0, r
    assert r["logits_diff"] < 1e-5, r
    assert r["evaluated"] == pytest.approx(r["final_eval"], abs=1e-5), r
    assert r["reloaded_diff"] < 1e-5, r
    assert "is closed" in r["refused"], r


@pytest.mark.timeout(200)
@pytest.mark.parametrize("block", [True, False], ids=["with_block", "left_to_exit"])
def test_connected_script_ends_without_rpc_errors(script, block):
    # connect()'s own example, no strategy: the cluster makes this process's
    # runtime local before its tasks stop (in stop(), or at exit when the
    # script never stops it), so TensorFlow does not try to delete its
    # functions on stopped tasks (an error and a 3 s timeout per task).
    body = textwrap.dedent(
        """
        connect(cluster.resolver)
        with tf.device("/job:ps/task:0"):
            v = tf.Variable(1.0)
        @tf.function
        def f():
            with tf.device("/job:worker/task:0"):
                return v.read_value() * 2.0
        print("VALUE", float(f()), flush=True)
        """
    )
    if block:
        body = "with LocalCluster(num_workers=1, num_ps=1) as cluster:\n" + textwrap.indent(
            body, "    "
        )
    else:
        body = "cluster = LocalCluster(num_workers=1, num_ps=1).start()\n" + body
    source = (
        "import time\nimport tensorflow as tf\nfrom tfdist_ext.cluster import LocalCluster, connect\n"
        + body
        + f'print("{LEFT}", time.time(), flush=True)\n'
    )
    proc, seconds = _run(script, source, timeout=180)
    assert "VALUE 2.0" in proc.stdout
    assert seconds < 30, f"the process ended {seconds:.1f}s after the script's last line"
    assert not _rpc_errors(proc.stderr.splitlines()), proc.stderr[-4000:]


@pytest.mark.timeout(300)
def test_lost_parameter_server_is_a_clear_error(script):
    source = DOWNPOUR.format(
        kill=False,
        left=LEFT,
        after_fit="""
    cluster.kill("ps", 0)
    try:
        cluster.stop()
    except tfdist_ext.cluster.ClusterError as e:
        print("ERROR", e, flush=True)
""",
        after_block="",
    )
    proc, seconds = _run(script, source, timeout=280)
    error = [l for l in proc.stdout.splitlines() if l.startswith("ERROR ")]
    assert error and "ps:0" in error[0] and "could not be brought back" in error[0], proc.stdout[
        -3000:
    ]
    assert seconds < 30
