"""A real TensorFlow cluster of OS processes on this machine (internal module).

Public names are re-exported by :mod:`tfdist_ext.cluster`.
"""

import atexit
import collections
import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING

from tfdist_ext.cluster import _netns
from tfdist_ext.cluster._tf_config import PARENT_PID_ENV
from tfdist_ext.cluster._tf_config import set_task_env_defaults

HOST = "127.0.0.1"
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_DEVICE_RE = re.compile(rb"/job:[a-z_]+/replica:\d+/task:\d+/device:[A-Z_]+:\d+")
_LOG_LINES = 2000
_PROGRESS_AFTER = 2.0
#: Running LocalClusters of this process, for strategies to find theirs.
_RUNNING = weakref.WeakSet()
#: The kind of cluster network this process uses ("isolated" or "loopback").
_NETWORK = {"kind": None, "warned": False}
_logger = logging.getLogger("tfdist_ext")

if TYPE_CHECKING:
    import tensorflow as tf


class ClusterError(RuntimeError):
    """A task of the cluster failed to start, died, or did not answer."""


class ClusterTimeoutError(ClusterError, TimeoutError):
    """A wait on the cluster ran past its deadline."""


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


class _Task:
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


class LocalCluster:
    """A real TensorFlow cluster on this machine, one OS process per task.

    Each ``worker`` and ``ps`` task runs ``tf.distribute.Server`` (gRPC) in its
    own process. The ``chief`` task is the calling process: its address is
    reserved in the cluster spec and is taken up by whatever connects to the
    cluster from here (for example a ``DownpourStrategy`` built on
    :attr:`resolver`).

    **Network.** TensorFlow's servers accept anyone who can connect and run
    any graph they are sent (see SECURITY.md). Where the OS allows it (root or
    the ``CAP_NET_ADMIN`` and ``CAP_SYS_ADMIN`` capabilities, and the ``ip``
    and ``tc`` commands), the cluster is *isolated*: each task runs in its own
    new network namespace, linked by a virtual Ethernet pair to a bridge in a
    private "hub" namespace of this process, with addresses ``10.213.x.y``;
    the thread that calls :meth:`start` (and every thread it creates) enters
    the hub until :meth:`stop`, so the chief's own server does not listen in
    the host's namespace either. No port of the cluster is reachable from the
    host's network, and the namespaces disappear with their processes, even
    after a ``kill -9``. Otherwise the tasks listen on 127.0.0.1 and the
    cluster logs one warning per process naming the open ports. A process
    uses one kind of cluster network, chosen by its first cluster (TensorFlow's
    and gRPC's threads stay in the network they were created in): with
    ``isolated=None`` later clusters follow it, and an explicit other choice is
    refused. Use the cluster from the thread that started it (its network is
    that thread's).

    ``bandwidth`` limits each task's link, both directions, with a ``tc``
    token bucket: a slow network on one machine, where the methods of this
    package pay off.

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
      env: extra environment variables for the task processes. Unless set
        here or in this process, a task gets ``TF_CPP_MIN_LOG_LEVEL=2`` and
        ``TF_CPU_ALLOCATOR_USE_BFC=true`` (TensorFlow's pooling allocator
        on the CPU: large tensors without a page fault per 4 KB; pass
        ``"false"`` for the default allocator).
      devices_per_worker: CPU devices each ``worker`` task exposes
        (``/device:CPU:0`` ... ``CPU:k-1``), for model parallelism inside a
        replica.
      bandwidth: rate limit of each task's link, e.g. ``"100mbit"``,
        ``"1gbit"``, ``"500kbit"`` or an int in bits/s; implies ``isolated``.
        The rate counts whole Ethernet frames: TCP payload gets about 95% of it.
      isolated: ``None`` (default): isolate when the OS allows it, else run on
        127.0.0.1 with a warning; ``True``: isolate or raise at construction;
        ``False``: run on 127.0.0.1.
      command: run this command (a list, e.g. ``[sys.executable, "train.py"]``)
        as each ``worker`` task instead of a TensorFlow server, with its
        ``TF_CONFIG`` set: an SPMD program such as a ``MultiWorkerMirroredStrategy``
        script. :meth:`start` does not wait for such tasks; :meth:`wait`
        collects their exit codes and :meth:`output` their output.
      verbose: 1 (default): one line on standard error when the start takes
        more than 2 seconds, and one when it is done; 0: silent.

    Attributes:
      isolated: whether the cluster runs in its own network namespaces.
      bandwidth: the rate limit of each task's link in bits/s, or ``None``.

    Raises:
      ValueError: a bad argument, e.g. ``bandwidth="fast"``.
      ClusterError: ``isolated=True`` or ``bandwidth`` without what isolation
        needs (the message says what is missing), or a process that already
        used the other kind of cluster network.

    Example:
      >>> from tfdist_ext.cluster import LocalCluster
      >>> with LocalCluster(num_workers=2, num_ps=1, bandwidth="100mbit") as cluster:  # doctest: +SKIP
      ...     print(cluster.cluster_spec.as_dict())
      ...     cluster.kill("worker", 1)
      ...     cluster.restart("worker", 1)
    """

    def __init__(
        self,
        num_workers: int = 2,
        num_ps: int = 1,
        *,
        chief: bool = True,
        intra_op_threads: int = 1,
        inter_op_threads: int | None = None,
        start_timeout: float = 120.0,
        env: dict[str, str] | None = None,
        devices_per_worker: int = 1,
        bandwidth: str | int | None = None,
        isolated: bool | None = None,
        command: list[str] | None = None,
        verbose: int = 1,
    ):
        for name, value, low in (
            ("num_workers", num_workers, 1),
            ("num_ps", num_ps, 0),
            ("intra_op_threads", intra_op_threads, 0),
            ("devices_per_worker", devices_per_worker, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"LocalCluster: {name} must be an integer >= {low}, got {value!r}")
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
        if command is not None and (
            isinstance(command, str) or not command or not all(isinstance(a, str) for a in command)
        ):
            raise ValueError(
                "LocalCluster: command must be a non-empty list of strings, e.g. "
                f"[sys.executable, 'train.py'], got {command!r}"
            )
        self.num_workers = num_workers
        self.num_ps = num_ps
        self.start_timeout = float(start_timeout)
        self.bandwidth = None if bandwidth is None else _netns.parse_bandwidth(bandwidth)
        self._hub = self._choose_network(isolated, self.bandwidth)
        self.isolated = self._hub is not None
        self.verbose = verbose
        self._inter_op = inter_op_threads or num_workers + 1
        self._intra_op = intra_op_threads
        self._extra_env = dict(env or {})
        self._devices_per_worker = devices_per_worker
        self._command = list(command) if command else None
        self._spec = self._make_spec(chief, num_workers, num_ps)
        self._tasks = {
            (job, i): _Task(job, i, address)
            for job in ("worker", "ps")
            for i, address in enumerate(self._spec.get(job, ()))
        }
        self._started = False
        self._in_hub = False
        self._strategies = weakref.WeakSet()
        self._finalizer = weakref.finalize(
            self, _shutdown, self._strategies, list(self._tasks.values()), False, self._spec
        )
        atexit.register(self._finalizer)

    def _choose_network(self, isolated, bandwidth):
        """The hub to isolate the cluster in, or ``None`` for 127.0.0.1."""
        self._why_loopback = "isolated=False"
        if isolated is not None and not isinstance(isolated, bool):
            raise ValueError(
                f"LocalCluster: isolated must be None, True or False, got {isolated!r}"
            )
        if isolated is False and bandwidth:
            raise ValueError(
                "LocalCluster: bandwidth needs an isolated cluster (each task's link "
                "is rate-limited in its own network namespace); drop isolated=False"
            )
        if isolated is None and not bandwidth and _NETWORK["kind"] == "loopback":
            return None  # the default follows this process's first cluster
        missing = _netns.missing_requirements()
        hub = None
        if not missing and isolated is not False:
            try:
                hub = _netns.hub()
            except (_netns.NetworkError, OSError) as e:
                missing = [f"a private network namespace, which this system refused: {e}"]
        if missing and (isolated or bandwidth):
            wanted = "bandwidth=..." if bandwidth else "isolated=True"
            raise ClusterError(
                f"LocalCluster({wanted}) runs each task in its own network namespace, "
                f"which needs {', '.join(missing)}. Run as root (or grant the "
                "capabilities), or use LocalCluster(isolated=False) for a cluster on "
                "127.0.0.1 without link limits (see SECURITY.md)."
            )
        kind = "isolated" if hub else "loopback"
        if missing:
            self._why_loopback = "; ".join(missing)
        _check_network_kind(kind)
        return hub

    def _make_spec(self, chief, num_workers, num_ps):
        if self.isolated:
            chief_address = f"{_netns.CHIEF_IP}:{self._hub.free_port()}"

            def task_address():
                return f"{self._hub.new_address()}:{_netns.TASK_PORT}"
        else:
            chief_address = f"{HOST}:{free_port()}"

            def task_address():
                return f"{HOST}:{free_port()}"

        spec = {}
        if chief:
            spec["chief"] = [chief_address]
        spec["worker"] = [task_address() for _ in range(num_workers)]
        if num_ps:
            spec["ps"] = [task_address() for _ in range(num_ps)]
        return spec

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
            _logger.warning("LocalCluster: while stopping: %s", e)
        return False

    def start(self) -> "LocalCluster":
        """Starts every task and waits until all answer (``start_timeout``).

        With an isolated cluster, the calling thread enters the cluster's
        network until :meth:`stop`.
        """
        if self._started:
            raise ClusterError("LocalCluster.start: the cluster is already running")
        kind = "isolated" if self.isolated else "loopback"
        _check_network_kind(kind)
        self._started = True
        _NETWORK["kind"] = kind
        _RUNNING.add(self)
        try:
            if self.isolated:
                _enter_hub(self._hub)
                self._in_hub = True
            else:
                self._warn_open_ports()
            for task in self._tasks.values():
                self._start_task(task)
            servers = [t for t in self._tasks.values() if not (self._command and t.job == "worker")]
            self._wait_ready(servers, self.start_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Closes the strategies connected to the cluster, then stops every task
        process (SIGTERM, then SIGKILL); idempotent.

        Raises:
          ClusterError: a strategy could not bring its parameters back (its
            ``ps`` task had died); the tasks are stopped all the same.
        """
        _RUNNING.discard(self)
        try:
            _shutdown(self._strategies, list(self._tasks.values()), spec=self._spec)
        finally:
            if self._in_hub:
                self._in_hub = False
                _leave_hub(self._hub)

    def wait(self, timeout: float) -> dict[str, int]:
        """Waits until every ``worker`` task has exited; returns their exit codes.

        For a cluster started with ``command``: the SPMD program's exit status
        per worker, e.g. ``{"worker:0": 0, "worker:1": 0}``; :meth:`output`
        gives what each printed.

        Raises:
          ClusterTimeoutError: a worker still runs after ``timeout`` seconds
            (the cluster keeps running; ``stop()`` ends it).

        Example:
          >>> cluster = LocalCluster(num_workers=2, num_ps=0, chief=False,  # doctest: +SKIP
          ...                        command=[sys.executable, "train.py"])
          >>> with cluster:  # doctest: +SKIP
          ...     codes = cluster.wait(timeout=300)
        """
        if not self._started:
            raise ClusterError("LocalCluster.wait: the cluster was not started")
        deadline = time.monotonic() + timeout
        workers = [t for t in self._tasks.values() if t.job == "worker"]
        for task in workers:
            try:
                task.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise ClusterTimeoutError(
                    f"LocalCluster.wait: task {task.name} still runs after {timeout:.0f}s; "
                    f"its output ends:\n{task.log_tail()}"
                ) from None
            task.drain()
        return {t.name: t.process.returncode for t in workers}

    def kill(self, job: str, index: int, sig: int = signal.SIGKILL, timeout: float = 10.0) -> None:
        """Kills one task's process (SIGKILL by default) and waits for it to die."""
        task = self._task(job, index)
        task.stop(sig=sig, timeout=timeout)

    def restart(self, job: str, index: int, timeout: float | None = None) -> None:
        """Starts a killed task again on the same address and waits until it answers."""
        task = self._task(job, index)
        if task.alive():
            task.stop()
        self._start_task(task)
        self._wait_ready([task], timeout or self.start_timeout)

    @contextlib.contextmanager
    def throttle(self, job: str, index: int, slowdown: float, period: float = 0.02):
        """Slows one task's process ``slowdown`` times, for the ``with`` block.

        A real, OS-level straggler: the process is stopped (SIGSTOP) for
        ``(1 - 1/slowdown)`` of every ``period`` seconds and continued
        (SIGCONT) for the rest, so everything it does -- computing, answering
        RPCs -- runs at ``1/slowdown`` of its speed. It is always continued
        when the block ends. The stop/continue cycle runs in a small process
        of its own, not in a thread of this one, so nothing this process
        does while holding the GIL (a TensorFlow call that waits for the
        stopped task) can leave the task stopped; that process also
        continues the task and exits if this one dies.

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
            _signal(pid, signal.SIGCONT)

    # -- inspection ----------------------------------------------------------

    @property
    def cluster_spec(self) -> "tf.train.ClusterSpec":
        """The cluster as a ``tf.train.ClusterSpec``."""
        import tensorflow as tf

        return tf.train.ClusterSpec(self._spec)

    @property
    def resolver(self) -> "tf.distribute.cluster_resolver.SimpleClusterResolver":
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

    def tf_config(self, job: str, index: int) -> str:
        """The ``TF_CONFIG`` JSON text of one task of this cluster."""
        self._check_task(job, index)
        return json.dumps({"cluster": self._spec, "task": {"type": job, "index": index}})

    def address(self, job: str, index: int) -> str:
        """``host:port`` of one task."""
        self._check_task(job, index)
        return self._spec[job][index]

    def pid(self, job: str, index: int) -> int | None:
        """OS process id of one task (``None`` before start)."""
        process = self._task(job, index).process
        return process.pid if process else None

    def pids(self) -> list[int]:
        """Process ids of every task process started so far."""
        return [t.process.pid for t in self._tasks.values() if t.process]

    def alive(self, job: str, index: int) -> bool:
        """Whether the process of one task is running."""
        return self._task(job, index).alive()

    def ping(self, timeout: float = 5.0) -> dict[str, list[str]]:
        """Asks every task for its status; returns ``{"worker:0": [devices], ...}``.

        Raises ``ClusterTimeoutError`` naming the first task that does not
        answer within ``timeout`` seconds.
        """
        return {t.name: ping(t.address, timeout) for t in self._tasks.values()}

    def log(self, job: str, index: int) -> str:
        """The last lines a task printed (for diagnosing failures)."""
        return self._task(job, index).log_tail()

    def output(self, job: str, index: int) -> str:
        """Everything a task printed (its last 2000 lines), kept in memory."""
        return self._task(job, index).output()

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

    def _start_task(self, task):
        task.start(self._argv(task.job), self._spec, self._task_env(), self._spawn)

    def _spawn(self, task, popen):
        if not self.isolated:
            return popen()
        try:
            process, task.namespace = self._hub.spawn(
                task.address.split(":")[0], self.bandwidth, popen, task.namespace
            )
            return process
        except (_netns.NetworkError, OSError) as e:
            raise ClusterError(
                f"LocalCluster: could not link task {task.name} to the cluster's network: {e}"
            ) from None

    def _argv(self, job):
        if self._command and job == "worker":
            return self._command
        devices = self._devices_per_worker if job == "worker" else 1
        return [
            sys.executable,
            "-m",
            "tfdist_ext.server",
            "--intra-op-threads",
            str(self._intra_op),
            "--inter-op-threads",
            str(self._inter_op),
            "--cpu-devices",
            str(devices),
            "--no-warning",
        ]

    def _warn_open_ports(self):
        if _NETWORK["warned"]:
            return
        _NETWORK["warned"] = True
        ports = ", ".join(a.rsplit(":", 1)[1] for addrs in self._spec.values() for a in addrs)
        _logger.warning(
            "LocalCluster: this cluster's TensorFlow servers listen on ports %s of "
            "every interface without authentication and run any graph sent to them; "
            "anyone who can reach this machine can read and write its files. This "
            "process cannot isolate the cluster (%s). See SECURITY.md.",
            ports,
            self._why_loopback,
        )

    def _describe(self):
        tasks = " + ".join(f"{len(self._spec[j])} {j}" for j in ("worker", "ps") if j in self._spec)
        network = "isolated network" if self.isolated else "127.0.0.1"
        if self.bandwidth:
            network += f", {_format_rate(self.bandwidth)} links"
        return f"{tasks} ({network})"

    def _task_env(self):
        env = dict(os.environ)
        env.update(self._extra_env)
        env[PARENT_PID_ENV] = str(os.getpid())
        set_task_env_defaults(env)
        path = env.get("PYTHONPATH")
        env["PYTHONPATH"] = _PACKAGE_PARENT + (os.pathsep + path if path else "")
        return env

    def _wait_ready(self, tasks, timeout):
        start = time.monotonic()
        deadline = start + timeout
        pending = list(tasks)
        announced = False
        while pending:
            for task in list(pending):
                if not task.alive():
                    task.drain()
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
            if (
                pending
                and not announced
                and self.verbose
                and (time.monotonic() - start > _PROGRESS_AFTER)
            ):
                announced = True
                print(f"LocalCluster: starting {self._describe()} ...", file=sys.stderr, flush=True)
            if pending:
                time.sleep(0.1)
        if announced:
            print(
                f"LocalCluster: ready in {time.monotonic() - start:.1f}s",
                file=sys.stderr,
                flush=True,
            )


def _check_network_kind(kind):
    if _NETWORK["kind"] not in (None, kind):
        raise ClusterError(
            f"LocalCluster: this process already ran a cluster with "
            f"isolated={_NETWORK['kind'] == 'isolated'}; one with "
            f"isolated={kind == 'isolated'} cannot follow it (the TensorFlow and gRPC "
            "threads of this process live in the first one's network). Use one kind "
            "per process: pass the same isolated=... to every LocalCluster, or run "
            "this one in a new process."
        )


def _format_rate(bits_per_second):
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits_per_second >= scale:
            return f"{bits_per_second / scale:g}{unit}"
    return f"{bits_per_second}bit"


_HUB_ENTRIES = {"count": 0}
_HUB_ENTRIES_LOCK = threading.Lock()


def _enter_hub(hub):
    """The calling thread (and the threads it creates from now on: TensorFlow's
    and gRPC's) joins the isolated clusters' network."""
    with _HUB_ENTRIES_LOCK:
        if _HUB_ENTRIES["count"] == 0:
            hub.enter()
        _HUB_ENTRIES["count"] += 1


def _leave_hub(hub):
    with _HUB_ENTRIES_LOCK:
        _HUB_ENTRIES["count"] -= 1
        if _HUB_ENTRIES["count"] == 0:
            hub.leave()


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


def _signal(pid, sig):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def attach_to_local_cluster(cluster_resolver, strategy):
    """Registers ``strategy`` with the running LocalCluster it connects to, if any,
    so that the cluster closes it before stopping. Returns that cluster or ``None``."""
    spec = {
        job: list(addresses) for job, addresses in cluster_resolver.cluster_spec().as_dict().items()
    }
    for cluster in list(_RUNNING):
        if cluster._spec == spec:
            cluster._strategies.add(strategy)
            return cluster
    return None


def _shutdown(strategies, tasks, raise_errors=True, spec=None):
    """Closes every strategy and this process's own connection (``connect``),
    then stops the tasks; the first error a strategy raised is re-raised at
    the end (logged instead at garbage collection or exit)."""
    errors = []
    try:
        for strategy in list(strategies):
            try:
                strategy.close()
            except ClusterError as e:
                errors.append(e)
        strategies.clear()
        _disconnect_from(spec)
    finally:
        _stop_all(tasks)
    if errors and raise_errors:
        raise errors[0]
    for error in errors:
        logging.getLogger("tfdist_ext").warning("%s", error)


def _disconnect_from(spec):
    """Makes this process's eager runtime local again if ``connect`` joined it
    to the cluster of ``spec``. Otherwise, once the tasks have stopped,
    TensorFlow tries to delete its functions on them at exit: an error and a
    3 s connection timeout per task."""
    if not spec or "tensorflow" not in sys.modules:
        return  # nothing can be connected without TensorFlow loaded
    from tfdist_ext import _integration

    server_def = _integration.eager_context.get_server_def()
    if server_def is None:
        return
    connected = {
        job.name: [job.tasks[i] for i in sorted(job.tasks)] for job in server_def.cluster.job
    }
    if all(connected.get(job) == list(spec[job]) for job in ("worker", "ps") if spec.get(job)):
        _integration.disconnect_from_cluster()


def _stop_all(tasks):
    for task in tasks:
        if task.alive():
            try:
                os.killpg(task.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for task in tasks:
        task.stop(sig=signal.SIGKILL, timeout=10.0)
        task.close_namespace()
