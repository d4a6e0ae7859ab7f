"""``downpour_throughput``: the throughput section of ``downpour`` on its own.

Examples/second of DownpourStrategy (1 and 2 workers, n_fetch = n_push = 1
and 5, batch 64 per worker, each worker one intra-op thread, the ps its own
process, the chief this process; loopback or the cluster's own namespaces)
against plain Keras ``fit`` in one process with one intra-op thread, on the
``downpour`` benchmark's MLP. Every run is its own process; runs are
interleaved round by round and summarised by medians. The full ``downpour``
benchmark adds time to accuracy, communication and staleness (25-35 minutes);
this one takes a few minutes, for the speed goal of Downpour's round.

Each run also records the CPU time every process of the run used per step
(``/proc``: chief, ps and workers for Downpour; Keras's one process). Their
sum over the machine's cores is the shortest step the machine could give
that work, so a row's "CPU ceiling" (examples/s at that step) says how far
the row is from this machine's limit, whatever the overlap.
"""

import os

from benchmarks import _harness
from benchmarks.downpour import throughput_samples

WORKERS = (1, 2)
NS = (1, 5)
BATCH = 64


def _cpu_ms(run):
    """CPU milliseconds per step of every process of a run together (``None``: not recorded)."""
    parts = run.get("cpu_ms_per_step")
    return None if parts is None else sum(parts.values())


def _rows(samples, eps, keras_eps, cores):
    """Per system: examples/s, CPU per step and the ceiling that CPU allows."""
    rows = []
    systems = [("keras-1thread", "", "")] + [
        (f"downpour-{w}w-n{n}", w, n) for w in WORKERS for n in NS
    ]
    for system, workers, n in systems:
        median = _harness.median(eps[system])
        cpu = _harness.median([_cpu_ms(r) for r in samples[system]])
        ceiling = BATCH * cores / (cpu / 1e3)
        rows.append(
            [
                system,
                workers,
                n,
                median,
                median / keras_eps,
                cpu,
                ceiling,
                ceiling / keras_eps,
                median / ceiling,
            ]
        )
    return rows


def run(quick=False, seed=0):
    steps = 40 if quick else 200
    repeats = 1 if quick else 5
    cores = os.cpu_count()
    samples = throughput_samples(
        models=("mlp",), workers=WORKERS, ns=NS, steps=steps, repeats=repeats, seed=seed
    )["mlp"]
    eps = {system: [r["examples_per_second"] for r in runs] for system, runs in samples.items()}
    keras_eps = _harness.median(eps["keras-1thread"])
    figures = [
        _harness.figure("mlp", system, "throughput", "examples/s", values, steps=steps)
        for system, values in eps.items()
    ]
    figures += [
        _harness.figure(
            "mlp", system, "cpu", "CPU ms per step (all processes)", [_cpu_ms(r) for r in runs]
        )
        for system, runs in samples.items()
    ]
    rows = _rows(samples, eps, keras_eps, cores)
    return {
        "candidate": "DownpourStrategy (1 and 2 workers, 1 ps)",
        "peer": "Keras model.fit in one process, one intra-op thread",
        "figures": figures,
        "table": {
            "columns": [
                "system",
                "workers",
                "n_fetch = n_push",
                "examples/s",
                "x Keras",
                "CPU ms/step",
                "CPU ceiling ex/s",
                "ceiling x Keras",
                "achieved / ceiling",
            ],
            "rows": rows,
        },
        "notes": [
            f"MLP (the downpour benchmark's), batch {BATCH} per worker, {steps} steps a run, "
            f"{repeats} interleaved repeats, medians, seed {seed}.",
            "Chief, ps and workers share the machine's 2 cores; Keras's one process has "
            "them to itself.",
            f"CPU ms/step: user + system CPU of every process of the run (/proc) during the "
            f"timed fit, per step of {BATCH} examples. CPU ceiling: the examples/s if the "
            f"{cores} cores did that work with no idle time (batch x cores / CPU per step).",
        ],
    }
