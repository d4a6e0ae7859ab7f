"""``tfdist-ext rehearse LAUNCHER``: run a job on this machine as LAUNCHER would.

Every task runs on its own "host", a network namespace with its own address
on one switch (``--bandwidth`` limits each host's link), and is started the
way that launcher starts it, with only the environment it would give:

* ``hosts``: ``tfdist-ext launch --hosts ... --rsh 'ip netns exec tfx-{host}'``;
* ``slurm``: as ``srun --ntasks N tfdist-ext task --ps P -- COMMAND`` starts
  each task (``SLURM_PROCID``, ``SLURM_STEP_NODELIST``, ...);
* ``kubernetes``: as the indexed Job in ``deploy/kubernetes.yaml`` starts
  each pod (``JOB_COMPLETION_INDEX``, ``TFDIST_NUM_TASKS``,
  ``TFDIST_HOST_PATTERN``).

Example::

    sudo tfdist-ext rehearse slurm --tasks 4 --ps 1 -- python train.py

Needs root (network namespaces). Exits with the job's status.
"""

import argparse
import sys

from tfdist_ext import launch
from tfdist_ext.cluster import _environments
from tfdist_ext.cluster import _hosts

RSH = "ip netns exec " + _hosts.PREFIX + "{host}"


def build_parser():
    parser = argparse.ArgumentParser(
        prog="tfdist-ext rehearse",
        usage="%(prog)s {hosts,slurm,kubernetes} --tasks N [options] -- COMMAND [ARGS...]",
        description="Run a job on this machine as a launcher would, each task on its own "
        "network-namespace host.",
    )
    parser.add_argument("launcher", choices=("hosts", "slurm", "kubernetes"))
    parser.add_argument("--tasks", type=int, required=True, help="tasks (hosts), 1 to 10")
    launch.add_job_options(parser)
    parser.add_argument("--bandwidth", help="each host's link rate, e.g. 100mbit")
    parser.add_argument("--max-restarts", type=int, default=0, help="hosts only: as launch's")
    parser.add_argument("--stop-timeout", type=float, default=30.0)
    return parser


def main(argv=None):
    args, command = launch.parse_args(build_parser(), argv)
    if not command:
        return launch.no_command("tfdist-ext rehearse")
    try:
        _environments.jobs(args.tasks, args.ps)
        with _hosts.Hosts(args.tasks, args.bandwidth) as hosts:
            specs = _specs(args, hosts, command)
            restarts = args.max_restarts if args.launcher == "hosts" else 0
            return launch.supervise(specs, restarts, args.stop_timeout, "tfdist-ext rehearse")
    except (ValueError, RuntimeError) as e:
        print(f"tfdist-ext rehearse: error: {e}", file=sys.stderr)
        return 2


def _specs(args, hosts, command):
    addresses = hosts.addresses
    if args.launcher == "hosts":
        return launch.task_specs(addresses, args.ps, args.port, RSH, command)
    specs = []
    for rank, address in enumerate(addresses):
        env = _slurm_env(rank, addresses) if args.launcher == "slurm" else _pod_env(rank, hosts)
        config = _environments.from_addresses(addresses, rank, args.ps)
        task = config["task"]
        argv = [*launch.remote_argv(RSH, address, []), "env", *(f"{k}={v}" for k, v in env.items())]
        argv += [sys.executable, "-m", "tfdist_ext.task", "--ps", str(args.ps)]
        argv += ["--port", str(args.port), "--", *command]
        specs.append(
            launch.TaskSpec(
                name=f"{task['type']}:{task['index']}",
                argv=argv,
                runs_command=_environments.runs_command(config),
                chief=rank == 0,
                env={"TF_CONFIG": ""},  # the launcher's own never reaches a task
            )
        )
    return specs


def _slurm_env(rank, addresses):
    """What ``srun`` gives task ``rank`` of a step of one task per node."""
    subnet = addresses[0].rsplit(".", 1)[0]
    last = [a.rsplit(".", 1)[1] for a in addresses]
    return {
        "SLURM_PROCID": rank,
        "SLURM_NTASKS": len(addresses),
        "SLURM_STEP_NUM_TASKS": len(addresses),
        "SLURM_STEP_NODELIST": f"{subnet}.[{last[0]}-{last[-1]}]",
        "SLURM_STEP_TASKS_PER_NODE": f"1(x{len(addresses)})",
        "SLURM_NODEID": rank,
        "SLURMD_NODENAME": addresses[rank],
    }


def _pod_env(rank, hosts):
    """What the indexed Job of ``deploy/kubernetes.yaml`` gives pod ``rank``."""
    subnet = hosts.addresses[0].rsplit(".", 1)[0]
    return {
        "JOB_COMPLETION_INDEX": rank,
        "TFDIST_NUM_TASKS": len(hosts.addresses),
        # The rehearsal's hosts are 10.214.k.10 + index (index < 10).
        "TFDIST_HOST_PATTERN": subnet + ".1{index}",
    }


if __name__ == "__main__":
    sys.exit(main())
