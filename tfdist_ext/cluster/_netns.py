"""Private network namespaces for LocalCluster (internal).

Layout, per process::

    host namespace (untouched: no address, interface or sysctl is added)
      |  the calling thread enters the hub with setns() during a cluster
    hub namespace  br0 10.213.0.1/16  (the chief)  -- unnamed, kept by an fd
      |  veth pair per task (hub end: a port of br0; task end: eth0)
    task namespace  eth0 10.213.x.y/16  (one per task process, unnamed)

Every namespace is unnamed and lives only while a process is in it or holds
its file descriptor: the hub and the task namespaces are held by this process
(a task's namespace, its "machine", outlives a killed task process until the
cluster stops, so the dead task's address refuses connections). Nothing is
left behind when this process dies, however it dies. A rate limit is a ``tc`` token
bucket (``tbf``) on both ends of a task's veth, so each task's link is
limited in both directions.
"""

import ctypes
import itertools
import os
import re
import shutil
import socket
import subprocess
import threading

CLONE_NEWNET = 0x40000000
CAP_NET_ADMIN = 12
CAP_SYS_ADMIN = 21
SUBNET = "10.213"
CHIEF_IP = f"{SUBNET}.0.1"
TASK_PORT = 2222
COMMAND_TIMEOUT = 10.0
_TOOL_DIRS = ("/usr/sbin", "/sbin", "/usr/bin", "/bin")
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit)\s*$", re.IGNORECASE)
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_libc = ctypes.CDLL(None, use_errno=True)


class NetworkError(RuntimeError):
    """An ``ip``/``tc`` command or a namespace call failed."""


