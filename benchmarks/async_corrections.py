"""``async_corrections``: Downpour's staleness corrections against synchronous all-reduce.

Two workers, worker 1 slowed ``SLOWDOWN`` times by ``LocalCluster.throttle``
(SIGSTOP/SIGCONT: a real straggler) and ``n_fetch = N_FETCH`` steps between
fetches (``n_push = 1``), so that a push's mean staleness is several server
updates. On the bundled digits and on MNIST-1D, within the same training-time
budget: held-out accuracy at the end and seconds to the target accuracy of

* plain Downpour,
* Downpour + ``StalenessAwareLR`` (rate / staleness),
* Downpour + ``DelayCompensation(lam)`` (DC-ASGD),
* Downpour with ``max_staleness = 2`` (stale synchronous parallel),
* EASGD (``ElasticAveragingStrategy``, ``tau = N_FETCH``, the default
  ``alpha = 0.9 / 2``, the same SGD locally); its "staleness" is the other
  replica's exchanges with the centre between two of this replica's,
* synchronous all-reduce: ``tf.distribute.MirroredStrategy`` on 2 logical
  CPUs, the synchronous peer of the ``downpour`` benchmark (unthrottled: one
  process cannot slow one of its replicas; a synchronous run with this
  straggler would run at its pace).

Each ``fit`` call starts EASGD's replicas from the centre; the benchmark
trains in chunks of ``fit`` calls (an evaluation between chunks), so its
replicas are re-centred every chunk.

Every run is its own process (``benchmarks/_downpour_run.py``, the
``downpour`` benchmark's runner); runs are interleaved per dataset. Each
Downpour run's staleness histogram is plotted to
``benchmarks/results/async_corrections_DATASET[.quick].png``.
"""

import os

import numpy as np

from benchmarks import _harness
from benchmarks.downpour import _interleave

SLOWDOWN = 4
N_FETCH = 8
LAM = 2.0
MAX_STALENESS = 2
SYSTEMS = {
    "downpour": {},
    "+StalenessAwareLR": {"staleness_policy": {"class_name": "StalenessAwareLR"}},
    "+DelayCompensation": {
        "staleness_policy": {"class_name": "DelayCompensation", "config": {"lam": LAM}}
    },
    f"SSP s={MAX_STALENESS}": {"max_staleness": MAX_STALENESS},
}
EASGD = f"EASGD tau={N_FETCH}"
SYNC = "sync all-reduce"


def _configs(dataset, quick, seed):
    base = dict(
        task="time_to_accuracy",
        dataset=dataset,
        seed=seed,
        hidden=256,
        optimizer="sgd",
        lr=0.1,
        budget={"digits": 8 if quick else 25, "mnist1d": 10 if quick else 35}[dataset],
        chunk={"digits": 50, "mnist1d": 100}[dataset],
        warmup=20,
        workers=2,
    )
    configs = {
        name: dict(base, system="downpour", n=1, n_fetch=N_FETCH, slowdown=SLOWDOWN, **extra)
        for name, extra in SYSTEMS.items()
    }
    configs[EASGD] = dict(base, system="easgd", n=1, tau=N_FETCH, slowdown=SLOWDOWN)
    configs[SYNC] = dict(base, system="mirrored", n=1)
    return configs


