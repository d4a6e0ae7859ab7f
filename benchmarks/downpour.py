"""``downpour``: DownpourStrategy against synchronous and single-process peers.

Every run is its own process (``benchmarks/_downpour_run.py``) on a fresh
``LocalCluster`` where one is needed; runs of the systems being compared are
interleaved round by round and summarised by medians.

* throughput: examples/second with 1 and 2 workers (each worker one intra-op
  thread, the ps its own process), MLP and small CNN, batch 64 per worker;
* time to accuracy on MNIST-1D and on the bundled digits: training seconds
  until held-out accuracy reaches a fixed target, and the accuracy reached
  within the same training-time budget, for Downpour (2 workers, n_fetch =
  n_push = 1 and 5), MirroredStrategy (2 logical CPUs) and plain Keras;
* communication: bytes pushed and fetched per step, counted from the tensors
  each round sends and receives, for n = 1, 5 (and 10 in the full run);
* staleness: the distribution over every push of the Downpour runs.
"""

import argparse
import collections

import numpy as np

from benchmarks import _harness

# Training-time budgets (seconds) of the time-to-accuracy runs, quick or not;
# their accuracy is marked every CHUNK steps.
BUDGET = {True: {"digits": 6, "mnist1d": 8}, False: {"digits": 20, "mnist1d": 30}}
CHUNK = {"digits": 50, "mnist1d": 100}


def _run(cfg, timeout=900):
    repo = cfg.pop("repo", None)
    return _harness.run_in_process("benchmarks._downpour_run", cfg, timeout, repo=repo)


def _interleave(configs, repeats):
    """Runs every config once per round, rotating the order; returns samples."""
    samples = {name: [] for name in configs}
    names = list(configs)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            samples[name].append(_run(dict(configs[name])))
    return samples


def throughput_cfg(system, model, steps, seed, **downpour):
    """A ``_downpour_run`` throughput run: Keras alone, or Downpour with ``workers`` and ``n``."""
    return dict(task="throughput", system=system, model=model, steps=steps, seed=seed, **downpour)


def throughput_samples(
    models=("mlp", "cnn"), workers=(1, 2), ns=(1, 5), steps=200, repeats=3, seed=0, baseline=None
):
    """Runs of plain Keras (one thread) and Downpour, interleaved: ``{model: {system: [run]}}``.

    Each run is the result of ``_downpour_run.throughput`` (examples/s and the
    CPU milliseconds per step of each kind of process).

    ``baseline``: another checkout whose Downpour runs join the same
    interleaving as ``baseline-downpour-...`` (before/after comparisons).
    """
    out = {}
    for model in models:
        configs = {"keras-1thread": throughput_cfg("keras", model, steps, seed)}
        for n in ns:
            for w in workers:
                cfg = throughput_cfg("downpour", model, steps, seed, workers=w, n=n)
                configs[f"downpour-{w}w-n{n}"] = cfg
                if baseline:
                    configs[f"baseline-downpour-{w}w-n{n}"] = dict(cfg, repo=baseline)
        out[model] = _interleave(configs, repeats)
    return out


def throughput(models=("mlp", "cnn"), **kwargs):
    """Examples/s of plain Keras (one thread) and Downpour, interleaved: ``{model: {system: [...]}}``.

    Keyword arguments: those of :func:`throughput_samples`.
    """
    samples = throughput_samples(models, **kwargs)
    return {
        model: {k: [s["examples_per_second"] for s in v] for k, v in runs.items()}
        for model, runs in samples.items()
    }


def _throughput_section(quick, repeats, seed, figures):
    """Examples/s of one Keras process and of Downpour on 1 and 2 workers: the table's rows."""
    steps = 40 if quick else 200
    rows = []
    for model, eps in throughput(steps=steps, repeats=repeats, seed=seed).items():
        for system, values in eps.items():
            figures.append(
                _harness.figure(
                    model,
                    system,
                    "throughput",
                    "examples/s",
                    values,
                    batch_per_worker=64,
                    steps=steps,
                )
            )
        for n in (1, 5):
            one = _harness.median(eps[f"downpour-1w-n{n}"])
            two = _harness.median(eps[f"downpour-2w-n{n}"])
            rows.append(
                [f"{model}, n={n}", _harness.median(eps["keras-1thread"]), one, two, two / one]
            )
    return rows


def _tta_configs(dataset, quick, seed):
    base = dict(
        task="time_to_accuracy",
        dataset=dataset,
        seed=seed,
        hidden=256,
        lr=0.05,
        budget=BUDGET[quick][dataset],
        chunk=CHUNK[dataset],
        workers=2,
    )
    configs = {
        "keras": dict(base, system="keras", n=1),
        "mirrored-2": dict(base, system="mirrored", n=1),
        "downpour-2w-n1": dict(base, system="downpour", n=1),
        "downpour-2w-n5": dict(base, system="downpour", n=5),
    }
    if not quick:
        configs["downpour-2w-n10"] = dict(base, system="downpour", n=10)
    return configs


def _tta_figures(dataset, system, runs, target, budget):
    hit = _harness.reached(runs)
    final = [r["final_accuracy"] for r in runs]
    figures = [
        _harness.seconds_to_target_figure(
            dataset, system, runs, target, budget_seconds=budget, curves=[r["curve"] for r in runs]
        ),
        _harness.figure(
            dataset, system, "final_accuracy", "fraction", final, budget_seconds=budget
        ),
    ]
    median_hit = _harness.median(hit) if len(hit) * 2 > len(runs) else None
    seconds = (
        f"{median_hit:.1f}" if median_hit is not None else f"not reached ({len(hit)}/{len(runs)})"
    )
    return figures, [dataset, system, target, seconds, _harness.median(final)]


