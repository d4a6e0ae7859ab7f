"""A real TensorFlow cluster of OS processes on 127.0.0.1 (internal module).

Public names are re-exported by :mod:`tfdist_ext.cluster`.
"""

import atexit
import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref

from tfdist_ext.cluster._tf_config import PARENT_PID_ENV

HOST = "127.0.0.1"
_PACKAGE_PARENT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)
_DEVICE_RE = re.compile(rb"/job:[a-z_]+/replica:\d+/task:\d+/device:[A-Z_]+:\d+")
#: Running LocalClusters of this process, for strategies to find theirs.
_RUNNING = weakref.WeakSet()


class ClusterError(RuntimeError):
    """A task of the cluster failed to start, died, or did not answer."""


class ClusterTimeoutError(ClusterError, TimeoutError):
    """A wait on the cluster ran past its deadline."""


def free_port():
    """Returns a TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def ping(address, timeout=5.0):
    """Asks the TensorFlow server at ``address`` for its status over gRPC.

    Uses TensorFlow's own ``WorkerService/GetStatus`` call, so a reply means
    the task's gRPC server is up and serving, not merely that a port is open.

    Returns:
      The device names the task reports, e.g.
      ``["/job:worker/replica:0/task:0/device:CPU:0"]``.

    Raises:
      ClusterTimeoutError: no reply within ``timeout`` seconds.

    Example:
      >>> with LocalCluster(num_workers=1, num_ps=1) as cluster:  # doctest: +SKIP
      ...     ping(cluster.address("worker", 0))
      ['/job:worker/replica:0/task:0/device:CPU:0']
    """
    import grpc

    channel = grpc.insecure_channel(address)
    try:
        call = channel.unary_unary(
            "/tensorflow.WorkerService/GetStatus",
            request_serializer=lambda request: request,
            response_deserializer=lambda reply: reply,
        )
        reply = call(b"", timeout=timeout)
    except grpc.RpcError as e:
        raise ClusterTimeoutError(
            f"task at {address} did not answer within {timeout:.1f}s "
            f"({e.code().name})"
        ) from None
    finally:
        channel.close()
    return [d.decode() for d in _DEVICE_RE.findall(reply)]


class _Task:
    """One OS process running ``python -m tfdist_ext.server``."""

    def __init__(self, job, index, address, log_dir):
        self.job = job
        self.index = index
        self.address = address
        self.log_path = os.path.join(log_dir, f"{job}-{index}.log")
        self.process = None

    @property
    def name(self):
        return f"{self.job}:{self.index}"

    def start(self, tf_config, args, env):
        env = dict(env)
        env["TF_CONFIG"] = json.dumps(
            {"cluster": tf_config, "task": {"type": self.job, "index": self.index}}
        )
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tfdist_ext.server", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )

    def alive(self):
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines=15):
        try:
            with open(self.log_path, "rb") as f:
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def ready(self):
        marker = f"READY {self.name} ".encode()
        try:
            with open(self.log_path, "rb") as f:
                return marker in f.read()
        except OSError:
            return False

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


class LocalCluster:
    """A real TensorFlow cluster on this machine, one OS process per task.

    Each ``worker`` and ``ps`` task runs ``tf.distribute.Server`` (gRPC) in its
    own process, listening on a free port of 127.0.0.1. The ``chief`` task is
    the calling process: its address is reserved in the cluster spec and is
    taken up by whatever connects to the cluster from here (for example a
    ``DownpourStrategy`` built on :attr:`resolver`).

    Startup waits, with a deadline, until every task has answered a gRPC
    status request. Every process is stopped on exit, also when the body
    raises; a task whose parent dies exits by itself within a second.

    A strategy built on :attr:`resolver` (``DownpourStrategy``,
    ``SandblasterStrategy``) registers with the cluster; when the cluster
    stops, it first closes each of them (``strategy.close()``): their threads
    stop, the final parameters of their models come back to this process,
    and this process disconnects. After the block, the models work as plain
    single-process Keras models (``get_weights``, ``evaluate``, ``predict``,
    ``save``), and the script ends by itself without RPC errors.

    Args:
      num_workers: number of ``worker`` tasks (>= 1).
      num_ps: number of ``ps`` tasks (>= 0).
      chief: reserve a ``chief`` entry for the calling process.
      intra_op_threads: threads one op may use in each task (0: TF default).
      inter_op_threads: ops each task runs at once; default ``num_workers + 1``
        (TensorFlow's parameter-server tutorial sizing: with the default pool a
        loopback cluster on a small machine can stall).
      start_timeout: seconds to wait for all tasks to answer.
      env: extra environment variables for the task processes.
      devices_per_worker: CPU devices each ``worker`` task exposes
        (``/device:CPU:0`` ... ``CPU:k-1``), for model parallelism inside a
        replica.

    Example:
      >>> from tfdist_ext.cluster import LocalCluster
      >>> with LocalCluster(num_workers=2, num_ps=1) as cluster:  # doctest: +SKIP
      ...     print(cluster.cluster_spec.as_dict())
      ...     cluster.kill("worker", 1)
      ...     cluster.restart("worker", 1)
    """

    def __init__(
        self,
        num_workers=2,
        num_ps=1,
        *,
        chief=True,
        intra_op_threads=1,
        inter_op_threads=None,
        start_timeout=120.0,
        env=None,
        devices_per_worker=1,
    ):
        for name, value, low in (
            ("num_workers", num_workers, 1),
            ("num_ps", num_ps, 0),
            ("intra_op_threads", intra_op_threads, 0),
            ("devices_per_worker", devices_per_worker, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(
                    f"LocalCluster: {name} must be an integer >= {low}, got {value!r}"
                )
        if inter_op_threads is not None and (
            not isinstance(inter_op_threads, int) or inter_op_threads < 1
        ):
            raise ValueError(
                "LocalCluster: inter_op_threads must be a positive integer or "
                f"None, got {inter_op_threads!r}"
            )
        if not start_timeout or start_timeout <= 0:
            raise ValueError(
                f"LocalCluster: start_timeout must be > 0 seconds, got {start_timeout!r}"
            )
        self.num_workers = num_workers
        self.num_ps = num_ps
        self.start_timeout = float(start_timeout)
        self._inter_op = inter_op_threads or num_workers + 1
        self._intra_op = intra_op_threads
        self._extra_env = dict(env or {})
        self._devices_per_worker = devices_per_worker
        self._log_dir = tempfile.mkdtemp(prefix="tfdist-ext-cluster-")
        spec = {}
        if chief:
            spec["chief"] = [f"{HOST}:{free_port()}"]
        spec["worker"] = [f"{HOST}:{free_port()}" for _ in range(num_workers)]
        if num_ps:
            spec["ps"] = [f"{HOST}:{free_port()}" for _ in range(num_ps)]
        self._spec = spec
        self._tasks = {
            (job, i): _Task(job, i, address, self._log_dir)
            for job in ("worker", "ps")
            for i, address in enumerate(spec.get(job, ()))
        }
        self._started = False
        self._strategies = weakref.WeakSet()
        self._finalizer = weakref.finalize(
            self, _shutdown, self._strategies, list(self._tasks.values()), False)
        atexit.register(self._finalizer)

    # -- lifecycle -----------------------------------------------------------

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.stop()
            return False
        try:
            self.stop()
        except Exception as e:  # noqa: BLE001 - do not hide the error that ended the block
            logging.getLogger("tfdist_ext").warning("LocalCluster: while stopping: %s", e)
        return False

    def start(self):
        """Starts every task and waits until all answer (``start_timeout``)."""
        if self._started:
            raise ClusterError("LocalCluster.start: the cluster is already running")
        self._started = True
        _RUNNING.add(self)
        try:
            for task in self._tasks.values():
                task.start(self._spec, self._server_args(task.job), self._task_env())
            self._wait_ready(list(self._tasks.values()), self.start_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self):
        """Closes the strategies connected to the cluster, then stops every task
        process (SIGTERM, then SIGKILL); idempotent.

        Raises:
          ClusterError: a strategy could not bring its parameters back (its
            ``ps`` task had died); the tasks are stopped all the same.
        """
        _RUNNING.discard(self)
        _shutdown(self._strategies, list(self._tasks.values()))

    def kill(self, job, index, sig=signal.SIGKILL, timeout=10.0):
        """Kills one task's process (SIGKILL by default) and waits for it to die."""
        task = self._task(job, index)
        task.stop(sig=sig, timeout=timeout)

    def restart(self, job, index, timeout=None):
        """Starts a killed task again on the same address and waits until it answers."""
        task = self._task(job, index)
        if task.alive():
            task.stop()
        task.start(self._spec, self._server_args(job), self._task_env())
        self._wait_ready([task], timeout or self.start_timeout)

    @contextlib.contextmanager
    def throttle(self, job, index, slowdown, period=0.02):
        """Slows one task's process ``slowdown`` times, for the ``with`` block.

        A real, OS-level straggler: the process is stopped (SIGSTOP) for
        ``(1 - 1/slowdown)`` of every ``period`` seconds and continued
        (SIGCONT) for the rest, so everything it does -- computing, answering
        RPCs -- runs at ``1/slowdown`` of its speed. It is always continued
        when the block ends.

        Example:
          >>> with cluster.throttle("worker", 1, slowdown=4):  # doctest: +SKIP
          ...     model.fit(x, y, epochs=5)
        """
        if not slowdown >= 1.0:
            raise ValueError(f"LocalCluster.throttle: slowdown must be >= 1, got {slowdown!r}")
        if not period > 0:
            raise ValueError(f"LocalCluster.throttle: period must be > 0, got {period!r}")
        pid = self._task(job, index).process.pid
        running = period / slowdown
        done = threading.Event()

        def cycle():
            while not done.is_set():
                _signal(pid, signal.SIGSTOP)
                if done.wait(period - running):
                    break
                _signal(pid, signal.SIGCONT)
                done.wait(running)
            _signal(pid, signal.SIGCONT)

        thread = threading.Thread(target=cycle, name=f"throttle-{job}-{index}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join(timeout=5.0)
            _signal(pid, signal.SIGCONT)

    # -- inspection ----------------------------------------------------------

    @property
    def cluster_spec(self):
        """The cluster as a ``tf.train.ClusterSpec``."""
        import tensorflow as tf

        return tf.train.ClusterSpec(self._spec)

    @property
    def resolver(self):
        """A ``SimpleClusterResolver`` for the chief (this process)."""
        import tensorflow as tf

        task_type = "chief" if "chief" in self._spec else None
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            self.cluster_spec,
            master=self._spec["chief"][0] if task_type else "",
            task_type=task_type,
            task_id=0 if task_type else None,
            rpc_layer="grpc",
        )

    def tf_config(self, job, index):
        """The ``TF_CONFIG`` JSON text of one task of this cluster."""
        self._check_task(job, index)
        return json.dumps({"cluster": self._spec, "task": {"type": job, "index": index}})

    def address(self, job, index):
        """``host:port`` of one task."""
        self._check_task(job, index)
        return self._spec[job][index]

    def pid(self, job, index):
        """OS process id of one task (``None`` before start)."""
        process = self._task(job, index).process
        return process.pid if process else None

    def pids(self):
        """Process ids of every task process started so far."""
        return [t.process.pid for t in self._tasks.values() if t.process]

    def alive(self, job, index):
        """Whether the process of one task is running."""
        return self._task(job, index).alive()

    def ping(self, timeout=5.0):
        """Asks every task for its status; returns ``{"worker:0": [devices], ...}``.

        Raises ``ClusterTimeoutError`` naming the first task that does not
        answer within ``timeout`` seconds.
        """
        return {t.name: ping(t.address, timeout) for t in self._tasks.values()}

    def log(self, job, index):
        """The last lines a task printed (for diagnosing failures)."""
        return self._task(job, index).log_tail()

    # -- internals -----------------------------------------------------------

    def _check_task(self, job, index):
        if job not in self._spec or not 0 <= index < len(self._spec[job]):
            raise ValueError(
                f"LocalCluster: no task {job}:{index} (cluster: "
                + ", ".join(f"{j}x{len(a)}" for j, a in self._spec.items())
                + ")"
            )

    def _task(self, job, index):
        self._check_task(job, index)
        if job == "chief":
            raise ValueError("LocalCluster: the chief is the calling process")
        return self._tasks[(job, index)]

    def _server_args(self, job):
        devices = self._devices_per_worker if job == "worker" else 1
        return [
            "--intra-op-threads", str(self._intra_op),
            "--inter-op-threads", str(self._inter_op),
            "--cpu-devices", str(devices),
        ]

    def _task_env(self):
        env = dict(os.environ)
        env.update(self._extra_env)
        env[PARENT_PID_ENV] = str(os.getpid())
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        path = env.get("PYTHONPATH")
        env["PYTHONPATH"] = _PACKAGE_PARENT + (os.pathsep + path if path else "")
        return env

    def _wait_ready(self, tasks, timeout):
        deadline = time.monotonic() + timeout
        pending = list(tasks)
        while pending:
            for task in list(pending):
                if not task.alive():
                    raise ClusterError(
                        f"LocalCluster: task {task.name} exited with status "
                        f"{task.process.returncode} before it was ready; its "
                        f"output:\n{task.log_tail()}"
                    )
                if task.ready():
                    remaining = max(0.5, deadline - time.monotonic())
                    try:
                        ping(task.address, timeout=min(5.0, remaining))
                    except ClusterTimeoutError:
                        continue
                    pending.remove(task)
            if pending and time.monotonic() > deadline:
                names = ", ".join(t.name for t in pending)
                raise ClusterTimeoutError(
                    f"LocalCluster: task(s) {names} did not answer within "
                    f"{timeout:.0f}s (start_timeout)"
                )
            if pending:
                time.sleep(0.1)


def _signal(pid, sig):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def attach_to_local_cluster(cluster_resolver, strategy):
    """Registers ``strategy`` with the running LocalCluster it connects to, if any,
    so that the cluster closes it before stopping. Returns that cluster or ``None``."""
    spec = {job: list(addresses)
            for job, addresses in cluster_resolver.cluster_spec().as_dict().items()}
    for cluster in list(_RUNNING):
        if cluster._spec == spec:
            cluster._strategies.add(strategy)
            return cluster
    return None


def _shutdown(strategies, tasks, raise_errors=True):
    """Closes every strategy, then stops the tasks; the first error a strategy
    raised is re-raised at the end (logged instead at garbage collection or exit)."""
    errors = []
    try:
        for strategy in list(strategies):
            try:
                strategy.close()
            except ClusterError as e:
                errors.append(e)
        strategies.clear()
    finally:
        _stop_all(tasks)
    if errors and raise_errors:
        raise errors[0]
    for error in errors:
        logging.getLogger("tfdist_ext").warning("%s", error)


def _stop_all(tasks):
    for task in tasks:
        if task.alive():
            try:
                os.killpg(task.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for task in tasks:
        task.stop(sig=signal.SIGKILL, timeout=10.0)
