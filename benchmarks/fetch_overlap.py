"""``fetch_overlap``: Downpour's fetch after its push, or during it, on a slow link.

``DownpourStrategy(fetch_waits_for_push=False)`` reads a fetch while the
worker's previous push is applied, so the two cross the worker's link in
both directions at once instead of one after the other, at the price of one
more push of staleness. This benchmark measures both orders in one
interleaved run: 1 ps, 1 and 2 workers, every task behind a 100 Mbit/s link
(``LocalCluster(bandwidth=...)``), the ``network`` benchmark's
1.05M-parameter MLP on MNIST-1D, n_fetch = n_push = 1, Adagrad. Each run is
``benchmarks._network_run``'s Downpour run (one ``fit`` per chunk of 20
steps, rounds of 5, veth byte counters, held-out accuracy after each chunk).
Reported per row: seconds per step (one worker's batch), the link-time bound
(the busiest link's larger direction at the link rate, compute left out:
about 6 ms of a 0.3-0.9 s step), achieved / bound, the mean staleness and the
final held-out accuracy.
"""

from benchmarks import _harness
from benchmarks.network import DOWNPOUR_LR
from benchmarks.network import LINKS

LINK = "100mbit"
HIDDEN = 1000  # the network benchmark's 1M model
WORKERS = (1, 2)
CHUNK = 20


def _configs(quick, seed):
    steps = 20 if quick else 40
    configs = {}
    for workers in WORKERS:
        for waits in (True, False):
            name = f"{workers}w " + ("fetch after push" if waits else "fetch during push")
            configs[name] = dict(
                system="downpour",
                workers=workers,
                hidden=HIDDEN,
                bandwidth=LINK,
                seed=seed,
                n=1,
                ps=1,
                chunk=CHUNK,
                # The first half chunk is an untimed warm-up (it traces).
                max_steps=steps + CHUNK // 2,
                downpour_lr=DOWNPOUR_LR,
                fetch_waits_for_push=waits,
            )
    return configs


def run(quick=False, seed=0):
    configs = _configs(quick, seed)
    repeats = 1 if quick else 3
    names = list(configs)
    runs = {name: [] for name in names}
    for r in range(repeats):  # interleaved, the order rotating each round
        for name in names[r % len(names) :] + names[: r % len(names)]:
            runs[name].append(
                _harness.run_in_process("benchmarks._network_run", configs[name], timeout=900)
            )
    rate = LINKS[LINK]
    figures, rows = [], []
    medians = {}
    for name in names:
        step = _harness.median([o["chunk_step_seconds"] for o in runs[name]])
        busiest = _harness.median(
            [max(max(v) for v in o["link_bytes_per_step"].values()) for o in runs[name]]
        )
        bound = 8 * busiest / rate
        staleness = _harness.median([o["staleness_mean"] for o in runs[name]])
        accuracy = _harness.median([o["curve"][-1][2] for o in runs[name]])
        medians[name] = step
        figures.append(
            _harness.figure(
                "1M, 100mbit, n=1",
                name,
                "step",
                "s",
                [o["chunk_step_seconds"] for o in runs[name]],
                staleness_mean=[o["staleness_mean"] for o in runs[name]],
                final_accuracy=[o["curve"][-1][2] for o in runs[name]],
            )
        )
        rows.append(
            [name, step, 64 / step, busiest / 1e6, bound, bound / step, staleness, accuracy]
        )
    for row in rows:
        workers = row[0].split()[0]
        row.append(medians[f"{workers} fetch after push"] / row[1])
    return {
        "candidate": "DownpourStrategy(fetch_waits_for_push=False)",
        "peer": "DownpourStrategy() (the fetch reads after the push is applied)",
        "figures": figures,
        "table": {
            "columns": [
                "system",
                "step s",
                "examples/s",
                "busiest link MB/step",
                "link bound s",
                "achieved / bound",
                "staleness mean",
                "final accuracy",
                "x fetch after push",
            ],
            "rows": rows,
        },
        "notes": [
            f"1 and 2 workers, 1 ps, {LINK} per task, MLP 40-{HIDDEN}-{HIDDEN}-10 (1.05M "
            f"parameters), n_fetch = n_push = 1, batch 64 per worker, Adagrad {DOWNPOUR_LR}; "
            f"{configs[names[0]]['max_steps'] - CHUNK // 2} timed steps a run in chunks of "
            f"{CHUNK} (one fit each, rounds of {CHUNK // 4} steps), {repeats} interleaved "
            f"repeats, medians, seed {seed}.",
            "Link bound: the busiest link's larger direction (veth counters) at the link rate "
            "per step of one worker's batch; compute (about 6 ms a step on each worker, two in "
            "parallel) is left out.",
        ],
    }
