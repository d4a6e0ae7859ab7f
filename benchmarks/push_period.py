"""``push_period``: what ``n_fetch = n_push = k`` costs in accuracy, and why.

At k = 5 a Downpour worker takes 5 gradients on one fetched copy and pushes
their sum: the server makes 5 times fewer updates, each of 5 batches, and
under Adam each moves about one step of the learning rate. The ``peers``
benchmark measured k = 5 ending far below k = 1 after the same examples.
This benchmark separates the two things k changes, on digits with the
``peers`` MLP, Adam(0.003) and 300 batches of 64:

* **Downpour** (candidate), 1 and 2 workers, k = 1 and 5: held-out accuracy
  after each third of the examples, and the staleness it measured (in
  updates). With one worker and ``background_fetch=True`` the only
  staleness is the fetch that crosses while the worker's own last push is
  applied; with ``background_fetch=False`` ("after push", the default)
  there is none.
* **One Keras process** (peer: the same updates with no cluster), updates
  of k batches whose gradients are computed on the weights of d = 0, 1, 2
  updates before: the larger updates alone (d = 0) and the staleness alone.

Every run is its own process (``benchmarks/_push_period_run.py``); seeds
``seed .. seed + 2``, medians.
"""

from benchmarks import _harness

STEPS = 300  # batches of 64, every run
SEEDS = 3
# (workers, k, background_fetch)
DOWNPOUR = [(w, k, bg) for bg in (True, False) for w in (1, 2) for k in (1, 5)]
DELAYED = [(k, d) for k in (1, 5) for d in (0, 1, 2)]


def _runs(seed, quick):
    """``{label: cfg}`` of every run for one seed."""
    steps = 60 if quick else STEPS
    runs = {}
    for workers, k, background in DOWNPOUR[:2] if quick else DOWNPOUR:
        name = "downpour" if background else "downpour after push"
        runs[f"{name} w={workers} k={k}"] = dict(
            system="downpour",
            workers=workers,
            k=k,
            background_fetch=background,
            steps=steps,
            seed=seed,
        )
    for k, d in DELAYED:
        runs[f"keras k={k} d={d}"] = dict(system="delayed", k=k, delay=d, steps=steps, seed=seed)
    return runs


def run(quick=False, seed=0):
    seeds = [seed] if quick else list(range(seed, seed + SEEDS))
    results = {}
    for s in seeds:
        for label, cfg in _runs(s, quick).items():
            out = _harness.run_in_process("benchmarks._push_period_run", cfg, timeout=600)
            results.setdefault(label, {"cfg": cfg, "runs": []})["runs"].append(out)
            print(f"{label} seed {s}: {[round(a, 3) for a in out['accuracy']]}", flush=True)
    return {
        "candidate": "DownpourStrategy, n_fetch = n_push = k, 1 or 2 workers",
        "peer": "one Keras process: updates of k batches, gradients d updates old",
        "seeds": seeds,
        "figures": [
            _harness.figure(
                label, label.split()[0], "accuracy", "", [r["accuracy"][-1] for r in rs]
            )
            for label, rs in ((label, v["runs"]) for label, v in results.items())
        ],
        "results": results,
        "table": table(results),
        "notes": _notes(seeds, quick),
    }


def table(results):
    """One row per run kind: updates, staleness, held-out accuracy (medians over seeds)."""
    columns = ["run", "k", "updates", "staleness", "acc 1/3", "acc 2/3", "acc end"]
    rows = []
    for label, value in results.items():
        cfg, runs = value["cfg"], value["runs"]
        if cfg["system"] == "downpour":
            staleness = round(_harness.median([r["staleness_mean"] for r in runs]), 2)
        else:
            staleness = cfg["delay"]
        marks = [_harness.median([r["accuracy"][i] for r in runs]) for i in range(3)]
        updates = cfg["steps"] // cfg["k"]
        rows.append([label, cfg["k"], updates, staleness, *[round(a, 3) for a in marks]])
    return {"columns": columns, "rows": rows}


def _notes(seeds, quick):
    return [
        f"digits, MLP 64-128-128-10, Adam(0.003), {60 if quick else STEPS} batches of 64 "
        f"every run; seeds {seeds}, medians. updates: the server's (Downpour: per worker "
        "summed, all workers together) or the process's optimizer steps. staleness: "
        "Downpour's measured mean (updates applied between a push's fetch and its "
        "application); for one Keras process the delay d it was given.",
        "One Keras process: each update's gradient is the mean over k batches (one batch "
        "of 64 k), computed on the weights of d updates before and applied by Adam to the "
        "current weights; Downpour pushes the sum of k gradients, which Adam treats alike "
        "(up to its epsilon).",
    ]
