"""The ``tfdist-ext`` command line.

* ``tfdist-ext server`` runs the task that ``TF_CONFIG`` describes (see
  :mod:`tfdist_ext.server`).
* ``tfdist-ext demo`` runs the main job (see :mod:`tfdist_ext._demo`).

Example::

    TF_CONFIG='{"cluster": {"worker": ["127.0.0.1:2222"]}, "task": {"type": "worker", "index": 0}}' \\
        tfdist-ext server
    tfdist-ext demo --epochs 5
"""

import importlib
import sys

USAGE = """\
usage: tfdist-ext COMMAND [options]

Classic distributed deep learning for Keras (tf.distribute strategies).

commands:
  server   run one TensorFlow cluster task (a gRPC tf.distribute.Server) as the
           TF_CONFIG environment variable describes; unauthenticated: run it on
           a trusted private network only (see SECURITY.md)
  launch   start every task of a job on a list of hosts (ssh), stream the
           chief's output, stop the job when the chief ends or a task fails
  task     run this task of a job started by srun, a Kubernetes indexed Job or
           launch: the command, or a server, with TF_CONFIG set
  rehearse run a job as Slurm, Kubernetes or launch would, every task in its own
           network namespace on this machine (root)
  demo     train an MLP on the bundled digits with DownpourStrategy on a local
           cluster (2 workers, 1 ps) and compare it with single-process Keras

'tfdist-ext COMMAND --help' explains a command's options."""


def main(argv: list[str] | None = None) -> int:
    """Runs ``tfdist-ext COMMAND``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "server":
        # Each command imports only what it runs: `tfdist-ext server` starts fast.
        from tfdist_ext import server

        return server.main(rest)
    if command in ("launch", "task", "rehearse"):
        return importlib.import_module(f"tfdist_ext.{command}").main(rest)
    if command == "demo":
        from tfdist_ext import _demo

        return _demo.main(rest)
    print(f"tfdist-ext: error: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