def _plot(dataset, samples, quick):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = [n for n in samples if n != SYNC]
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.4), sharey=True)
    for ax, name in zip(np.atleast_1d(axes), names):
        staleness = [s for r in samples[name] for s in r["staleness"]]
        counts = np.bincount(staleness) if staleness else np.zeros(1, int)
        ax.bar(np.arange(counts.size), counts / max(1, counts.sum()), width=0.9)
        ax.set_title(f"{name}\nmean {np.mean(staleness) if staleness else 0:.1f}", fontsize=9)
        ax.set_xlabel("exchanges between own" if name == EASGD else "staleness (server updates)")
        ax.grid(alpha=0.3)
    np.atleast_1d(axes)[0].set_ylabel("fraction of pushes")
    fig.suptitle(
        f"{dataset}: staleness of every push, 2 workers, worker 1 slowed {SLOWDOWN}x, "
        f"n_fetch={N_FETCH}, n_push=1",
        fontsize=10,
    )
    fig.tight_layout()
    suffix = ".quick" if quick else ""
    path = os.path.join(_harness.RESULTS_DIR, f"async_corrections_{dataset}{suffix}.png")
    os.makedirs(_harness.RESULTS_DIR, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _system_figures(dataset, name, runs, target, staleness):
    figures = [
        _harness.figure(
            dataset,
            name,
            "final_accuracy",
            "fraction",
            [r["final_accuracy"] for r in runs],
            curves=[r["curve"] for r in runs],
        ),
        _harness.seconds_to_target_figure(dataset, name, runs, target),
    ]
    if staleness:
        figures.append(
            _harness.staleness_figure(
                dataset,
                name,
                staleness,
                mean=float(np.mean(staleness)),
                steps_per_worker=[r["steps_per_worker"] for r in runs],
                clock_leads=[r.get("clock_leads") for r in runs],
            )
        )
    return figures


def _dataset_section(dataset, quick, seed, figures, rows):
    """Every system on ``dataset``, one interleaved run each; the runs."""
    samples = _interleave(_configs(dataset, quick, seed), 1)
    target = samples[SYNC][0]["target"]
    sync_final = _harness.median([r["final_accuracy"] for r in samples[SYNC]])
    for name, runs in samples.items():
        final = _harness.median([r["final_accuracy"] for r in runs])
        hit = _harness.reached(runs)
        staleness = [s for r in runs for s in r.get("staleness", [])]
        figures += _system_figures(dataset, name, runs, target, staleness)
        per_worker = sorted(runs[0].get("steps_per_worker", {}).items())
        rows.append(
            [
                dataset,
                name,
                f"{final:.4f}",
                f"{100 * (final - sync_final):+.2f}",
                f"{_harness.median(hit):.1f}" if hit else f"not reached ({target})",
                f"{np.mean(staleness):.2f} / {max(staleness)}" if staleness else "-",
                ", ".join(f"w{k}: {v}" for k, v in per_worker) or "-",
            ]
        )
    return samples


def _notes(seed, plots):
    return [
        f"seed {seed}; one run per system (interleaved); 2 workers, worker 1 slowed "
        f"{SLOWDOWN}x by LocalCluster.throttle; n_fetch={N_FETCH}, n_push=1; SGD(0.1), "
        "MLP 256-256, batch 32 per worker (64 for the 2-replica synchronous peer); "
        "20 warm-up steps (tracing) before the clock starts",
        f"DelayCompensation lam={LAM}; SSP max_staleness={MAX_STALENESS} (fetch blocks); "
        "the synchronous peer (MirroredStrategy, 2 logical CPUs, one process) is not "
        "throttled",
        f"EASGD: ElasticAveragingStrategy(tau={N_FETCH}, alpha=0.45), SGD(0.1) locally; "
        "its staleness column counts the other replica's exchanges with the centre "
        "between two of this replica's; replicas restart from the centre at each fit "
        "call (every 50 steps on digits, 100 on MNIST-1D)",
        "staleness plots: " + ", ".join(os.path.relpath(p) for p in plots if p),
    ]


def run(quick=False, seed=0):
    datasets = ("digits",) if quick else ("digits", "mnist1d")
    figures, rows, plots = [], [], []
    for dataset in datasets:
        samples = _dataset_section(dataset, quick, seed, figures, rows)
        plots.append(_plot(dataset, samples, quick))
    return {
        "candidate": "tfdist_ext.DownpourStrategy with staleness corrections (LocalCluster)",
        "peer": f"plain Downpour; EASGD; synchronous all-reduce ({SYNC}: MirroredStrategy, 2 CPUs)",
        "figures": figures,
        "table": {
            "columns": [
                "dataset",
                "system",
                "final accuracy",
                "vs sync (points)",
                "seconds to target",
                "staleness mean / max",
                "steps per worker",
            ],
            "rows": rows,
        },
        "notes": _notes(seed, plots),
    }
