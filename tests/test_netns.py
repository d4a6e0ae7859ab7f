"""LocalCluster's isolated network: namespaces, link rates, nothing in the host's
network, nothing left after a crash, clear refusals, SPMD programs."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from tfdist_ext.cluster import ClusterError
from tfdist_ext.cluster import LocalCluster
from tfdist_ext.cluster._netns import missing_requirements

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_isolation = pytest.mark.skipif(
    bool(missing_requirements()),
    reason="needs root or CAP_NET_ADMIN+CAP_SYS_ADMIN and ip/tc: "
    + "; ".join(missing_requirements()),
)

# A task that takes N bytes, acknowledges them with one byte, then sends N back.
SINK = textwrap.dedent("""
    import json, os, socket
    port = int(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"][0].split(":")[1])
    server = socket.create_server(("0.0.0.0", port))
    conn, _ = server.accept()
    n = int(conn.recv(16).decode())
    got = 0
    while got < n:
        got += len(conn.recv(1 << 20))
    conn.sendall(b"k")
    conn.sendall(b"x" * n)
    conn.close()
""")


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
        command=[sys.executable, "-c", SINK],
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
def test_tensorflow_transfer_between_tasks_at_link_rate(script):
    # A 10 MB variable on /job:ps read by an op on /job:worker crosses the
    # ps task's link and the worker's (both at 100 Mbit/s): 0.84 s of bytes.
    proc = script(
        """
        import json, time
        import tensorflow as tf
        from tfdist_ext.cluster import LocalCluster, connect
        with LocalCluster(num_workers=1, num_ps=1, bandwidth="100mbit") as cluster:
            connect(cluster.resolver)
            with tf.device("/job:ps/task:0"):
                v = tf.Variable(tf.ones([2_621_440]))   # 10 MiB of float32
                small = tf.Variable(tf.ones([4]))

            @tf.function
            def pull(var):
                with tf.device("/job:worker/task:0"):
                    return tf.reduce_sum(tf.identity(var))

            pull(small).numpy()
            times = []
            for _ in range(3):
                start = time.monotonic()
                pull(v).numpy()
                times.append(time.monotonic() - start)
            start = time.monotonic()
            pull(small).numpy()
            overhead = time.monotonic() - start
        print("RESULT " + json.dumps({"times": times, "overhead": overhead}), flush=True)
    """,
        timeout=220,
    )
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
    r = json.loads(line[len("RESULT ") :])
    ideal = 2_621_440 * 4 * 8 / 100e6
    seconds = sorted(r["times"])[1] - r["overhead"]
    assert abs(seconds / ideal - 1) < 0.25, (r, ideal)


def _listening_ports():
    """TCP ports listening in this thread's (the host's) network namespace."""
    out = subprocess.run(["ss", "-Hltn"], capture_output=True, text=True, check=True).stdout
    return {int(m) for m in re.findall(r":(\d+)\s", out)}


@needs_isolation
@pytest.mark.timeout(240)
def test_isolated_ports_do_not_listen_in_the_host_namespace():
    # The chief script starts an isolated cluster, connects this process's
    # TensorFlow runtime (its own server listens on the chief's port), checks
    # from inside that every port answers, then waits for us to look.
    source = textwrap.dedent("""
        import json, socket, subprocess, sys
        import tensorflow as tf
        from tfdist_ext.cluster import LocalCluster, connect
        with LocalCluster(num_workers=2, num_ps=1) as cluster:
            connect(cluster.resolver)
            with tf.device("/job:ps/task:0"):
                v = tf.Variable(1.0)
            spec = cluster.cluster_spec.as_dict()
            answered = {}
            for addresses in spec.values():
                for a in addresses:
                    host, port = a.split(":")
                    with socket.create_connection((host, int(port)), timeout=5):
                        answered[a] = True
            print("SPEC " + json.dumps({"spec": spec, "answered": answered}), flush=True)
            sys.stdin.readline()
    """)
    chief = subprocess.Popen(
        [sys.executable, "-c", source],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO),
    )
    try:
        line = chief.stdout.readline()
        assert line.startswith("SPEC "), line
        r = json.loads(line[len("SPEC ") :])
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
    source = textwrap.dedent("""
        import os, threading
        import keras
        import tfdist_ext
        from tfdist_ext import datasets
        from tfdist_ext.cluster import LocalCluster
        cluster = LocalCluster(num_workers=2, num_ps=1, bandwidth="100mbit").start()
        namespaces = {os.readlink(f"/proc/{p}/ns/net") for p in cluster.pids()}
        namespaces.add(os.readlink("/proc/thread-self/ns/net"))   # the hub
        strategy = tfdist_ext.DownpourStrategy(cluster.resolver)
        with strategy.scope():
            model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                                      keras.layers.Dense(10)])
            model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))

        class Announce(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch == 5:
                    print("FITTING " + " ".join(map(str, cluster.pids())) + " | "
                          + " ".join(sorted(namespaces)), flush=True)

        ds = datasets.digits("train", flatten=True).batch(32).repeat()
        model.fit(ds, epochs=1000, steps_per_epoch=100, verbose=0, callbacks=[Announce()])
    """)
    links_before = _host_links()
    chief = subprocess.Popen(
        [sys.executable, "-c", source],
        stdout=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO, TMPDIR=str(tmp_path)),
    )
    try:
        line = chief.stdout.readline()
        assert line.startswith("FITTING "), line
        pids_text, namespaces_text = line[len("FITTING ") :].split(" | ")
        pids = [int(p) for p in pids_text.split()]
        namespaces = set(namespaces_text.split())
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


def _run_unprivileged(user_args, source):
    return subprocess.run(
        [
            "setpriv",
            *user_args,
            "--inh-caps=-all",
            "--bounding-set=-all",
            sys.executable,
            "-c",
            textwrap.dedent(source),
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
    proc = _run_unprivileged(
        [],
        """
        from tfdist_ext.cluster import ClusterError, LocalCluster
        for kwargs in ({"isolated": True}, {"bandwidth": "100mbit"}):
            try:
                LocalCluster(num_workers=1, num_ps=0, **kwargs)
            except ClusterError as e:
                print("REFUSED", kwargs, e, flush=True)
        print("DEFAULT isolated:", LocalCluster(num_workers=1, num_ps=0).isolated, flush=True)
    """,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    refusals = [l for l in proc.stdout.splitlines() if l.startswith("REFUSED")]
    assert len(refusals) == 2, proc.stdout
    for line in refusals:
        assert "CAP_NET_ADMIN" in line and "isolated=False" in line, line
    assert "DEFAULT isolated: False" in proc.stdout


@pytest.mark.timeout(120)
def test_a_loopback_cluster_warns_once_naming_its_ports():
    # Root without capabilities: the tasks can start, the isolation cannot.
    if os.geteuid() != 0:
        pytest.skip("needs root to drop the capabilities")
    proc = _run_unprivileged(
        [],
        """
        import logging
        from tfdist_ext.cluster import LocalCluster
        logging.basicConfig(format="LOG %(message)s")
        with LocalCluster(num_workers=1, num_ps=0) as cluster:
            assert not cluster.isolated
            print("PORT", cluster.address("worker", 0).split(":")[1], flush=True)
        with LocalCluster(num_workers=1, num_ps=0):
            pass
        print("DONE", flush=True)
    """,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    port = re.search(r"PORT (\d+)", proc.stdout).group(1)
    warnings = [l for l in proc.stderr.splitlines() if "SECURITY.md" in l]
    assert len(warnings) == 1, proc.stderr  # one per process, not per cluster
    assert port in warnings[0] and "CAP_NET_ADMIN" in warnings[0]
    assert "DONE" in proc.stdout


@needs_isolation
@pytest.mark.timeout(200)
def test_a_process_uses_one_kind_of_cluster_network(script):
    proc = script(
        """
        from tfdist_ext.cluster import ClusterError, LocalCluster
        with LocalCluster(num_workers=1, num_ps=0, isolated=True):
            pass
        try:
            LocalCluster(num_workers=1, num_ps=0, isolated=False)
        except ClusterError as e:
            print("REFUSED", e, flush=True)
        with LocalCluster(num_workers=1, num_ps=0):   # the default follows the first
            print("AGAIN", flush=True)
    """,
        timeout=180,
    )
    assert (
        "REFUSED LocalCluster: this process already ran a cluster with isolated=True; "
        "one with isolated=False cannot follow it"
    ) in proc.stdout
    assert "new process" in proc.stdout and "AGAIN" in proc.stdout
    proc = script(
        """
        from tfdist_ext.cluster import ClusterError, LocalCluster
        with LocalCluster(num_workers=1, num_ps=0, isolated=False):
            pass
        print("DEFAULT", LocalCluster(num_workers=1, num_ps=0).isolated, flush=True)
        try:
            LocalCluster(num_workers=1, num_ps=0, bandwidth="10mbit")
        except ClusterError as e:
            print("REFUSED", e, flush=True)
    """,
        timeout=180,
    )
    assert "DEFAULT False" in proc.stdout
    assert (
        "REFUSED LocalCluster: this process already ran a cluster with isolated=False; "
        "one with isolated=True cannot follow it"
    ) in proc.stdout


# Two workers of a CompressedMultiWorkerMirroredStrategy (a MultiWorkerMirroredStrategy
# whose all-reduce sends fp16), each its own process and namespace.
MWMS_WORKER = textwrap.dedent("""
    import json, os
    import numpy as np, tensorflow as tf, keras
    from tfdist_ext import compression as C
    strategy = C.CompressedMultiWorkerMirroredStrategy(compression=C.get("fp16"))
    keras.utils.set_random_seed(0)
    x = np.random.RandomState(0).randn(256, 8).astype("float32")
    y = x.sum(1, keepdims=True)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(32).with_options(options)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.05), "mse")
    history = model.fit(ds, epochs=3, verbose=0)
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    print("RESULT " + json.dumps({"task": task, "loss": history.history["loss"],
          "kernel": model.get_weights()[0].ravel().tolist()}), flush=True)
""")


@needs_isolation
@pytest.mark.timeout(300)
def test_spmd_program_as_the_worker_tasks(tmp_path):
    train = tmp_path / "train.py"
    train.write_text(MWMS_WORKER)
    cluster = LocalCluster(
        num_workers=2,
        num_ps=0,
        chief=False,
        bandwidth="1gbit",
        command=[sys.executable, str(train)],
        env={"PYTHONPATH": REPO},
    )
    with cluster:
        codes = cluster.wait(timeout=240)
        outputs = [cluster.output("worker", i) for i in range(2)]
    assert codes == {"worker:0": 0, "worker:1": 0}, outputs
    results = [
        json.loads(l[len("RESULT ") :])
        for out in outputs
        for l in out.splitlines()
        if l.startswith("RESULT ")
    ]
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
        command=[sys.executable, "-c", "import time; time.sleep(60)"],
    )
    with cluster:
        start = time.monotonic()
        with pytest.raises(ClusterError, match="worker:0 still runs after 1s"):
            cluster.wait(timeout=1)
        assert time.monotonic() - start < 10
