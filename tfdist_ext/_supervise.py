"""One run of a job's tasks as child processes: start, stream, watch, stop (internal)."""

import os
import signal
import subprocess
import sys
import threading
import time

POLL = 0.2


class Job:
    """The processes of one attempt of a job (``launch.TaskSpec`` each)."""

    def __init__(self, specs, stop_timeout):
        self.specs, self.stop_timeout = specs, stop_timeout
        self.procs, self.readers = [], []
        self.late_failures = {}  # task name: its status, for tasks failed after the chief ended
        for spec in specs:
            proc = subprocess.Popen(
                spec.argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=None if spec.env is None else {**os.environ, **spec.env},
                start_new_session=True,  # stopped as a group: ssh, ip netns exec, python
            )
            self.procs.append(proc)
            prefix = "" if spec.chief else f"[{spec.name}] "
            out = sys.stdout if spec.chief else sys.stderr
            for stream, target in ((proc.stdout, out), (proc.stderr, sys.stderr)):
                reader = threading.Thread(target=_pump, args=(stream, target, prefix), daemon=True)
                reader.start()
                self.readers.append(reader)

    def run(self, stop):
        """Waits until the chief ends or a task fails: ``(status, failed task name or None)``.

        Once the chief has ended well the job is done: a task failing after it
        is recorded in ``late_failures``, not taken for a failed job (which
        would run it again from its start, its backup deleted by ``fit``).
        """
        chief_done = None
        while not stop.wait(POLL):
            for spec, proc in zip(self.specs, self.procs):
                code = proc.poll()
                if code is None or spec.name in self.late_failures:
                    continue
                if code != 0 or not spec.runs_command:
                    if chief_done is None:
                        return (code or 1), spec.name
                    if code != 0:
                        self.late_failures[spec.name] = code
                if spec.chief and chief_done is None:
                    chief_done = time.monotonic()
            if chief_done is not None and self._commands_done(chief_done):
                return 0, None
        return 128 + signal.SIGTERM, None

    def _commands_done(self, since):
        running = [p for s, p in zip(self.specs, self.procs) if s.runs_command and p.poll() is None]
        return not running or time.monotonic() - since > self.stop_timeout

    def stop(self, after_failure=False):
        """Stops every task still running: SIGTERM, SIGKILL after ``stop_timeout``.

        After a task of a synchronous job (every task runs the command) has
        failed, the others are not sent SIGTERM but left to end by themselves,
        as TensorFlow makes every surviving worker raise: a TensorFlow
        multi-worker task takes SIGTERM as a preemption notice and goes on, and
        a worker signalled so then failed only at TensorFlow's heartbeat
        timeout (about 10 s) instead of at once.
        """
        leave = after_failure and all(spec.runs_command for spec in self.specs)
        if not leave:
            for proc in self.procs:
                _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait(timeout=10)
        for reader in self.readers:
            reader.join(timeout=5)


def _signal_group(proc, sig):
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass


def _pump(stream, target, prefix):
    for line in iter(stream.readline, b""):
        target.write(prefix + line.decode(errors="replace"))
        target.flush()
    stream.close()
