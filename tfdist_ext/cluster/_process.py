"""The OS processes of a LocalCluster (internal): start, read, signal, stop."""

import collections
import json
import os
import re
import signal
import socket
import subprocess
import threading

HOST = "127.0.0.1"
_DEVICE_RE = re.compile(rb"/job:[a-z_]+/replica:\d+/task:\d+/device:[A-Z_]+:\d+")
_LOG_LINES = 2000


class ClusterError(RuntimeError):
    """A task of the cluster failed to start, died, or did not answer."""


class ClusterTimeoutError(ClusterError, TimeoutError):
    """A wait on the cluster ran past its deadline."""


# What TensorFlow's gRPC server logs, and raises, when another process holds its port.
PORT_TAKEN_LOG = (b"Failed to add port to server", b"Could not start gRPC server")


def port_taken(error):
    """Whether ``error`` (a ``tf.errors.OpError``) says this process could not
    start its gRPC server because another process holds the port."""
    return "Could not start gRPC server" in getattr(error, "message", str(error))


def free_port():
    """Returns a TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def ping(address, timeout=5.0, wait=False):
    """Asks the TensorFlow server at ``address`` for its status over gRPC.

    Uses TensorFlow's own ``WorkerService/GetStatus`` call, so a reply means
    the task's gRPC server is up and serving, not merely that a port is open.

    Returns:
      The device names the task reports, e.g.
      ``["/job:worker/replica:0/task:0/device:CPU:0"]``.

    With ``wait``, a task that does not listen yet is waited for until the
    deadline (a task started at the same moment as its peers, under ``srun``
    or as a Job's pods); without it, a refused connection fails at once.

    Raises:
      ClusterTimeoutError: no reply within ``timeout`` seconds.

    Example:
      >>> with LocalCluster(num_workers=1, num_ps=1) as cluster:  # doctest: +SKIP
      ...     ping(cluster.address("worker", 0))
      ['/job:worker/replica:0/task:0/device:CPU:0']
    """
    # gRPC loads with TensorFlow; a task's launcher starts without either.
    import grpc

    channel = grpc.insecure_channel(address)
    try:
        call = channel.unary_unary(
            "/tensorflow.WorkerService/GetStatus",
            request_serializer=lambda request: request,
            response_deserializer=lambda reply: reply,
        )
        reply = call(b"", timeout=timeout, wait_for_ready=wait)
    except grpc.RpcError as e:
        raise ClusterTimeoutError(
            f"task at {address} did not answer within {timeout:.1f}s ({e.code().name})"
        ) from None
    finally:
        channel.close()
    return [d.decode() for d in _DEVICE_RE.findall(reply)]


class Task:
    """One OS process of the cluster (``tfdist-ext server`` or a user's command);
    its output is kept in memory, never in a file."""

    def __init__(self, job, index, address):
        self.job = job
        self.index = index
        self.address = address
        self.process = None
        self.namespace = None  # fd of its network namespace, when isolated
        self._lines = collections.deque(maxlen=_LOG_LINES)
        self._ready = threading.Event()

    @property
    def name(self):
        return f"{self.job}:{self.index}"

    def start(self, argv, tf_config, env, spawn):
        env = dict(env)
        env["TF_CONFIG"] = json.dumps(
            {"cluster": tf_config, "task": {"type": self.job, "index": self.index}}
        )
        self._lines.clear()
        self._ready.clear()
        self.process = spawn(
            self,
            lambda: subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            ),
        )
        self._reader = threading.Thread(
            target=self._read,
            args=(self.process.stdout,),
            name=f"tfdist-ext-log-{self.job}-{self.index}",
            daemon=True,
        )
        self._reader.start()

    def drain(self, timeout=5.0):
        """Waits until the output of the exited process has been read."""
        self._reader.join(timeout)

    def _read(self, stream):
        marker = f"READY {self.name} ".encode()
        with stream:
            for line in stream:
                if line.startswith(marker):
                    self._ready.set()
                self._lines.append(line.decode(errors="replace").rstrip("\n"))

    def alive(self):
        return self.process is not None and self.process.poll() is None

    def output(self):
        return "\n".join(self._lines)

    def log_tail(self, lines=15):
        return "\n".join(list(self._lines)[-lines:])

    def ready(self):
        return self._ready.is_set()

    def close_namespace(self):
        if self.namespace is not None:
            os.close(self.namespace)
            self.namespace = None

    def stop(self, sig=signal.SIGTERM, timeout=10.0):
        if self.process is None:
            return
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, sig)
                # A stopped task (see LocalCluster.throttle) acts on the
                # signal only once continued.
                os.killpg(self.process.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout)


def signal_quietly(pid, sig):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def stop_all(tasks):
    for task in tasks:
        if task.alive():
            try:
                os.killpg(task.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for task in tasks:
        task.stop(sig=signal.SIGKILL, timeout=10.0)
        task.close_namespace()
