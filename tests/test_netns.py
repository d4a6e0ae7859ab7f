"""LocalCluster's isolated network: namespaces, link rates, nothing in the host's
network, nothing left after a crash, clear refusals, SPMD programs."""

import os
import re
import signal
import socket
import subprocess
import time

import pytest

from tests.programs import REPO
from tests.programs import program_command
from tests.programs import result_of
from tests.programs import run_program
from tfdist_ext.cluster import ClusterError
from tfdist_ext.cluster import LocalCluster
from tfdist_ext.cluster._netns import missing_requirements

needs_isolation = pytest.mark.skipif(
    bool(missing_requirements()),
    reason="needs root or CAP_NET_ADMIN+CAP_SYS_ADMIN and ip/tc: "
    + "; ".join(missing_requirements()),
)


def _connect(address, deadline):
    host, port = address.split(":")
    while True:
        try:
            return socket.create_connection((host, int(port)), timeout=5)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _transfer_times(address, nbytes):
    """(seconds chief -> task, seconds task -> chief) for ``nbytes`` each way."""
    with _connect(address, time.monotonic() + 60) as conn:
        conn.settimeout(60)
        conn.sendall(str(nbytes).encode().ljust(16))
        start = time.monotonic()
        conn.sendall(b"x" * nbytes)
        assert conn.recv(1) == b"k"
        upload = time.monotonic() - start
        start = time.monotonic()
        got = 0
        while got < nbytes:
            chunk = conn.recv(1 << 20)
            assert chunk, "connection closed early"
            got += len(chunk)
        return upload, time.monotonic() - start


@needs_isolation
@pytest.mark.timeout(120)
@pytest.mark.parametrize("bandwidth, bits", [("100mbit", 100e6), ("20mbit", 20e6)])
def test_link_rate_both_directions(bandwidth, bits):
    # 1.25 s of traffic at the rate, each way, over a raw TCP socket between
    # this process (the chief, in the hub) and a task in its own namespace.
    nbytes = int(bits * 1.25 / 8)
    ideal = nbytes * 8 / bits
    cluster = LocalCluster(
        num_workers=1,
        num_ps=0,
        chief=False,
        bandwidth=bandwidth,
        # A task that takes N bytes, acknowledges them with one byte, then sends N back.
        command=program_command("stand_ins", "sink"),
    )
    with cluster:
        upload, download = _transfer_times(cluster.address("worker", 0), nbytes)
        assert cluster.wait(timeout=30) == {"worker:0": 0}
    for direction, seconds in (("chief->task", upload), ("task->chief", download)):
        assert abs(seconds / ideal - 1) < 0.25, (
            f"{direction}: {nbytes} bytes at {bandwidth} took {seconds:.2f}s, ideal {ideal:.2f}s"
        )


@needs_isolation
@pytest.mark.timeout(240)
@pytest.mark.slow
def test_tensorflow_transfer_between_tasks_at_link_rate():
    # A 10 MB variable on /job:ps read by an op on /job:worker crosses the
    # ps task's link and the worker's (both at 100 Mbit/s): 0.84 s of bytes.
    r = run_program("netns_cases", "transfer_at_link_rate", timeout=220)
    ideal = 2_621_440 * 4 * 8 / 100e6
    seconds = sorted(r["times"])[1] - r["overhead"]
    assert abs(seconds / ideal - 1) < 0.25, (r, ideal)


def _listening_ports():
    """TCP ports listening in this thread's (the host's) network namespace."""
    out = subprocess.run(["ss", "-Hltn"], capture_output=True, text=True, check=True).stdout
    return {int(m) for m in re.findall(r":(\d+)\s", out)}


@needs_isolation
@pytest.mark.timeout(240)
@pytest.mark.slow
def test_isolated_ports_do_not_listen_in_the_host_namespace():
    # The chief script starts an isolated cluster, connects this process's
    # TensorFlow runtime (its own server listens on the chief's port), checks
    # from inside that every port answers, then waits for us to look.
    chief = subprocess.Popen(
        program_command("netns_cases", "isolated_ports"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO),
    )
    try:
        line = chief.stdout.readline()
        r = result_of(line)
        assert r, line
        addresses = [a for addrs in r["spec"].values() for a in addrs]
        assert all(a.startswith("10.213.") for a in addresses)
        assert all(r["answered"][a] for a in addresses)
        open_here = _listening_ports()
        ports = {int(a.split(":")[1]) for a in addresses}
        assert not ports & open_here, f"cluster ports {ports & open_here} listen on the host"
        chief.stdin.write("\n")
        chief.stdin.flush()
        assert chief.wait(60) == 0
    finally:
        if chief.poll() is None:
            chief.kill()
            chief.wait(10)


def _host_links():
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    return {line.split(":")[1].strip() for line in out.stdout.splitlines()}


def _net_namespaces():
    """Network namespaces held by any process (inode text, e.g. 'net:[4026532]')."""
    found = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                found.add(os.readlink(f"/proc/{pid}/task/{tid}/ns/net"))
        except OSError:
            continue
    return found


def _gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"  # a zombie is gone
    except OSError:
        return True


def _temp_entries(directory):
    return {e for e in os.listdir(directory) if e.startswith("tfdist-ext")}