def parse_bandwidth(value):
    """``"100mbit"``, ``"1gbit"``, ``"10mbit"`` or an int (bits/s) -> bits/s."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = _RATE_RE.match(value) if isinstance(value, str) else None
    if not match or float(match.group(1)) <= 0:
        raise ValueError(
            "LocalCluster: bandwidth must be a rate such as '100mbit', '1gbit', "
            f"'500kbit' or a positive int in bits/s, got {value!r}"
        )
    return int(float(match.group(1)) * _RATE_UNITS[match.group(2).lower()])


def missing_requirements():
    """What this process lacks to isolate a cluster; an empty list when nothing."""
    missing = []
    effective = _effective_capabilities()
    for bit, name in ((CAP_NET_ADMIN, "CAP_NET_ADMIN"), (CAP_SYS_ADMIN, "CAP_SYS_ADMIN")):
        if not effective >> bit & 1:
            missing.append(f"the {name} capability (run as root)")
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2")):
        if _tool(tool) is None:
            missing.append(f"the '{tool}' command (package {package})")
    if not os.path.exists("/proc/thread-self/ns/net"):
        missing.append("Linux network namespaces (/proc/thread-self/ns/net)")
    return missing


def _effective_capabilities():
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def _tool(name):
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(_TOOL_DIRS))


def _check(result, what):
    if result != 0:
        errno = ctypes.get_errno()
        raise NetworkError(f"{what} failed: {os.strerror(errno)}")


def _unshare_net():
    _check(_libc.unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")


def _setns(fd):
    _check(_libc.setns(fd, CLONE_NEWNET), "setns(CLONE_NEWNET)")


def _in_thread(function, *args):
    """Runs ``function`` in a new thread (whose namespace it may change) and
    returns its result; the thread, and its namespace, end with it."""
    outcome = {}

    def run():
        try:
            outcome["value"] = function(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            outcome["error"] = e

    thread = threading.Thread(target=run, name="tfdist-ext-netns", daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _open_namespace(path):
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


def run_in(namespace_fd, tool, commands, timeout=COMMAND_TIMEOUT):
    """Runs ``commands`` (lines of ``ip -batch``/``tc -batch``) in a namespace."""

    def run():
        _setns(namespace_fd)
        text = "\n".join(commands) + "\n"
        try:
            result = subprocess.run(
                [_tool(tool), "-batch", "-"],
                input=text,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise NetworkError(
                f"'{tool} -batch' did not finish within {timeout:.0f}s; commands:\n{text}"
            ) from None
        if result.returncode != 0:
            raise NetworkError(
                f"'{tool}' failed (status {result.returncode}) on:\n{text}{result.stderr.strip()}"
            )

    _in_thread(run)


def tbf_burst_bytes(bits_per_second):
    """Bytes a link's token bucket holds: at least 32 KiB and 4 ms of traffic at the rate.

    A transfer that finds the bucket full crosses this many bytes at once,
    not at the rate: a link lets short bursts through faster than its rate.
    """
    return max(32 * 1024, int(bits_per_second) // 8 // 250)


def _rate_limit(device, bits_per_second):
    burst = tbf_burst_bytes(bits_per_second)
    return f"qdisc add dev {device} root tbf rate {bits_per_second}bit burst {burst} latency 50ms"


class Hub:
    """The per-process namespace with the bridge every task's link plugs into."""

    def __init__(self):
        self.host_fd = _open_namespace("/proc/thread-self/ns/net")
        self.fd = _in_thread(self._create)
        self._names = itertools.count()
        self._addresses = itertools.count(2)
        self._lock = threading.Lock()
        run_in(
            self.fd,
            "ip",
            [
                "link set lo up",
                "link add br0 type bridge",
                f"addr add {CHIEF_IP}/16 dev br0",
                "link set br0 up",
            ],
        )

    @staticmethod
    def _create():
        _unshare_net()
        return _open_namespace("/proc/thread-self/ns/net")

    def enter(self):
        """Moves the calling thread (and every thread it creates) into the hub."""
        _setns(self.fd)

    def leave(self):
        """Moves the calling thread back to the host's namespace."""
        _setns(self.host_fd)

    def free_port(self):
        """A TCP port free in the hub right now (for the chief)."""

        def bind():
            _setns(self.fd)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("0.0.0.0", 0))
                return s.getsockname()[1]

        return _in_thread(bind)

    def new_address(self):
        """A fresh ``10.213.x.y`` for a task (never the chief's, never reused)."""
        with self._lock:
            n = next(self._addresses)
        if n >= 2**16 - 1:
            raise NetworkError("LocalCluster: this process used up 10.213.0.0/16")
        return f"{SUBNET}.{n >> 8}.{n & 255}"

    def spawn(self, ip, bandwidth, popen, namespace=None):
        """Starts ``popen()`` in the network namespace of the task at ``ip``.

        ``namespace`` is the file descriptor an earlier call returned (a
        restart: same namespace, same link); without it, a new namespace is
        created and linked to the hub. Returns ``(process, namespace)``. The
        namespace outlives the process until the caller closes it, so a dead
        task's address refuses connections at once, as a crashed process on a
        live machine does. If the link cannot be set up the process is killed
        and ``NetworkError`` names the command and its error; a process that
        exited by itself is returned with ``namespace=None`` (its status and
        output tell why).
        """
        if namespace is not None:

            def in_namespace():
                _setns(namespace)
                return popen()

            return _in_thread(in_namespace), namespace

        def in_new_namespace():
            _unshare_net()
            fd = _open_namespace("/proc/thread-self/ns/net")
            try:
                return popen(), fd
            except BaseException:
                os.close(fd)
                raise

        process, namespace = _in_thread(in_new_namespace)
        try:
            self._link(process.pid, namespace, ip, bandwidth)
        except BaseException:
            os.close(namespace)
            if process.poll() is not None:
                return process, None
            process.kill()
            process.wait()
            raise
        return process, namespace

    def _link(self, pid, namespace, ip, bandwidth):
        with self._lock:
            hub_end = f"tfx{next(self._names)}"
        run_in(
            self.fd,
            "ip",
            [
                f"link add {hub_end} type veth peer name eth0 netns {pid}",
                f"link set {hub_end} master br0",
                f"link set {hub_end} up",
            ],
        )
        run_in(
            namespace,
            "ip",
            [
                "link set lo up",
                f"addr add {ip}/16 dev eth0",
                "link set eth0 up",
            ],
        )
        if bandwidth:
            run_in(self.fd, "tc", [_rate_limit(hub_end, bandwidth)])
            run_in(namespace, "tc", [_rate_limit("eth0", bandwidth)])


_HUB = None
_HUB_LOCK = threading.Lock()


def hub():
    """This process's hub, created on first use."""
    global _HUB
    with _HUB_LOCK:
        if _HUB is None:
            _HUB = Hub()
        return _HUB
