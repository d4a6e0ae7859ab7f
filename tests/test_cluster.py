"""LocalCluster: real task processes, deadlines, faults, no orphans, no leftovers;
the ``tfdist-ext`` command line and its server."""

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.programs import REPO
from tests.programs import program_command
from tests.programs import result_of
from tests.programs import run_program
from tfdist_ext.cluster import ClusterError
from tfdist_ext.cluster import ClusterTimeoutError
from tfdist_ext.cluster import LocalCluster
from tfdist_ext.cluster import free_port
from tfdist_ext.cluster import ping


def _gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie still answers kill(0); ask ps for its state.
    out = subprocess.run(
        ["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True
    ).stdout.strip()
    return out == "" or out.startswith("Z")


def _wait_gone(pids, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(_gone(p) for p in pids):
            return True
        time.sleep(0.2)
    return False


@pytest.mark.timeout(180)
def test_start_ping_kill_restart_and_teardown():
    with LocalCluster(num_workers=2, num_ps=1, start_timeout=120) as cluster:
        spec = cluster.cluster_spec.as_dict()
        assert set(spec) == {"chief", "worker", "ps"}
        host = "10.213." if cluster.isolated else "127.0.0.1:"
        assert all(a.startswith(host) for addrs in spec.values() for a in addrs)
        assert len(set(a for addrs in spec.values() for a in addrs)) == 4
        statuses = cluster.ping()
        assert statuses == {
            "worker:0": ["/job:worker/replica:0/task:0/device:CPU:0"],
            "worker:1": ["/job:worker/replica:0/task:1/device:CPU:0"],
            "ps:0": ["/job:ps/replica:0/task:0/device:CPU:0"],
        }
        resolver = cluster.resolver
        assert resolver.task_type == "chief" and resolver.task_id == 0
        assert resolver.cluster_spec().as_dict() == spec
        pids = cluster.pids()
        assert len(pids) == 3

        victim = cluster.pid("worker", 1)
        cluster.kill("worker", 1)
        assert not cluster.alive("worker", 1)
        assert _gone(victim)
        start = time.monotonic()
        # Refused at once (UNAVAILABLE), as a dead process on a live host is,
        # not left to time out: an isolated task's namespace outlives its process.
        with pytest.raises(
            ClusterTimeoutError, match=f"{cluster.address('worker', 1)}.*UNAVAILABLE"
        ):
            ping(cluster.address("worker", 1), timeout=2.0)
        assert time.monotonic() - start < 10
        # The others are untouched.
        assert ping(cluster.address("worker", 0))
        cluster.restart("worker", 1)
        assert cluster.alive("worker", 1)
        assert cluster.pid("worker", 1) != victim
        assert cluster.ping()["worker:1"] == ["/job:worker/replica:0/task:1/device:CPU:0"]
        pids = cluster.pids()
    assert _wait_gone(pids), "task processes left behind after exit"


@pytest.mark.timeout(120)
def test_teardown_when_body_raises():
    with pytest.raises(RuntimeError, match="boom"):
        with LocalCluster(num_workers=1, num_ps=1) as cluster:
            pids = cluster.pids()
            raise RuntimeError("boom")
    assert _wait_gone(pids)


@pytest.mark.timeout(120)
def test_no_orphans_when_parent_is_killed():
    # A parent process starts a cluster, prints the task pids and hangs; we
    # SIGKILL it (no chance to clean up) and check with ps that no task is left.
    parent = subprocess.Popen(
        program_command("cluster_cases", "hold_cluster"),
        stdout=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
        cwd=REPO,
    )
    try:
        line = parent.stdout.readline()
        pids = (result_of(line) or {}).get("pids", [])
        assert len(pids) == 3, line
        assert not any(_gone(p) for p in pids)
    finally:
        parent.kill()
        parent.wait(10)
    assert _wait_gone(pids, timeout=15), "orphaned task processes survive their parent"
    ps = subprocess.run(["ps", "-eo", "pid="], capture_output=True, text=True).stdout.split()
    assert not set(map(str, pids)) & set(ps) or all(_gone(p) for p in pids)


@pytest.mark.timeout(30)
def test_unreachable_task_fails_within_deadline():
    address = f"127.0.0.1:{free_port()}"  # nothing listens here
    start = time.monotonic()
    with pytest.raises(ClusterTimeoutError, match=address):
        ping(address, timeout=1.5)
    assert time.monotonic() - start < 8


@pytest.mark.timeout(120)
def test_a_strategy_refuses_a_cluster_spec_naming_a_wrong_or_dead_task():
    """Two common TF_CONFIG mistakes, refused when the strategy is built (before it
    connects): a task listed under another role's address, and an address where
    nothing listens (within the strategy's deadline)."""
    import tensorflow as tf

    from tfdist_ext import DownpourStrategy

    def resolver(spec):
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(spec), task_type="chief", task_id=0
        )

    with LocalCluster(num_workers=1, num_ps=1, verbose=0) as cluster:
        spec = cluster.cluster_spec.as_dict()
        swapped = dict(spec, ps=spec["worker"], worker=spec["ps"])
        wrong = f"names {spec['worker'][0]} as task ps:0, but the server there is /job:worker/"
        with pytest.raises(ClusterError, match=wrong):
            DownpourStrategy(resolver(swapped), deadline=5)
        dead = f"127.0.0.1:{free_port()}"
        start = time.monotonic()
        with pytest.raises(
            ClusterTimeoutError, match=f"task ps:0 at {dead} did not answer within 2s"
        ):
            DownpourStrategy(resolver(dict(spec, ps=[dead])), deadline=2)
        assert time.monotonic() - start < 10


@pytest.mark.timeout(300)
def test_a_second_chief_is_refused_and_the_first_trains_on(tmp_path):
    """A second job pointed at parameter servers a first job trains on is refused
    at once, naming the first chief; the first trains on unharmed. Once the first
    has ended, a new chief takes the cluster over."""
    result = run_program("cluster_cases", "second_chief", tmp_path / "stop", timeout=280)
    assert result["training"]
    second = result["second"]
    assert second["error"] == "ClusterError"
    assert f"the chief at {result['first_chief']} is connected to ps:0" in second["message"]
    assert result["first_exit"] == 0 and result["first"]["error"] is None
    np.testing.assert_allclose(result["first"]["kernel"], [1.0] * 4, atol=0.05)
    assert result["third"]["error"] is None
    np.testing.assert_allclose(result["third"]["kernel"], [-1.0] * 4, atol=0.05)


@pytest.mark.timeout(60)
def test_a_second_task_at_a_taken_address_exits_2_naming_it():
    """Two tasks given the same TF_CONFIG index: the second cannot listen, and
    says so in one line."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        address = f"127.0.0.1:{holder.getsockname()[1]}"
        config = {
            "cluster": {"worker": [f"127.0.0.1:{free_port()}"], "ps": [address]},
            "task": {"type": "ps", "index": 0},
        }
        proc = subprocess.run(
            [sys.executable, "-m", "tfdist_ext.server", "--no-warning"],
            capture_output=True,
            text=True,
            env=dict(os.environ, TF_CONFIG=json.dumps(config)),
            timeout=50,
            stdin=subprocess.DEVNULL,
        )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"tfdist-ext server: error: task ps:0 cannot listen on {address}: another process "
        "holds that port (two tasks given the same TF_CONFIG task index?)"
    )
    assert proc.stdout == ""


@pytest.mark.timeout(60)
def test_task_that_cannot_start_reports_its_output(monkeypatch):
    monkeypatch.setattr(
        LocalCluster,
        "_argv",
        lambda self, job: program_command("stand_ins", "fail"),
    )
    cluster = LocalCluster(num_workers=1, num_ps=0)
    with pytest.raises(ClusterError, match="worker:0 exited with status 1(.|\\n)*injected failure"):
        cluster.start()
    assert not cluster.alive("worker", 0)


@pytest.mark.timeout(60)
def test_start_deadline_is_enforced(monkeypatch):
    # A task that never becomes ready must fail the start within start_timeout.
    monkeypatch.setattr(
        LocalCluster,
        "_argv",
        lambda self, job: program_command("stand_ins", "sleep", 60),
    )
    cluster = LocalCluster(num_workers=1, num_ps=0, start_timeout=2)
    start = time.monotonic()
    with pytest.raises(ClusterTimeoutError, match="worker:0 did not answer within 2s"):
        cluster.start()
    assert time.monotonic() - start < 10
    assert _wait_gone(cluster.pids())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_workers": 0}, "num_workers"),
        ({"num_ps": -1}, "num_ps"),
        ({"num_workers": 1.5}, "num_workers"),
        ({"inter_op_threads": 0}, "inter_op_threads"),
        ({"start_timeout": 0}, "start_timeout"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LocalCluster(**kwargs)


def test_unknown_task_is_a_clear_error():
    cluster = LocalCluster(num_workers=1, num_ps=1)
    with pytest.raises(ValueError, match="no task worker:3"):
        cluster.kill("worker", 3)
    with pytest.raises(ValueError, match="calling process"):
        cluster.kill("chief", 0)
    assert "chief" in cluster.tf_config("worker", 0)


@pytest.mark.timeout(200)
@pytest.mark.slow
def test_talk_to_every_task_through_tensorflow():
    # The chief connects with TensorFlow's own runtime, runs an op on every
    # task, then a killed worker gives an error (not a hang) while the others
    # keep answering.
    seen = run_program("cluster_cases", "talk_to_tasks", timeout=180)["seen"]
    assert "worker 0 /job:worker/replica:0/task:0/device:CPU:0 [1.0, 2.0]" in seen
    assert "worker 1 /job:worker/replica:0/task:1/device:CPU:0 [2.0, 4.0]" in seen
    assert "ps 0 /job:ps/replica:0/task:0/device:CPU:0 [1.0, 2.0]" in seen


_START_UP_NOISE = ("absl::InitializeLog", "oneDNN custom operations")


@pytest.mark.timeout(120)
def test_no_temp_files_and_quiet_task_output(monkeypatch, tmp_path):
    # Task output stays in memory: a cluster leaves nothing in the temp dir,
    # whether it stops normally or because its body raised.
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    with LocalCluster(num_workers=1, num_ps=1) as cluster:
        output = cluster.output("worker", 0)
    assert "READY worker:0 " in output
    assert not any(noise in output for noise in _START_UP_NOISE), output
    with pytest.raises(RuntimeError, match="boom"):
        with LocalCluster(num_workers=1, num_ps=0):
            raise RuntimeError("boom")
    assert not [e for e in os.listdir(tmp_path) if e.startswith("tfdist-ext")]


def _cli(*args, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "tfdist_ext.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.timeout(120)
def test_help_explains_each_command():
    top = _cli("--help")
    assert top.returncode == 0
    for command in ("server", "demo"):
        line = next(l for l in top.stdout.splitlines() if l.strip().startswith(command))
        assert len(line.split()) > 4, line  # the command and what it does
    assert "SECURITY.md" in top.stdout
    server = _cli("server", "--help")
    assert server.returncode == 0
    for text in (
        "TF_CONFIG",
        '"cluster"',
        '"task"',
        "--intra-op-threads",
        "--inter-op-threads",
        "--cpu-devices",
        "--strategy",
        "SIGINT",
    ):
        assert text in server.stdout, text
    assert _cli().returncode == 2 and "commands:" in _cli().stderr


@pytest.mark.timeout(120)
def test_server_is_quiet_warns_and_stops_on_ctrl_c():
    port = free_port()
    env = dict(
        os.environ,
        TF_CPP_MIN_LOG_LEVEL="2",
        TF_CONFIG=(
            f'{{"cluster": {{"worker": ["127.0.0.1:{port}"]}}, "task": {{"type": "worker", "index": 0}}}}'
        ),
    )
    server = subprocess.Popen(
        [sys.executable, "-m", "tfdist_ext.cli", "server"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    try:
        line = server.stdout.readline()
        assert line.startswith(f"READY worker:0 127.0.0.1:{port}"), line
        server.send_signal(signal.SIGINT)
        # A deadline, not a timing: a loaded machine may take a while.
        _, stderr = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
    assert server.returncode == -signal.SIGINT
    assert "Traceback" not in stderr, stderr
    assert "interrupted" in stderr.splitlines()[-1]
    warning = [l for l in stderr.splitlines() if "SECURITY.md" in l]
    assert len(warning) == 1 and f"port {port}" in warning[0], stderr
    assert not any(noise in stderr for noise in _START_UP_NOISE), stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("byte", ["written", "lost"])
def test_server_wait_ends_on_a_signal_another_thread_took(byte):
    # The CI failure of 2026-11-26: Ctrl-C just after READY, taken by one of
    # TensorFlow's threads, left the server's main thread blocked for good.
    # CPython's C handler runs in the thread the kernel picks and only marks
    # the signal pending; the main thread looks again only when it retakes
    # the GIL. Here a thread parked in a read (restarted after the handler,
    # so it never needs the GIL: a native thread) takes the SIGINT while the
    # main thread holds the GIL; then the server's wait starts. "written":
    # the wakeup pipe (set up before READY) has the handler's byte;
    # "lost": no byte (a signal before the pipe existed), the poll ends it.
    # The scenario: tests/programs/cluster_cases.py's server_wait.
    r = run_program("cluster_cases", "server_wait", byte, timeout=30)
    assert r == {"interrupted_in": "_wait_for_a_signal"}, r


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_throttle_keeps_cycling_while_this_process_holds_the_gil():
    # The stop/continue cycle runs in its own process: a long call holding
    # this process's GIL (a C-level regex scan here; a TensorFlow call that
    # waits for the throttled task in the real case) neither freezes the
    # task stopped nor stops the cycle. An observer process samples the
    # task's state (/proc) while this one holds the GIL.
    import re as regex

    with LocalCluster(num_workers=1, num_ps=0) as cluster:
        pid = cluster.pid("worker", 0)
        with cluster.throttle("worker", 0, slowdown=4, period=0.05):
            time.sleep(0.2)
            watch = subprocess.Popen(
                program_command("stand_ins", "observe", pid, 1.0),
                stdout=subprocess.PIPE,
                text=True,
                cwd=REPO,
            )
            # One call of about 2 s that holds the GIL throughout (the
            # observer's second starts within it).
            regex.match(r"(a+)+$", "a" * 26 + "b")
            observed = result_of(watch.communicate(timeout=30)[0])
            stopped, samples = observed["stopped"], observed["samples"]
        # Stopped about 3/4 of the time, running the rest, while the GIL was held.
        assert samples > 50 and 0.4 < stopped / samples < 0.97, (stopped, samples)
        # Continued after the block, and it answers.
        with open(f"/proc/{pid}/stat") as f:
            assert f.read().rsplit(")", 1)[1].split()[0] != "T"
        assert cluster.ping()["worker:0"]


@functools.cache
def _tensorflow_honours_use_bfc_false():
    """Whether ``TF_CPU_ALLOCATOR_USE_BFC=false`` gives TensorFlow's default allocator here.

    Where oneDNN brings its own pooling CPU allocator (seen on an AVX-512
    machine), TensorFlow pools whatever the variable says, so only the
    variable's arrival in the task can be checked there.
    """
    env = {"TF_CPU_ALLOCATOR_USE_BFC": "false"}
    return run_program("stand_ins", "allocator", env=env, timeout=90)["allocator"] == "default"


def _assert_allocator(output, use_bfc, allocator):
    """The task (``stand_ins allocator``, its ``output``) saw
    ``TF_CPU_ALLOCATOR_USE_BFC=use_bfc`` and, where TensorFlow honours it, got ``allocator``."""
    seen = result_of(output)
    assert seen and seen["use_bfc"] == use_bfc, output[-2000:]
    if allocator == "pool" or _tensorflow_honours_use_bfc_false():
        assert seen["allocator"] == allocator, output[-2000:]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("env", "use_bfc", "allocator"),
    [
        (None, "true", "pool"),
        pytest.param(
            {"TF_CPU_ALLOCATOR_USE_BFC": "false"}, "false", "default", marks=pytest.mark.slow
        ),
    ],
)
def test_tasks_get_tensorflows_pooling_cpu_allocator(monkeypatch, env, use_bfc, allocator):
    # TensorFlow's BFC allocator keeps statistics, the default one has none:
    # a task's tensors come from the pool unless the cluster's env says not.
    monkeypatch.delenv("TF_CPU_ALLOCATOR_USE_BFC", raising=False)
    command = program_command("stand_ins", "allocator")
    with LocalCluster(num_workers=1, num_ps=0, chief=False, command=command, env=env) as cluster:
        assert cluster.wait(timeout=90) == {"worker:0": 0}
        _assert_allocator(cluster.output("worker", 0), use_bfc, allocator)


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_a_users_allocator_choice_is_kept(monkeypatch):
    from tfdist_ext.cluster._tf_config import set_task_env_defaults

    monkeypatch.setenv("TF_CPU_ALLOCATOR_USE_BFC", "false")
    command = program_command("stand_ins", "allocator")
    with LocalCluster(num_workers=1, num_ps=0, chief=False, command=command) as cluster:
        assert cluster.wait(timeout=90) == {"worker:0": 0}
        _assert_allocator(cluster.output("worker", 0), "false", "default")
    env = set_task_env_defaults({"TF_CPP_MIN_LOG_LEVEL": "0"})
    assert env == {"TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPU_ALLOCATOR_USE_BFC": "true"}
