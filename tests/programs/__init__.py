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


def run_program(name, *args, timeout=300, env=None):
    """Runs ``python -m tests.programs.NAME ARGS`` from the repository root; its RESULT.

    The program gets ``timeout`` seconds, then it is killed and this raises
    with its output so far.
    """
    full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", f"tests.programs.{name}", *map(str, args)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=full_env,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as e:
        raise ProgramError(f"{name} {args} ran past {timeout}s\n{e.stdout}\n{e.stderr}") from None
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise ProgramError(
            f"{name} {args} exited with {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\n"
            f"stderr:\n{proc.stderr[-6000:]}"
        )
    return json.loads(lines[-1][len("RESULT ") :])


def run_workers(name, *args, num_workers=2, timeout=600):
    """Runs ``python -m tests.programs.NAME ARGS`` as every task of a
    ``worker`` cluster (each with its own ``TF_CONFIG``, ports on
    127.0.0.1), as MultiWorkerMirroredStrategy programs run; worker 0's RESULT.

    Every task is killed when one fails or the deadline passes.
    """
    from tfdist_ext.cluster import free_port

    workers = [f"127.0.0.1:{free_port()}" for _ in range(num_workers)]
    procs = []
    for index in range(num_workers):
        config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_CONFIG=json.dumps(config))
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", f"tests.programs.{name}", *map(str, args)],
                cwd=REPO,
                env=env,
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
    lines = [line for line in outputs[0][0].splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise ProgramError(f"{name} {args}: worker 0 printed no result\n{outputs[0][1][-6000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def report(value):
    """Prints ``value`` as the program's RESULT line."""
    print("RESULT " + json.dumps(value), flush=True)
