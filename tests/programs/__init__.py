"""Programs the tests run in a fresh interpreter (``python -m tests.programs.NAME``).

Each is a real module a reader can open and run by hand; it prints one
``RESULT <json>`` line that :func:`run_program` returns parsed.
"""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ProgramError(AssertionError):
    """A program exited with an error, printed no result, or ran past its deadline."""


def program_command(name, *args):
    """The command line ``python -m tests.programs.NAME ARGS``, for a process a
    test starts itself (one it reads while it runs, signals or kills, or a
    cluster's task); it runs with the repository root as its directory or on
    ``PYTHONPATH``."""
    return [sys.executable, "-m", f"tests.programs.{name}", *map(str, args)]


def result_of(output):
    """The value of the last ``RESULT`` in ``output`` (text), or None.

    Found anywhere in a line, and read up to the end of its JSON value:
    TensorFlow's C++ logging writes to the same stdout without waiting for
    Python's lines, so a RESULT can follow part of a log line, or precede one.
    """
    start = output.rfind("RESULT ")
    if start < 0:
        return None
    value, _ = json.JSONDecoder().raw_decode(output, start + len("RESULT "))
    return value


def run_program(name, *args, timeout=300, env=None, expect_ok=True):
    """Runs ``python -m tests.programs.NAME ARGS`` from the repository root; its RESULT.

    The program gets ``timeout`` seconds, then it is killed and this raises
    with its output so far. ``env`` adds to (or overrides) this process's
    environment. With ``expect_ok=False`` this returns the ``CompletedProcess``
    (text stdout and stderr) whatever its exit, for a test of a failing exit,
    of stderr or of how the process ended (:func:`result_of` reads its RESULT).
    """
    full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    full_env.update(env or {})
    try:
        proc = subprocess.run(
            program_command(name, *args),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=full_env,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as e:
        raise ProgramError(f"{name} {args} ran past {timeout}s\n{e.stdout}\n{e.stderr}") from None
    if not expect_ok:
        return proc
    result = result_of(proc.stdout)
    if proc.returncode != 0 or result is None:
        raise ProgramError(
            f"{name} {args} exited with {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\n"
            f"stderr:\n{proc.stderr[-6000:]}"
        )
    return result


def run_workers(name, *args, num_workers=2, timeout=600, every=False, env=None):
    """Runs ``python -m tests.programs.NAME ARGS`` as every task of a
    ``worker`` cluster (each with its own ``TF_CONFIG``, ports on
    127.0.0.1), as MultiWorkerMirroredStrategy programs run; worker 0's RESULT
    (``every=True``: the list of every worker's, in task order). ``env`` adds
    to every task's environment.

    Every task is killed when one fails or the deadline passes.
    """
    from tfdist_ext.cluster import free_port

    workers = [f"127.0.0.1:{free_port()}" for _ in range(num_workers)]
    procs = []
    for index in range(num_workers):
        config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        task_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_CONFIG=json.dumps(config))
        task_env.update(env or {})
        procs.append(
            subprocess.Popen(
                program_command(name, *args),
                cwd=REPO,
                env=task_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                text=True,
            )
        )
    try:
        outputs = [proc.communicate(timeout=timeout) for proc in procs]
    except subprocess.TimeoutExpired:
        raise ProgramError(f"{name} {args}: a worker ran past {timeout}s") from None
    finally:
        for proc in procs:
            proc.kill()
    for proc, (stdout, stderr) in zip(procs, outputs):
        if proc.returncode != 0:
            raise ProgramError(
                f"{name} {args}: a worker exited with {proc.returncode}\n"
                f"{stdout[-3000:]}\n{stderr[-6000:]}"
            )
    results = [result_of(stdout) for stdout, _ in outputs]
    for index, (result, (_, stderr)) in enumerate(zip(results, outputs)):
        if result is None and (every or index == 0):
            raise ProgramError(f"{name} {args}: worker {index} printed no result\n{stderr[-6000:]}")
    return results if every else results[0]


def report(value):
    """Prints ``value`` as the program's RESULT line."""
    print("RESULT " + json.dumps(value), flush=True)
