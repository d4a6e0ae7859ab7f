"""Runs one benchmark: ``python -m benchmarks.run NAME [--quick] [--seed N]``.

Prints the benchmark's table and writes ``benchmarks/results/NAME.json``
(``NAME.quick.json`` with ``--quick``, so a smoke run never overwrites the
committed figures).
"""

import argparse
import importlib
import os
import sys
import time

from benchmarks import _harness
from tfdist_ext.cluster._tf_config import set_task_env_defaults

BENCHMARKS = tuple(
    sorted(
        name[:-3]
        for name in os.listdir(os.path.dirname(os.path.abspath(__file__)))
        if name.endswith(".py") and not name.startswith("_") and name != "run.py"
    )
)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run")
    parser.add_argument("name", choices=BENCHMARKS)
    parser.add_argument(
        "--quick", action="store_true", help="few repeats and small sizes: a smoke run"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--readme",
        action="store_true",
        help="only write the committed results' table into README.md and redraw its plot (no run)",
    )
    args = parser.parse_args(argv)
    if args.readme:
        found = _harness.update_readme(args.name)
        _harness.write_plot(args.name)
        print("README.md updated" if found else f"README.md has no table for {args.name}")
        return 0 if found else 1
    # Every process of a run, candidates and peers alike, in the environment
    # a LocalCluster task gets (TensorFlow's pooling CPU allocator included),
    # so that no side of a comparison has an allocator the other lacks.
    set_task_env_defaults(os.environ)
    module = importlib.import_module(f"benchmarks.{args.name}")
    start = time.time()
    result = module.run(quick=args.quick, seed=args.seed)
    elapsed = time.time() - start
    path = _harness.write_result(
        args.name, result, quick=args.quick, seed=args.seed, elapsed=elapsed
    )
    print(
        f"\n{args.name}: candidate = {result['candidate']}; peer = {result['peer']}"
        f" (seed {args.seed}, {elapsed:.0f}s)"
    )
    print(_harness.format_table(result["table"]))
    for note in result.get("notes", ()):
        print(f"- {note}")
    print(f"\nwrote {os.path.relpath(path)}")
    if not args.quick and _harness.update_readme(args.name):
        print("updated its table in README.md")
    if not args.quick and _harness.write_plot(args.name):
        print(f"drew benchmarks/results/{args.name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
