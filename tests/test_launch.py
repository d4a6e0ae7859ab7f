"""Launching where clusters live: TF_CONFIG from Slurm and Kubernetes, the
hosts launcher, and rehearsals of each on this machine (a network namespace
per host, every task started as its launcher starts it)."""

import json
import os
import subprocess
import sys

import pytest
import yaml

from tests.programs import result_of
from tfdist_ext import launch
from tfdist_ext.cluster import _environments
from tfdist_ext.cluster import _netns

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAM = [sys.executable, "-m", "tests.programs.mw_train"]
needs_namespaces = pytest.mark.skipif(
    bool(_netns.missing_requirements()),
    reason="rehearsals need " + "; ".join(_netns.missing_requirements()),
)


def _cli(*args, timeout, env=None):
    """``tfdist-ext ARGS`` run from the repository root: the finished process."""
    return subprocess.run(
        [sys.executable, "-m", "tfdist_ext.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=REPO,
    )


def _launch_two_local_workers(*command, timeout, options=("--stop-timeout", "5")):
    return _cli(
        "launch", "--hosts", "localhost,localhost", *options, "--", *command, timeout=timeout
    )


def _result(proc):
    """The RESULT the job's chief printed; the job must have succeeded."""
    result = result_of(proc.stdout)
    assert proc.returncode == 0 and result is not None, proc.stdout[-3000:] + proc.stderr[-6000:]
    return result


def test_tasks_are_ordered_chief_ps_worker_as_slurms_resolver_orders_them():
    addresses = [f"h{i}:2222" for i in range(4)]
    configs = [_environments.from_addresses(addresses, r, num_ps=1) for r in range(4)]
    assert configs[0]["cluster"] == {
        "chief": ["h0:2222"],
        "ps": ["h1:2222"],
        "worker": ["h2:2222", "h3:2222"],
    }
    assert [c["task"] for c in configs] == [
        {"type": "chief", "index": 0},
        {"type": "ps", "index": 0},
        {"type": "worker", "index": 0},
        {"type": "worker", "index": 1},
    ]
    assert [_environments.runs_command(c) for c in configs] == [True, False, False, False]
    synchronous = _environments.from_addresses(addresses[:2], 1, num_ps=0)
    assert synchronous["task"] == {"type": "worker", "index": 1}
    assert _environments.runs_command(synchronous)
    with pytest.raises(ValueError, match="cannot hold a chief, 1 ps and at least one worker"):
        _environments.jobs(2, 1)


@pytest.mark.timeout(60)
def test_slurm_environment_gives_the_cluster_tensorflows_resolver_reads():
    env = {
        "SLURM_PROCID": "3",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_STEP_NODELIST": "node[1-2]",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    }
    config = _environments.tf_config(env, num_ps=1, port=3000)
    assert config["cluster"] == {
        "chief": ["node1:3000"],
        "ps": ["node1:3001"],
        "worker": ["node2:3000", "node2:3001"],
    }
    assert config["task"] == {"type": "worker", "index": 1}
    assert "SLURM_PROCID" not in os.environ  # read, not leaked into this process


def _manifest():
    with open(os.path.join(REPO, "deploy", "kubernetes.yaml")) as f:
        service, job = yaml.safe_load_all(f)
    return service, job


def test_kubernetes_manifest_gives_every_pod_its_tf_config():
    service, job = _manifest()
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == int(env["TFDIST_NUM_TASKS"])
    assert (
        service["spec"]["clusterIP"] == "None" and pod["subdomain"] == service["metadata"]["name"]
    )
    command = container["command"]
    assert command[:2] == ["tfdist-ext", "task"] and "--" in command
    options, _ = launch.split_command(command[2:])
    args = (
        __import__("tfdist_ext.task", fromlist=["build_parser"]).build_parser().parse_args(options)
    )
    assert (
        args.port == service["spec"]["ports"][0]["port"] == container["ports"][0]["containerPort"]
    )
    name = job["metadata"]["name"]
    configs = [
        _environments.tf_config({**env, "JOB_COMPLETION_INDEX": str(i)}, args.ps, args.port)
        for i in range(spec["completions"])
    ]
    # A pod of an indexed Job is <job>-<index>; the headless Service is its subdomain.
    hosts = [f"{name}-{i}.{service['metadata']['name']}:{args.port}" for i in range(len(configs))]
    assert all(c["cluster"] == {"worker": hosts} for c in configs)
    assert [c["task"]["index"] for c in configs] == list(range(len(configs)))


def test_a_task_outside_any_cluster_manager_gets_one_clear_error():
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "SLURM_PROCID")}
    proc = _cli("task", "--", "true", env=env, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("tfdist-ext task: error: no cluster in the environment")
    bad = dict(env, JOB_COMPLETION_INDEX="0")
    proc = _cli("task", "--", "true", env=bad, timeout=60)
    assert "needs TFDIST_NUM_TASKS and TFDIST_HOST_PATTERN" in proc.stderr


def test_launch_starts_remote_tasks_through_rsh_with_one_quoted_command():
    specs = launch.task_specs(
        ["a", "b", "localhost"], 0, 2222, launch.DEFAULT_RSH, ["python", "train.py", "--x=1 2"]
    )
    assert [s.name for s in specs] == ["worker:0", "worker:1", "worker:2"]
    remote = specs[0].argv
    assert remote[:5] == ["ssh", "-o", "BatchMode=yes", "-tt", "a"] and len(remote) == 6
    assert remote[5].endswith("-m tfdist_ext.task -- python train.py '--x=1 2'")
    config = json.loads(specs[2].argv[1][len("TF_CONFIG=") :])  # localhost: no ssh
    assert specs[2].argv[0] == "env" and config["cluster"]["worker"][2] == "localhost:2222"
    netns = launch.task_specs(["h"], 0, 2222, "ip netns exec tfx-{host}", ["python"])[0].argv
    assert netns[:4] == ["ip", "netns", "exec", "tfx-h"] and netns[-1] == "python"


@pytest.mark.timeout(90)
def test_a_failed_task_stops_the_job_with_its_status(tmp_path):
    # worker 1 fails at once; worker 0 would run for minutes: the launcher
    # stops it and exits with worker 1's status.
    code = (
        "import json, os, sys, time; t = json.loads(os.environ['TF_CONFIG'])['task']['index'];"
        "sys.exit(3) if t == 1 else time.sleep(300)"
    )
    proc = _launch_two_local_workers(sys.executable, "-c", code, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert "task worker:1 exited with status 3" in proc.stderr


def _launch_lines(out, options, *lines):
    """Two local workers running ``lines`` of Python: ``t`` is the task's index,
    ``out`` the directory ``out``; the finished launcher."""
    code = (
        "import json, os, signal, sys, time; t = json.loads(os.environ['TF_CONFIG'])"
        "['task']['index']; out = sys.argv[1]\n" + "\n".join(lines)
    )
    return _launch_two_local_workers(
        sys.executable, "-c", code, str(out), timeout=60, options=options
    )


@pytest.mark.timeout(90)
def test_after_a_failure_synchronous_peers_end_by_themselves_unsignalled(tmp_path):
    # As TensorFlow's surviving workers do, worker 0 fails on its own soon
    # after worker 1; a SIGTERM (TensorFlow's preemption notice) would only
    # delay that, so the launcher sends none while the peer may still end.
    proc = _launch_lines(
        tmp_path,
        ("--stop-timeout", "30"),
        "signal.signal(signal.SIGTERM, lambda *_: open(os.path.join(out, 'term'), 'w').close())",
        "time.sleep(1.5) if t == 0 else None",
        "sys.exit(1 if t == 0 else 3)",
    )
    assert proc.returncode == 3, proc.stderr
    assert "task worker:1 exited with status 3" in proc.stderr
    assert not os.path.exists(tmp_path / "term"), "a surviving worker was sent SIGTERM"


@pytest.mark.timeout(90)
def test_a_task_failing_after_the_chief_ended_does_not_rerun_the_job(tmp_path):
    # The chief (worker 0) has finished the job; worker 1 is killed while it
    # exits. Running the job again would train it again from its start.
    proc = _launch_lines(
        tmp_path,
        ("--max-restarts", "2"),
        "open(os.path.join(out, f'runs-{t}'), 'a').write('run\\n')",
        "time.sleep(2) if t == 1 else None",
        "os.kill(os.getpid(), signal.SIGKILL) if t == 1 else sys.exit(0)",
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "runs-0").read_text() == "run\n"
    assert "task worker:1 exited with status -9 after the chief had ended" in proc.stderr
    assert "restarting" not in proc.stderr


def _rehearse(launcher, tasks, out, *args, options=(), timeout=150):
    proc = _cli(
        "rehearse",
        launcher,
        "--tasks",
        str(tasks),
        *options,
        "--",
        *PROGRAM,
        *args,
        str(out),
        timeout=timeout,
    )
    result = _result(proc)
    assert not [n for n in os.listdir("/run/netns") if n.startswith("tfx-")], "hosts left behind"
    return result, proc.stderr


@needs_namespaces
@pytest.mark.timeout(180)
def test_hosts_launcher_rehearsal_survives_a_killed_worker_by_restarting(tmp_path):
    # Worker 1 is killed at the end of epoch 1: worker 0 raises the strategy's
    # error, the launcher stops and restarts the job, and BackupAndRestore
    # resumes it at epoch 2. Only the chief wrote checkpoints and logs.
    result, stderr = _rehearse(
        "hosts", 2, tmp_path, "sync", "--die", "1:1", options=["--max-restarts", "1"]
    )
    assert "MultiWorkerMirroredStrategy: a task of the cluster stopped" in stderr
    assert "unhealthy: /job:worker/replica:0/task:1" in stderr
    assert "restarting the job (1/1)" in stderr
    assert result["workers"] == 2 and result["epochs"] == [2, 3]
    assert result["history"]["val_accuracy"][-1] > 0.8
    assert result["checkpoints"] == [f"model-{e}.keras" for e in range(1, 5)]
    assert sorted(os.listdir(tmp_path / "logs")) == ["train", "validation"]
    for part in ("train", "validation"):
        events = os.listdir(tmp_path / "logs" / part)
        assert len(events) == 2, events  # one per attempt, both the chief's
    assert not os.path.exists(tmp_path / "backup"), "the backup outlived the finished fit"


@needs_namespaces
@pytest.mark.timeout(180)
def test_slurm_rehearsal_trains_downpour_with_servers_started_by_the_same_line(tmp_path):
    result, _ = _rehearse("slurm", 4, tmp_path, "downpour", options=["--ps", "1"])
    assert result["task"] == ["chief", 0]
    assert result["history"]["loss"][-1] < result["history"]["loss"][0]
    assert result["checkpoints"] == [f"model-{e}.keras" for e in range(1, 5)]


@needs_namespaces
@pytest.mark.timeout(180)
def test_kubernetes_rehearsal_trains_synchronously_on_dict_inputs(tmp_path):
    result, _ = _rehearse("kubernetes", 2, tmp_path, "sync", options=["--bandwidth", "1gbit"])
    assert result["workers"] == 2 and result["epochs"] == [0, 1, 2, 3]
    assert result["history"]["val_accuracy"][-1] > 0.8


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_each_worker_reads_its_own_input_from_a_function(tmp_path):
    # distribute_datasets_from_function on 127.0.0.1 through the launcher.
    proc = _launch_two_local_workers(
        *PROGRAM, "sync", str(tmp_path), "--input", "from_function", timeout=100
    )
    result = _result(proc)
    assert result["workers"] == 2 and result["epochs"] == [0, 1, 2, 3]
    assert result["history"]["loss"][-1] < result["history"]["loss"][0]
