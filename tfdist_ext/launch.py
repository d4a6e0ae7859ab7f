"""``tfdist-ext launch``: start every task of a job on a list of hosts.

The ``torchrun``/``horovodrun`` experience for a TensorFlow cluster::

    tfdist-ext launch --hosts node1,node2,node3 --ps 1 -- python train.py

Each host runs one task, in the order ``SlurmClusterResolver`` uses:
with ``--ps N``, the first host is the chief (it runs the command), the next
N are ``ps`` tasks and the rest workers (both run ``tfdist-ext server``);
without ``--ps`` every host is a worker that runs the command
(``MultiWorkerMirroredStrategy``). A task is started through ``--rsh`` (ssh
by default; none for ``localhost``) as ``python -m tfdist_ext.task`` with its
``TF_CONFIG``. The chief's output is streamed as it is; the other tasks'
lines are prefixed with their name. The job ends when the chief ends: with
its status, once every other task running the command has ended too (or
``--stop-timeout`` has passed); every remaining task is then stopped. If a
task fails first, every task is stopped and the whole job is started again,
up to ``--max-restarts`` times (``keras.callbacks.BackupAndRestore`` makes a
restarted ``fit`` resume from its last completed epoch).
"""

import argparse
import json
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass

from tfdist_ext.cluster import _environments

LOCAL_HOSTS = ("localhost", "127.0.0.1")
DEFAULT_RSH = "ssh -o BatchMode=yes -tt {host} {command}"


@dataclass
class TaskSpec:
    """One task to start: its name (``job:index``), argv, and whether it runs the command."""

    name: str
    argv: list
    runs_command: bool
    chief: bool
    env: dict | None = None


def build_parser():
    parser = argparse.ArgumentParser(
        prog="tfdist-ext launch",
        usage="%(prog)s --hosts H1,H2,... [options] -- COMMAND [ARGS...]",
        description="Start every task of a TensorFlow cluster job on a list of hosts, "
        "stream the chief's output, stop every task when the chief ends or a task fails.",
    )
    parser.add_argument("--hosts", required=True, help="comma-separated hosts, one task each")
    add_job_options(parser)
    parser.add_argument(
        "--rsh",
        default=DEFAULT_RSH,
        help="how a task starts on a host: {host} is the host, {command} the "
        "shell-quoted command (without {command}, the command's words are appended)",
    )
    parser.add_argument("--max-restarts", type=int, default=0, help="whole-job restarts")
    parser.add_argument(
        "--stop-timeout", type=float, default=30.0, help="seconds a task gets to stop"
    )
    return parser


def task_specs(hosts, num_ps, port, rsh, command, python=sys.executable):
    """The tasks ``tfdist-ext launch`` starts, one per host."""
    addresses, seen = [], {}
    for host in hosts:
        seen[host] = seen.get(host, -1) + 1
        addresses.append(f"{host}:{port + seen[host]}")
    specs = []
    for rank, host in enumerate(hosts):
        config = _environments.from_addresses(addresses, rank, num_ps)
        task = config["task"]
        inner = ["env", f"TF_CONFIG={json.dumps(config)}", python, "-m", "tfdist_ext.task", "--"]
        inner += command
        specs.append(
            TaskSpec(
                name=f"{task['type']}:{task['index']}",
                argv=inner if host in LOCAL_HOSTS else remote_argv(rsh, host, inner),
                runs_command=_environments.runs_command(config),
                chief=rank == 0,
            )
        )
    return specs


def remote_argv(rsh, host, argv):
    """``rsh`` (a template) with ``{host}``, and ``{command}`` as one shell-quoted word."""
    words = []
    for word in shlex.split(rsh):
        if word == "{command}":
            words.append(shlex.join(argv))
        else:
            words.append(word.replace("{host}", host))
    return words if "{command}" in rsh else words + list(argv)


def add_job_options(parser):
    """``--ps`` and ``--port``, which every launching command takes."""
    parser.add_argument("--ps", type=int, default=0, help="ps tasks of the job (default 0)")
    parser.add_argument("--port", type=int, default=2222, help="the tasks' first port on a host")


def parse_args(parser, argv):
    """``(args, command)``: ``argv`` (default: this process's) split at its
    first ``--``, the options before it parsed by ``parser``."""
    options, command = split_command(sys.argv[1:] if argv is None else argv)
    return parser.parse_args(options), command


def no_command(prog):
    """Says that the command after ``--`` is missing; the exit status."""
    print(f"{prog}: error: no command after --", file=sys.stderr)
    return 2


def split_command(argv):
    """``(options, command)``: ``argv`` split at its first ``--``."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


def main(argv=None):
    args, command = parse_args(build_parser(), argv)
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    if not command:
        return no_command("tfdist-ext launch")
    try:
        specs = task_specs(hosts, args.ps, args.port, args.rsh, command)
    except _environments.ClusterEnvironmentError as e:
        print(f"tfdist-ext launch: error: {e}", file=sys.stderr)
        return 2
    return supervise(specs, args.max_restarts, args.stop_timeout, "tfdist-ext launch")


def supervise(specs, max_restarts, stop_timeout, prog):
    """Runs the job until the chief ends, restarting it after a failure; its exit status."""
    # The supervisor (signals, processes) loads only when a job runs.
    from tfdist_ext import _supervise

    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for attempt in range(max_restarts + 1):
            if attempt:
                print(f"{prog}: restarting the job ({attempt}/{max_restarts})", file=sys.stderr)
            job, failed = _supervise.Job(specs, stop_timeout), None
            try:
                status, failed = job.run(stop)
                if failed is not None and not stop.is_set():
                    print(f"{prog}: task {failed} exited with status {status}", file=sys.stderr)
            finally:
                job.stop(after_failure=failed is not None)
            for name, code in job.late_failures.items():
                print(
                    f"{prog}: task {name} exited with status {code} after the chief "
                    "had ended; the job is done",
                    file=sys.stderr,
                )
            if failed is None or stop.is_set():
                return status
            time.sleep(1.0)  # the ports the stopped tasks held are free again
        return status
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    sys.exit(main())
