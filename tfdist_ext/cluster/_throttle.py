"""A real, OS-level straggler (internal): ``LocalCluster.throttle``."""

import contextlib
import signal
import subprocess
import sys

from tfdist_ext.cluster._process import signal_quietly

#: The stop/continue cycle of ``LocalCluster.throttle``, run as
#: ``python -c _THROTTLE PID STOPPED_SECONDS RUNNING_SECONDS``. It continues
#: the task and exits on SIGTERM, when the task is gone, or when its parent
#: (the chief) is.
_THROTTLE = """
import os, signal, sys, time
pid, stopped, running = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
parent = os.getppid()
def finish(*_):
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
    sys.exit(0)
signal.signal(signal.SIGTERM, finish)
try:
    while os.getppid() == parent:
        os.kill(pid, signal.SIGSTOP)
        time.sleep(stopped)
        os.kill(pid, signal.SIGCONT)
        time.sleep(running)
except ProcessLookupError:
    pass
finish()
"""


@contextlib.contextmanager
def throttled(pid, slowdown, period):
    """Process ``pid`` stopped for ``(1 - 1/slowdown)`` of every ``period``
    seconds while the block runs, and continued when it ends."""
    if not slowdown >= 1.0:
        raise ValueError(f"LocalCluster.throttle: slowdown must be >= 1, got {slowdown!r}")
    if not period > 0:
        raise ValueError(f"LocalCluster.throttle: period must be > 0, got {period!r}")
    running = period / slowdown
    cycler = subprocess.Popen(
        [sys.executable, "-c", _THROTTLE, str(pid), repr(period - running), repr(running)],
        stdin=subprocess.DEVNULL,
    )
    try:
        yield
    finally:
        cycler.terminate()
        try:
            cycler.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            cycler.kill()
            cycler.wait(timeout=5.0)
        signal_quietly(pid, signal.SIGCONT)
