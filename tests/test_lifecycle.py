"""A script on a LocalCluster ends by itself, quietly, with a live model (issue 12, items 5-6).

Each test runs a README-style script (a case of
``tests/programs/lifecycle_cases.py``) in a fresh interpreter with a deadline,
with TensorFlow's default log level (so that any RPC error TensorFlow's
runtime logs shows up on stderr), and checks what a user sees: the exit
status, how long the process takes to end after the ``with LocalCluster``
block, stderr, and the model after the block.
"""

import time

import pytest

from tests.programs import result_of
from tests.programs import run_program
from tests.programs.lifecycle_cases import LEFT

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
# What TensorFlow's CUDA wheel (pulled in by tf-keras, the `bench` extra)
# logs at import on a machine without a GPU: no RPC, and not ours.
NOT_RPC = ("failed call to cuInit",)


def _run(args, timeout):
    """Runs ``lifecycle_cases ARGS``; returns (process, seconds from its last ``LEFT``
    line to exit).

    That line is printed on leaving the cluster block, and again as the last
    line of a script that goes on after it.
    """
    # The process, not only its RESULT: its exit, its stderr and when it ended.
    proc = run_program(
        "lifecycle_cases",
        *args,
        timeout=timeout,
        env={"TF_CPP_MIN_LOG_LEVEL": "0"},
        expect_ok=False,
    )
    ended = time.time()
    assert proc.returncode == 0, proc.stderr[-8000:]
    left = [l for l in proc.stdout.splitlines() if l.startswith(LEFT)]
    assert left, proc.stdout[-3000:]
    return proc, ended - float(left[-1].split()[1])


def _rpc_errors(lines, allowed=()):
    allowed = (*allowed, *NOT_RPC)
    return [l for l in lines if any(s in l for s in RPC_ERROR) and not any(a in l for a in allowed)]


@pytest.mark.timeout(420)
@pytest.mark.parametrize(
    "algorithm, kill",
    [
        pytest.param("downpour", False, id="downpour-plain"),
        # The other cases in the slow lane (tox -e tests-all).
        pytest.param("downpour", True, id="downpour-worker_killed", marks=pytest.mark.slow),
        pytest.param("sandblaster", False, id="sandblaster-plain", marks=pytest.mark.slow),
        pytest.param("sandblaster", True, id="sandblaster-worker_killed", marks=pytest.mark.slow),
    ],
)
def test_script_ends_by_itself_without_rpc_errors(tmp_path, algorithm, kill):
    # Without a kill the script also goes on after the block, as a user's
    # does: the model keeps its final parameters (checked below).
    args = [algorithm, "worker_killed"] if kill else [algorithm, "plain", tmp_path / "after.keras"]
    proc, seconds = _run(args, timeout=400)
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
    r = result_of(proc.stdout)
    assert r, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert r["same_weights"] and r["n_weights"][0] == r["n_weights"][1] > 0, r
    assert r["logits_diff"] < 1e-5, r
    assert r["evaluated"] == pytest.approx(r["final_eval"], abs=1e-5), r
    assert r["reloaded_diff"] < 1e-5, r
    assert "is closed" in r["refused"], r


@pytest.mark.timeout(200)
@pytest.mark.parametrize("block", [True, False], ids=["with_block", "left_to_exit"])
@pytest.mark.slow
def test_connected_script_ends_without_rpc_errors(block):
    # connect()'s own example, no strategy: the cluster makes this process's
    # runtime local before its tasks stop (in stop(), or at exit when the
    # script never stops it), so TensorFlow does not try to delete its
    # functions on stopped tasks (an error and a 3 s timeout per task).
    proc, seconds = _run(["connected", "with_block" if block else "left_to_exit"], timeout=180)
    assert result_of(proc.stdout) == {"value": 2.0}
    assert seconds < 30, f"the process ended {seconds:.1f}s after the script's last line"
    assert not _rpc_errors(proc.stderr.splitlines()), proc.stderr[-4000:]


@pytest.mark.timeout(300)
def test_lost_parameter_server_is_a_clear_error():
    proc, seconds = _run(["downpour_lost_ps"], timeout=280)
    error = result_of(proc.stdout)["stop_error"]
    assert error and "ps:0" in error and "could not be brought back" in error, proc.stdout[-3000:]
    assert seconds < 30