def _time_to_accuracy_section(quick, seed, figures, staleness, comm):
    """Seconds to a common accuracy on both datasets: the table's rows.

    Also collects every push's staleness and, per ``n``, the bytes a step
    pushes and fetches (``comm[n][dataset]``)."""
    rows = []
    for dataset in ("mnist1d", "digits"):
        samples = _interleave(_tta_configs(dataset, quick, seed), 1 if quick else 2)
        target = next(iter(samples.values()))[0]["target"]
        for system, runs in samples.items():
            more, row = _tta_figures(dataset, system, runs, target, BUDGET[quick][dataset])
            figures.extend(more)
            rows.append(row)
            if system.startswith("downpour"):
                n = int(system.rsplit("n", 1)[1])
                comm[n][dataset] = (
                    _harness.median([r["push_bytes_per_step"] for r in runs]),
                    _harness.median([r["fetch_bytes_per_step"] for r in runs]),
                )
                for r in runs:
                    staleness.extend(r["staleness"])
                figures += [
                    _harness.staleness_figure(dataset, system, r["staleness"]) for r in runs
                ]
    return rows


def _communication_section(comm, figures):
    """Bytes a step pushes and fetches on MNIST-1D, per ``n``: the table's rows."""
    rows = []
    for n in sorted(comm):
        push, fetch = comm[n]["mnist1d"]
        rows.append(["", n, push, fetch, comm[1]["mnist1d"][0] / push])
        for metric, value in (("push_bytes_per_step", push), ("fetch_bytes_per_step", fetch)):
            figures.append(
                _harness.figure("mnist1d", f"downpour-2w-n{n}", metric, "bytes/step", [value])
            )
    return rows


def _table(scale_rows, tta_rows, comm_rows):
    rows = [
        ["**throughput (ex/s)**", "keras 1 thread", "downpour 1 worker", "downpour 2 workers"]
        + ["2w / 1w"],
        *scale_rows,
        ["**time to accuracy**", "system", "target", "seconds to target (median)"]
        + ["final accuracy in budget"],
        *tta_rows,
        ["**communication (MNIST-1D MLP)**", "n_fetch = n_push", "push bytes/step"]
        + ["fetch bytes/step", "reduction vs n=1"],
        *comm_rows,
    ]
    return {"columns": ["section / model", "a", "b", "c", "d"], "rows": rows}


def run(quick=False, seed=0):
    repeats = 1 if quick else 3
    figures, staleness = [], []
    comm = collections.defaultdict(dict)
    scale_rows = _throughput_section(quick, repeats, seed, figures)
    tta_rows = _time_to_accuracy_section(quick, seed, figures, staleness, comm)
    comm_rows = _communication_section(comm, figures)
    hist = np.bincount(staleness) if staleness else np.zeros(1, int)
    stale_row = ", ".join(f"{k}: {v}" for k, v in enumerate(hist.tolist()) if v)
    notes = [
        f"staleness over {len(staleness)} pushes (value: count): {stale_row}; "
        f"mean {np.mean(staleness) if staleness else 0:.2f}, max {hist.size - 1}",
        f"throughput: {repeats} interleaved repeats, time to accuracy: "
        f"{1 if quick else 2}; seed {seed}; training-time budgets "
        f"{BUDGET[quick]} s; batch 32 per replica, Adagrad(0.05), MLP 256-256",
        "2-core machine: chief, ps and workers share the two cores with each other",
    ]
    return {
        "candidate": "tfdist_ext.DownpourStrategy (asynchronous, LocalCluster on 127.0.0.1)",
        "peer": "plain Keras model.fit in one process; tf.distribute.MirroredStrategy on 2 logical CPUs",
        "figures": figures,
        "table": _table(scale_rows, tta_rows, comm_rows),
        "notes": notes,
    }


def main(argv=None):
    """``python -m benchmarks.downpour``: the throughput section alone, printed, nothing written.

    For iterating on Downpour's speed: e.g. ``--models mlp --workers 1
    --baseline /path/to/other/checkout`` interleaves plain Keras, this
    checkout's Downpour and the other checkout's, and prints medians and
    ratios to ``keras-1thread``.
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.downpour")
    parser.add_argument("--models", nargs="+", default=["mlp"], choices=["mlp", "cnn"])
    parser.add_argument("--workers", nargs="+", type=int, default=[1])
    parser.add_argument("--n", nargs="+", type=int, default=[1, 5], dest="ns")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline", help="another checkout to measure in the same interleaving")
    args = parser.parse_args(argv)
    eps = throughput(
        models=args.models,
        workers=args.workers,
        ns=args.ns,
        steps=args.steps,
        repeats=args.repeats,
        seed=args.seed,
        baseline=args.baseline,
    )
    rows = []
    for model, systems in eps.items():
        keras_eps = _harness.median(systems["keras-1thread"])
        for system, values in systems.items():
            rows.append(
                [
                    model,
                    system,
                    _harness.median(values),
                    _harness.median(values) / keras_eps,
                    ", ".join(f"{v:.0f}" for v in values),
                ]
            )
    print(
        f"throughput, batch 64 per worker, {args.steps} steps, {args.repeats} interleaved "
        f"repeats, seed {args.seed}"
    )
    print(
        _harness.format_table(
            {
                "columns": ["model", "system", "examples/s (median)", "x keras-1thread", "repeats"],
                "rows": rows,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
