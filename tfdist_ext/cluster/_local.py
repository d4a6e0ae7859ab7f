"""A real TensorFlow cluster of OS processes on this machine (internal module).

Public names are re-exported by :mod:`tfdist_ext.cluster`.
"""

import atexit
import json
import logging
import os
import signal
import subprocess
import sys
import time
import weakref
from typing import TYPE_CHECKING

from tfdist_ext.cluster import _netns
from tfdist_ext.cluster import _network
from tfdist_ext.cluster import _throttle
from tfdist_ext.cluster._process import ClusterError
from tfdist_ext.cluster._process import ClusterTimeoutError
from tfdist_ext.cluster._process import Task
from tfdist_ext.cluster._process import free_port  # noqa: F401 - tfdist_ext.cluster's
from tfdist_ext.cluster._process import ping
from tfdist_ext.cluster._process import stop_all
from tfdist_ext.cluster._tf_config import PARENT_PID_ENV
from tfdist_ext.cluster._tf_config import set_task_env_defaults

_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PROGRESS_AFTER = 2.0
#: Running LocalClusters of this process, for strategies to find theirs.
_RUNNING = weakref.WeakSet()
_logger = logging.getLogger("tfdist_ext")

if TYPE_CHECKING:
    import tensorflow as tf


class LocalCluster:
    """A real TensorFlow cluster on this machine, one OS process per task.

    Each ``worker`` and ``ps`` task runs a ``tf.distribute.Server`` in its own
    process; the ``chief`` is the calling process. Where the OS allows it, the
    tasks run in private network namespaces that the host's network cannot
    reach (``isolated``), else on 127.0.0.1 with a warning. Stopping closes the
    strategies built on :attr:`resolver`, whose models stay usable as plain
    Keras models. Details: ``docs/api/guides/multi_worker.rst``.

    Args:
      num_workers: number of ``worker`` tasks (>= 1).
      num_ps: number of ``ps`` tasks (>= 0).
      chief: reserve a ``chief`` entry for the calling process.
      intra_op_threads: threads one op may use in each task (0: TF default).
      inter_op_threads: ops each task runs at once; default ``num_workers + 1``.
      start_timeout: seconds to wait for all tasks to answer.
      env: extra environment variables for the task processes.
      devices_per_worker: CPU devices each ``worker`` task exposes.
      bandwidth: rate limit of each task's link, e.g. ``"100mbit"`` or an int
        in bits/s (the ``bandwidth`` attribute); implies ``isolated``.
      isolated: ``None``: isolate when the OS allows it; ``True``: isolate or
        raise; ``False``: run on 127.0.0.1. The attribute tells the outcome.
      command: run this command (a list) as each ``worker`` task instead of a
        server, with its ``TF_CONFIG``; see :meth:`wait` and :meth:`output`.
      verbose: 1: report a slow start on standard error; 0: silent.

    Raises:
      ValueError: a bad argument, e.g. ``bandwidth="fast"``.
      ClusterError: isolation is required but this process cannot have it.

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
        _check_arguments(
            num_workers,
            num_ps,
            intra_op_threads,
            devices_per_worker,
            inter_op_threads,
            start_timeout,
            command,
        )
        self.num_workers = num_workers
        self.num_ps = num_ps
        self.start_timeout = float(start_timeout)
        self.bandwidth = None if bandwidth is None else _netns.parse_bandwidth(bandwidth)
        self._hub, self._why_loopback = _network.choose_hub(isolated, self.bandwidth)
        self.isolated = self._hub is not None
        self.verbose = verbose
        self._inter_op = inter_op_threads or num_workers + 1
        self._intra_op = intra_op_threads
        self._extra_env = dict(env or {})
        self._devices_per_worker = devices_per_worker
        self._command = list(command) if command else None
        self._spec = _network.new_spec(self._hub, chief, num_workers, num_ps)
        self._tasks = {
            (job, i): Task(job, i, address)
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
        _network.claim_network_kind("isolated" if self.isolated else "loopback")
        self._started = True
        _RUNNING.add(self)
        try:
            if self.isolated:
                _network.enter_hub(self._hub)
                self._in_hub = True
            else:
                _network.warn_open_ports(self._spec, self._why_loopback)
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
                _network.leave_hub(self._hub)

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
        return _throttle.throttled(self._task(job, index).process.pid, slowdown, period)

    # -- inspection ----------------------------------------------------------

    @property
    def cluster_spec(self) -> "tf.train.ClusterSpec":
        """The cluster as a ``tf.train.ClusterSpec``."""
        # TensorFlow loads only when used: the CLI, launchers and cluster start without it.
        import tensorflow as tf

        return tf.train.ClusterSpec(self._spec)

    @property
    def resolver(self) -> "tf.distribute.cluster_resolver.SimpleClusterResolver":
        """A ``SimpleClusterResolver`` for the chief (this process)."""
        # TensorFlow loads only when used: the CLI, launchers and cluster start without it.
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

    def _describe(self):
        tasks = " + ".join(f"{len(self._spec[j])} {j}" for j in ("worker", "ps") if j in self._spec)
        network = "isolated network" if self.isolated else "127.0.0.1"
        if self.bandwidth:
            network += f", {_network.format_rate(self.bandwidth)} links"
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
        stop_all(tasks)
    if errors and raise_errors:
        raise errors[0]
    for error in errors:
        logging.getLogger("tfdist_ext").warning("%s", error)


def _disconnect_from(spec):
    """Makes this process's eager runtime local again if ``connect`` joined it
    to the cluster of ``spec``. Otherwise, once the tasks have stopped,
    TensorFlow tries to delete its functions on them at exit: an error, and a
    wait for a connection timeout, per task."""
    if not spec or "tensorflow" not in sys.modules:
        return  # nothing can be connected without TensorFlow loaded
    # The door (and TensorFlow) loads only when a connection may exist.
    from tfdist_ext import _integration

    server_def = _integration.eager_context.get_server_def()
    if server_def is None:
        return
    connected = {
        job.name: [job.tasks[i] for i in sorted(job.tasks)] for job in server_def.cluster.job
    }
    if all(connected.get(job) == list(spec[job]) for job in ("worker", "ps") if spec.get(job)):
        _integration.disconnect_from_cluster()


def _check_arguments(
    num_workers,
    num_ps,
    intra_op_threads,
    devices_per_worker,
    inter_op_threads,
    start_timeout,
    command,
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
        raise ValueError(f"LocalCluster: start_timeout must be > 0 seconds, got {start_timeout!r}")
    if command is not None and (
        isinstance(command, str) or not command or not all(isinstance(a, str) for a in command)
    ):
        raise ValueError(
            "LocalCluster: command must be a non-empty list of strings, e.g. "
            f"[sys.executable, 'train.py'], got {command!r}"
        )
