"""``allocator``: which CPU memory allocator a cluster task should run with.

``LocalCluster`` gives every task TensorFlow's pooling CPU allocator
(``TF_CPU_ALLOCATOR_USE_BFC=true``, ``_tf_config.TASK_ENV_DEFAULTS``).
TensorFlow's default allocator takes each tensor from ``malloc``, and glibc
maps every block above 32 MB fresh, so a large temporary faults on each of
its 4 KB pages; the pool keeps freed blocks. glibc told never to map
(``MALLOC_MMAP_MAX_=0``) and never to give the top of its heap back
(``MALLOC_TRIM_THRESHOLD_``) removes the same faults without TensorFlow's
pool. Three variants, every process of a run (chief, tasks, the Keras
peer) in the variant's environment:

* ``pool``: ``TF_CPU_ALLOCATOR_USE_BFC=true`` (the default of a task);
* ``glibc``: TensorFlow's default allocator, glibc without mmap or trim;
* ``default``: TensorFlow's default allocator and glibc's defaults.

Workloads: single-process Keras (one intra-op thread) and Downpour with 1
worker at n_fetch = n_push = 1 and 5 on loopback (``downpour_throughput``'s
670k-parameter MLP: small tensors), and three ``network`` rows of 2
workers: DGC 99.9% on the 10M model at 100 Mbit/s (its compressor works on
40 MB tensors), dense all-reduce on the 1M model at 1 Gbit/s, Downpour
n = 5 with 1 shard on the 10M model at 1 Gbit/s. Runs interleaved, every
(workload, variant) once a round in a rotating order; medians.
"""

import functools

from benchmarks import _harness
from benchmarks import downpour
from benchmarks import network

VARIANTS = {
    "pool": {"TF_CPU_ALLOCATOR_USE_BFC": "true"},
    "glibc": {
        "TF_CPU_ALLOCATOR_USE_BFC": "false",
        "MALLOC_MMAP_MAX_": "0",
        "MALLOC_TRIM_THRESHOLD_": str(2**32 - 1),
    },
    "default": {"TF_CPU_ALLOCATOR_USE_BFC": "false"},
}
# Unset for a variant that does not set them (the runner's own values are replaced).
_VARIABLES = sorted({name for env in VARIANTS.values() for name in env})


def _workloads(quick, seed):
    """``{name: (module, cfg, metric, unit)}``; ``metric(cfg, result)`` reads a run's figure."""
    steps = 40 if quick else 200
    out = {}
    loopback = {"keras 1 thread": downpour.throughput_cfg("keras", "mlp", steps, seed)}
    for n in (1, 5):
        cfg = downpour.throughput_cfg("downpour", "mlp", steps, seed, workers=1, n=n)
        loopback[f"downpour 1w n={n}"] = cfg
    for name, cfg in loopback.items():
        out[name] = ("benchmarks._downpour_run", cfg, _examples_per_second, "examples/s")
    if quick:
        return out

    def base(model, link):
        # target not reached: a run trains for its budget.
        return dict(network.base_cfg(model, link, seed), target=2.0, budget_seconds=8.0)

    sync = dict(system="sync", chunk=5, max_steps=60)
    out["dgc 10M 100mbit"] = (
        "benchmarks._network_run",
        dict(base("10M", "100mbit"), method="dgc", **sync),
        network._step_seconds,
        "s/step",
    )
    out["dense 1M 1gbit"] = (
        "benchmarks._network_run",
        dict(base("1M", "1gbit"), method="dense", **dict(sync, chunk=10)),
        network._step_seconds,
        "s/step",
    )
    out["downpour n=5 ps=1 10M 1gbit"] = (
        "benchmarks._network_run",
        network._downpour_cfg(base("10M", "1gbit"), 5, 1, 5, 20),
        network._step_seconds,
        "s/step",
    )
    return out


def _examples_per_second(cfg, out):
    return out["examples_per_second"]


def _measure(module, cfg, metric, variant):
    """One run of a workload under a variant: its metric."""
    env = {name: VARIANTS[variant].get(name) for name in _VARIABLES}
    return metric(cfg, _harness.run_in_process(module, cfg, env=env))


def run(quick=False, seed=0):
    repeats = 1 if quick else 3
    workloads = _workloads(quick, seed)
    systems = {
        (name, variant): functools.partial(_measure, module, cfg, metric, variant)
        for name, (module, cfg, metric, _) in workloads.items()
        for variant in VARIANTS
    }
    samples = _harness.interleaved(systems, repeats, warmup=0)
    figures, rows = [], []
    for name, (_, _, _, unit) in workloads.items():
        medians = {}
        for variant in VARIANTS:
            values = samples[(name, variant)]
            figures.append(_harness.figure(name, variant, "speed", unit, values))
            medians[variant] = _harness.median(values)
        # Speed against the pool's (above 1: faster), for a rate or a time.
        speed = {
            v: m / medians["pool"] if unit == "examples/s" else medians["pool"] / m
            for v, m in medians.items()
        }
        rows.append([name, unit, *medians.values(), speed["glibc"], speed["default"]])
    return {
        "candidate": "TensorFlow's pooling CPU allocator (TF_CPU_ALLOCATOR_USE_BFC=true)",
        "peer": "glibc without mmap or trim; TensorFlow's and glibc's defaults",
        "figures": figures,
        "table": {
            "columns": [
                "workload",
                "unit",
                "pool",
                "glibc no mmap",
                "default",
                "glibc / pool speed",
                "default / pool speed",
            ],
            "rows": rows,
        },
        "notes": [
            f"{repeats} interleaved repeats (every workload and variant once a round, "
            f"rotating order), medians, seed {seed}.",
            "Every process of a run (chief, cluster tasks, the Keras peer) in the variant's "
            "environment: "
            + "; ".join(
                f"{v}: " + " ".join(f"{k}={x}" for k, x in env.items())
                for v, env in VARIANTS.items()
            )
            + ".",
            "Speed ratios above 1: the variant is faster than the pool on that workload.",
        ],
    }
