"""``downpour_throughput``: the throughput section of ``downpour`` on its own.

Examples/second of DownpourStrategy (1 and 2 workers, n_fetch = n_push = 1
and 5, batch 64 per worker, each worker one intra-op thread, the ps its own
process, the chief this process; loopback or the cluster's own namespaces)
against plain Keras ``fit`` in one process with one intra-op thread, on the
``downpour`` benchmark's MLP. Every run is its own process; runs are
interleaved round by round and summarised by medians. The full ``downpour``
benchmark adds time to accuracy, communication and staleness (25-35 minutes);
this one takes a few minutes, for the speed goal of Downpour's round.
"""

from benchmarks import _harness
from benchmarks.downpour import throughput

WORKERS = (1, 2)
NS = (1, 5)


def run(quick=False, seed=0):
    steps = 40 if quick else 200
    repeats = 1 if quick else 5
    eps = throughput(
        models=("mlp",), workers=WORKERS, ns=NS, steps=steps, repeats=repeats, seed=seed
    )["mlp"]
    keras_eps = _harness.median(eps["keras-1thread"])
    figures = [
        _harness.figure("mlp", system, "throughput", "examples/s", values, steps=steps)
        for system, values in eps.items()
    ]
    rows = [["keras-1thread", "", "", keras_eps, 1.0]]
    for workers in WORKERS:
        for n in NS:
            median = _harness.median(eps[f"downpour-{workers}w-n{n}"])
            rows.append([f"downpour-{workers}w-n{n}", workers, n, median, median / keras_eps])
    return {
        "candidate": "DownpourStrategy (1 and 2 workers, 1 ps)",
        "peer": "Keras model.fit in one process, one intra-op thread",
        "figures": figures,
        "table": {
            "columns": ["system", "workers", "n_fetch = n_push", "examples/s", "x Keras"],
            "rows": rows,
        },
        "notes": [
            f"MLP (the downpour benchmark's), batch 64 per worker, {steps} steps a run, "
            f"{repeats} interleaved repeats, medians, seed {seed}.",
            "Chief, ps and workers share the machine's 2 cores; Keras's one process has "
            "them to itself.",
        ],
    }