@needs_isolation
@pytest.mark.timeout(300)
def test_kill_9_of_the_chief_mid_fit_leaves_nothing(tmp_path):
    links_before = _host_links()
    # The chief fits for ever and announces its tasks' pids and namespaces.
    chief = subprocess.Popen(
        program_command("netns_cases", "fit_until_killed"),
        stdout=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO, TMPDIR=str(tmp_path)),
    )
    try:
        line = chief.stdout.readline()
        announced = result_of(line)
        assert announced, line
        pids, namespaces = announced["pids"], set(announced["namespaces"])
        assert len(pids) == 3 and len(namespaces) == 4
        assert namespaces <= _net_namespaces()
    finally:
        chief.send_signal(signal.SIGKILL)
        chief.wait(10)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        remaining = [p for p in pids if not _gone(p)]
        if not remaining and not namespaces & _net_namespaces():
            break
        time.sleep(0.2)
    assert not remaining, f"task processes {remaining} survive the chief"
    assert not namespaces & _net_namespaces(), "a namespace of the cluster survives"
    assert _host_links() == links_before
    assert not _temp_entries(tmp_path)


def test_bad_bandwidth_is_refused_at_construction():
    for bad in ("fast", "100 mbps", "-5mbit", 0, 1.5, True):
        with pytest.raises(ValueError, match="bandwidth must be a rate"):
            LocalCluster(num_workers=1, num_ps=0, bandwidth=bad)
    with pytest.raises(ValueError, match="bandwidth needs an isolated cluster"):
        LocalCluster(num_workers=1, num_ps=0, bandwidth="10mbit", isolated=False)
    with pytest.raises(ValueError, match="isolated must be"):
        LocalCluster(num_workers=1, num_ps=0, isolated="yes")
    with pytest.raises(ValueError, match="command must be"):
        LocalCluster(num_workers=1, num_ps=0, command="python train.py")


def _run_unprivileged(user_args, case):
    """Runs ``netns_cases CASE`` under setpriv with every capability dropped."""
    return subprocess.run(
        [
            "setpriv",
            *user_args,
            "--inh-caps=-all",
            "--bounding-set=-all",
            *program_command("netns_cases", case),
        ],
        capture_output=True,
        text=True,
        timeout=110,
        cwd="/",
        check=False,
        env=dict(os.environ, PYTHONPATH=REPO, HOME="/", TF_CPP_MIN_LOG_LEVEL="2"),
    )


@pytest.mark.timeout(60)
def test_without_privileges_isolation_is_refused_at_construction():
    # Root with every capability dropped: what decides is CAP_NET_ADMIN and
    # CAP_SYS_ADMIN, not the user id (and another user may not be able to
    # read the test environment's interpreter at all).
    if os.geteuid() != 0:
        pytest.skip("needs root to drop the capabilities")
    proc = _run_unprivileged([], "refusals_without_privileges")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = result_of(proc.stdout)
    assert len(r["refusals"]) == 2, proc.stdout
    for line in r["refusals"]:
        assert "CAP_NET_ADMIN" in line and "isolated=False" in line, line
    assert r["default_isolated"] is False


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_loopback_cluster_warns_once_naming_its_ports():
    # Root without capabilities: the tasks can start, the isolation cannot.
    if os.geteuid() != 0:
        pytest.skip("needs root to drop the capabilities")
    proc = _run_unprivileged([], "loopback_warnings")
    assert proc.returncode == 0, proc.stderr[-3000:]
    port = result_of(proc.stdout)["port"]
    warnings = [l for l in proc.stderr.splitlines() if "SECURITY.md" in l]
    assert len(warnings) == 1, proc.stderr  # one per process, not per cluster
    assert port in warnings[0] and "CAP_NET_ADMIN" in warnings[0]


@needs_isolation
@pytest.mark.timeout(200)
@pytest.mark.slow
def test_a_process_uses_one_kind_of_cluster_network():
    # Reported from inside the block of the default cluster that follows the
    # refusal: that one started.
    r = run_program("netns_cases", "isolated_then_loopback", timeout=180)
    assert (
        "LocalCluster: this process already ran a cluster with isolated=True; "
        "one with isolated=False cannot follow it"
    ) in r["refused"]
    assert "new process" in r["refused"]
    r = run_program("netns_cases", "loopback_then_isolated", timeout=180)
    assert r["default_isolated"] is False
    assert (
        "LocalCluster: this process already ran a cluster with isolated=False; "
        "one with isolated=True cannot follow it"
    ) in r["refused"]


@needs_isolation
@pytest.mark.timeout(300)
@pytest.mark.slow
def test_spmd_program_as_the_worker_tasks():
    # Two workers of a CompressedMultiWorkerMirroredStrategy (a MultiWorkerMirroredStrategy
    # whose all-reduce sends fp16), each its own process and namespace.
    cluster = LocalCluster(
        num_workers=2,
        num_ps=0,
        chief=False,
        bandwidth="1gbit",
        command=program_command("compressed_workers", "fp16_regression"),
        env={"PYTHONPATH": REPO},
    )
    with cluster:
        codes = cluster.wait(timeout=240)
        outputs = [cluster.output("worker", i) for i in range(2)]
    assert codes == {"worker:0": 0, "worker:1": 0}, outputs
    results = [result_of(out) for out in outputs]
    assert [r["task"]["index"] for r in results] == [0, 1]
    assert results[0]["kernel"] == results[1]["kernel"]  # replicas in sync
    assert results[0]["loss"][-1] < results[0]["loss"][0]


@needs_isolation
@pytest.mark.timeout(60)
def test_wait_has_a_deadline():
    cluster = LocalCluster(
        num_workers=1,
        num_ps=0,
        chief=False,
        command=program_command("stand_ins", "sleep", 60),
    )
    with cluster:
        start = time.monotonic()
        with pytest.raises(ClusterError, match="worker:0 still runs after 1s"):
            cluster.wait(timeout=1)
        assert time.monotonic() - start < 10
