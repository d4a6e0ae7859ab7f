"""The network a LocalCluster's tasks talk over (internal): 127.0.0.1, or a
network namespace per task behind the hub, with optional link limits."""

import logging
import threading

from tfdist_ext.cluster import _netns
from tfdist_ext.cluster._process import ClusterError
from tfdist_ext.cluster._process import HOST
from tfdist_ext.cluster._process import free_port

#: The kind of cluster network this process uses ("isolated" or "loopback").
_NETWORK = {"kind": None, "warned": False}
_HUB_ENTRIES = {"count": 0}
_HUB_ENTRIES_LOCK = threading.Lock()
_logger = logging.getLogger("tfdist_ext")


def choose_hub(isolated, bandwidth):
    """``(hub, why_loopback)``: the hub to isolate a cluster in, or ``None``
    for 127.0.0.1 and the reason."""
    if isolated is not None and not isinstance(isolated, bool):
        raise ValueError(f"LocalCluster: isolated must be None, True or False, got {isolated!r}")
    if isolated is False and bandwidth:
        raise ValueError(
            "LocalCluster: bandwidth needs an isolated cluster (each task's link "
            "is rate-limited in its own network namespace); drop isolated=False"
        )
    if isolated is None and not bandwidth and _NETWORK["kind"] == "loopback":
        return None, "isolated=False"  # the default follows this process's first cluster
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
    check_network_kind("isolated" if hub else "loopback")
    return hub, "; ".join(missing) if missing else "isolated=False"


def new_spec(hub, chief, num_workers, num_ps):
    """A cluster spec of fresh addresses: behind ``hub``, or on 127.0.0.1."""
    if hub is not None:
        chief_address = f"{_netns.CHIEF_IP}:{hub.free_port()}"

        def task_address():
            return f"{hub.new_address()}:{_netns.TASK_PORT}"
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


def check_network_kind(kind):
    if _NETWORK["kind"] not in (None, kind):
        raise ClusterError(
            f"LocalCluster: this process already ran a cluster with "
            f"isolated={_NETWORK['kind'] == 'isolated'}; one with "
            f"isolated={kind == 'isolated'} cannot follow it (the TensorFlow and gRPC "
            "threads of this process live in the first one's network). Use one kind "
            "per process: pass the same isolated=... to every LocalCluster, or run "
            "this one in a new process."
        )


def claim_network_kind(kind):
    """This process's clusters are of ``kind`` from now on."""
    check_network_kind(kind)
    _NETWORK["kind"] = kind


def warn_open_ports(spec, why_loopback):
    """Once per process: a loopback cluster's servers are open to anyone who can reach them."""
    if _NETWORK["warned"]:
        return
    _NETWORK["warned"] = True
    ports = ", ".join(a.rsplit(":", 1)[1] for addrs in spec.values() for a in addrs)
    _logger.warning(
        "LocalCluster: this cluster's TensorFlow servers listen on ports %s of "
        "every interface without authentication and run any graph sent to them; "
        "anyone who can reach this machine can read and write its files. This "
        "process cannot isolate the cluster (%s). See SECURITY.md.",
        ports,
        why_loopback,
    )


def format_rate(bits_per_second):
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits_per_second >= scale:
            return f"{bits_per_second / scale:g}{unit}"
    return f"{bits_per_second}bit"


def enter_hub(hub):
    """The calling thread (and the threads it creates from now on: TensorFlow's
    and gRPC's) joins the isolated clusters' network."""
    with _HUB_ENTRIES_LOCK:
        if _HUB_ENTRIES["count"] == 0:
            hub.enter()
        _HUB_ENTRIES["count"] += 1


def leave_hub(hub):
    with _HUB_ENTRIES_LOCK:
        _HUB_ENTRIES["count"] -= 1
        if _HUB_ENTRIES["count"] == 0:
            hub.leave()
