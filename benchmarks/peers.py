"""``peers``: this package's strategies against legacy ``tf_keras`` with TensorFlow's own.

What a user who stays on ``tf_keras`` (Keras 2, ``pip install tf-keras``)
runs today, side by side with this package on Keras 3; same model, data,
batch (64 per worker step), threads and cluster shape:

* asynchronous: ``tfdist_ext.DownpourStrategy`` (n_fetch = n_push = 1; its
  default rounds, and ``steps_per_execution=50``; each with its default
  fetch, after the worker's own last push, and with
  ``background_fetch=True``) against
  ``tf.distribute.ParameterServerStrategy`` with ``tf_keras`` ``model.fit``
  (``steps_per_execution`` 1 and 50, each worker reading its own shard of
  the data as in TensorFlow's tutorial); 2 workers and 1 ps, plain
  ``tf.distribute.Server`` tasks of a ``LocalCluster`` (one intra-op thread
  each), the chief the run's own process;
* synchronous: ``tfdist_ext.MultiWorkerMirroredStrategy()`` (dense)
  against ``tf.distribute.MultiWorkerMirroredStrategy`` with
  ``tf_keras``; 2 SPMD worker processes with their own ``TF_CONFIG``,
  started by a ``LocalCluster(command=...)``;
* on 100 Mbit/s links also the knobs only this package has, against the
  peer's parameter-server run of most examples/s: Downpour at n_fetch =
  n_push = 5 and ``ElasticAveragingStrategy`` at ``tau=10`` (each worker
  takes 10 local Adam steps between exchanges with the centre), and the
  synchronous strategy with error-feedback top-1% compression.

Models: an MLP 64-128-128-10 on the bundled digits and a 256-1024-1024-10
MLP (1.3M parameters) on seeded synthetic data; on 127.0.0.1 and on links of
100 Mbit/s (each task in its own network namespace). Metrics: examples/s over
the timed epochs after a warm-up epoch; held-out accuracy after the same
examples; and the seconds from the first ``fit`` to the same held-out
accuracy (the highest every run of both sides reached; accuracy is marked
at every epoch's end, linear between marks). "Best of each" pairs each
side's settings fastest to the accuracy all of that side's runs reach.
Every run is its own process (``benchmarks/_peers_run.py``; ``tf_keras``
and Keras 3 never share one); the systems of a case are
interleaved round by round and summarised by medians. The benchmark also
runs Keras 3 ``fit`` under plain ``MultiWorkerMirroredStrategy`` once and
records its error.
"""

import importlib.metadata

from benchmarks import _harness

CANDIDATES = {
    "downpour-n1": {"system": "downpour", "n": 1},
    "downpour-n1-spe50": {"system": "downpour", "n": 1, "spe": 50},
    # DistBelief's background fetch: the next parameters cross while a block
    # computes, without the worker's own last push.
    "downpour-n1-background": {"system": "downpour", "n": 1, "background_fetch": True},
    "downpour-n1-background-spe50": {
        "system": "downpour",
        "n": 1,
        "background_fetch": True,
        "spe": 50,
    },
    "cmwms-dense": {"system": "cmwms"},
    # The knobs only this package has (100 Mbit/s cases): fewer, larger
    # exchanges with the parameter server, and a compressed all-reduce.
    "downpour-n5": {"system": "downpour", "n": 5},
    "easgd-tau10": {"system": "easgd", "n": 10},
    "mwms-ef-topk1%": {"system": "cmwms", "compression": "ef_topk", "ratio": 0.01},
}
KNOBS = ("downpour-n5", "easgd-tau10", "mwms-ef-topk1%")
PEERS = {
    "tf_keras-pss": {"system": "pss"},
    "tf_keras-pss-spe50": {"system": "pss", "spe": 50},
    "tf_keras-mwms": {"system": "mwms"},
}
# (row, candidate, peer) of the table, per case; BEST_PSS: the peer's
# parameter-server run of most examples/s in the case.
BEST_PSS = "best tf_keras-pss"
PAIRS = (
    ("async, default", "downpour-n1", "tf_keras-pss"),
    ("async, spe 50", "downpour-n1-spe50", "tf_keras-pss-spe50"),
    ("async, background fetch", "downpour-n1-background", "tf_keras-pss"),
    ("async, background fetch, spe 50", "downpour-n1-background-spe50", "tf_keras-pss-spe50"),
    ("async, best of each", None, None),  # each side's settings fastest to the accuracy
    ("sync (all-reduce)", "cmwms-dense", "tf_keras-mwms"),
    ("async, n_fetch=n_push=5", "downpour-n5", BEST_PSS),
    ("async, EASGD tau=10", "easgd-tau10", BEST_PSS),
    ("sync, EF top-1% compression", "mwms-ef-topk1%", "tf_keras-mwms"),
)
LEGACY_ENV = {"TF_USE_LEGACY_KERAS": "1"}  # tf.keras is tf_keras in the peer's processes
KERAS3_ENV = {"TF_USE_LEGACY_KERAS": None}
RUN_TIMEOUT = 600  # seconds, one run (a process and its cluster)


def _plan(quick):
    """Cases: (model, network, steps per epoch, warm-up steps, timed epochs, systems).

    Steps are asynchronous steps of one 64-example batch (a synchronous step
    trains two). On 100 Mbit/s a step of the synthetic MLP moves its 5.3 MB
    of parameters and of gradients across the ps's link, about half a second
    a step; there the ``steps_per_execution=50`` rows are left out, since
    epochs of several executions per worker would take minutes a run.
    """
    plain = [s for s in list(CANDIDATES) + list(PEERS) if s not in KNOBS]
    every = plain + list(KNOBS)
    no_spe = [s for s in every if not s.endswith("spe50")]
    if quick:
        return [
            ("digits", "loopback", 100, 100, 1, plain),
            ("digits", "100mbit", 100, 100, 1, every),
        ]
    # At least 2 timed epochs: held-out accuracy is marked at every epoch's end.
    return [
        ("digits", "loopback", 100, 100, 4, plain),
        ("synthetic", "loopback", 100, 100, 2, plain),
        ("digits", "100mbit", 100, 100, 2, every),
        ("synthetic", "100mbit", 20, 10, 2, no_spe),
    ]


def _cfg(name, model, network, steps, warmup, epochs, seed):
    base = dict(CANDIDATES.get(name) or PEERS[name])
    base.update(case=model, steps=steps, warmup_steps=warmup, epochs=epochs, seed=seed)
    if network == "loopback":
        return dict(base, isolated=False)
    return dict(base, isolated=True, bandwidth=network)


def _run(name, cfg):
    env = LEGACY_ENV if name in PEERS else KERAS3_ENV
    return _harness.run_in_process("benchmarks._peers_run", cfg, RUN_TIMEOUT, env=env)


def _measure_case(model, network, steps, warmup, epochs, systems, repeats, seed):
    """Every system of one case, interleaved: ``{system: [run, ...]}``."""
    runs = {name: [] for name in systems}

    def measure(name):
        def one():
            out = _run(name, _cfg(name, model, network, steps, warmup, epochs, seed))
            runs[name].append(out)
            return out["examples_per_second"]

        return one

    _harness.interleaved({name: measure(name) for name in systems}, repeats, warmup=0)
    return runs


def _keras3_mwms_error(seed):
    """Keras 3 ``fit`` under plain ``MultiWorkerMirroredStrategy`` (2 workers): its error."""
    cfg = {"system": "keras3-mwms", "case": "digits", "seed": seed, "isolated": False}
    return _harness.run_in_process("benchmarks._peers_run", cfg, 300, env=KERAS3_ENV)


def _cpu(run):
    """CPU milliseconds per 64 examples trained, every process of the run together."""
    return sum(run["cpu_ms_per_batch"].values())


def _cores(run):
    """Cores each kind of process kept busy during the timed epochs: its CPU
    seconds per second of training (the machine has 2)."""
    batches_per_second = run["examples_per_second"] / 64
    return {job: ms * batches_per_second / 1e3 for job, ms in run["cpu_ms_per_batch"].items()}


def _time_rows(model, network, runs):
    """Per system of a case: examples/s and the cores its chief, ps and workers used."""
    rows = []
    for name, rs in runs.items():
        cores = [_cores(r) for r in rs]
        busy = {job: _harness.median([c.get(job, 0.0) for c in cores]) for job in JOBS}
        total = _harness.median([sum(c.values()) for c in cores])
        eps = _harness.median([r["examples_per_second"] for r in rs])
        links = [r.get("link_mb_per_batch") for r in rs]
        link = None if None in links else _harness.median(links)
        rows.append([model, network, name, eps, *busy.values(), total, 2.0 - total, link])
    return rows


def _medians(runs):
    """Per system: medians of examples/s, accuracy and CPU, and the examples trained."""
    return {
        name: {
            "eps": _harness.median([r["examples_per_second"] for r in rs]),
            "acc": _harness.median([r["accuracy"] for r in rs]),
            "cpu": _harness.median([_cpu(r) for r in rs]),
            "examples": rs[0]["examples_trained"],
        }
        for name, rs in runs.items()
    }


def time_to(curve, target):
    """Seconds until a run's held-out accuracy first reaches ``target``, linear
    between its marks; ``None`` if it never does."""
    t0, a0 = curve[0]
    if a0 >= target:
        return 0.0
    for t1, a1 in curve[1:]:
        if a1 >= target:
            return t0 + (t1 - t0) * (target - a0) / (a1 - a0)
        t0, a0 = t1, a1
    return None


def _reached_by_all(runs):
    """The highest held-out accuracy every one of ``runs`` reached."""
    return min(max(a for _, a in r["curve"]) for r in runs)


def _to_same_accuracy(cand_runs, peer_runs):
    """The same accuracy for both sides, the highest every run of both reached,
    and the median seconds each side took to reach it."""
    target = _reached_by_all(cand_runs + peer_runs)
    cand = _harness.median([time_to(r["curve"], target) for r in cand_runs])
    peer = _harness.median([time_to(r["curve"], target) for r in peer_runs])
    return target, cand, peer


def _pairs(systems):
    """The table's pairs present in a case, and the best of each side asynchronously."""
    return [
        p
        for p in PAIRS
        if p[1] is None or p[1] in systems and (p[2] in systems or p[2] == BEST_PSS)
    ]


def _fastest_to_accuracy(runs, systems):
    """Of ``systems``, the one of least median seconds to the highest held-out
    accuracy every run of them all reached."""
    target = _reached_by_all([r for s in systems for r in runs[s]])
    return min(
        systems, key=lambda s: _harness.median([time_to(r["curve"], target) for r in runs[s]])
    )


def _rows(model, network, runs):
    med = _medians(runs)
    rows = []
    pss = [s for s in med if s.startswith("tf_keras-pss")]
    for row, cand, peer in _pairs(med):
        if cand is None:
            # Each side's settings that train fastest to the accuracy all of them reach.
            own = [s for s in med if s.startswith("downpour") and s not in KNOBS]
            cand, peer = _fastest_to_accuracy(runs, own), _fastest_to_accuracy(runs, pss)
        if peer == BEST_PSS:
            peer = max(pss, key=lambda s: med[s]["eps"])
        c, p = med[cand], med[peer]
        target, cand_s, peer_s = _to_same_accuracy(runs[cand], runs[peer])
        rows.append(
            [
                model,
                network,
                row,
                cand,
                peer,
                c["eps"],
                p["eps"],
                c["eps"] / p["eps"],
                target,
                cand_s,
                peer_s,
                peer_s / cand_s if cand_s else None,
                c["acc"],
                p["acc"],
                c["examples"],
                c["cpu"],
                p["cpu"],
            ]
        )
    return rows


def _figures(model, network, runs):
    figures = []
    for name, rs in runs.items():
        case = f"{model}/{network}"
        side = {"side": "candidate" if name in CANDIDATES else "peer"}
        eps = [r["examples_per_second"] for r in rs]
        figures += [
            _harness.figure(case, name, "throughput", "examples/s", eps, **side),
            _harness.figure(
                case, name, "accuracy", "held-out accuracy", [r["accuracy"] for r in rs]
            ),
            _harness.figure(case, name, "cpu", "CPU ms per 64 examples", [_cpu(r) for r in rs]),
        ]
        if name.startswith(("downpour", "easgd")):
            staleness = [r["staleness_mean"] for r in rs]
            figures.append(_harness.figure(case, name, "staleness", "mean", staleness))
    return figures


JOBS = ("chief", "ps", "worker")
TIME_COLUMNS = [
    "model",
    "network",
    "system",
    "ex/s",
    "chief cores",
    "ps cores",
    "worker cores",
    "cores busy",
    "cores idle",
    "link MB/64ex",
]

#: The README's compact table (the Benchmarks page has every column).
# In the JSON and the benchmarks page; the README's "best of each" row stands for them.
README_LEAVES_OUT = ("async, spe 50", "async, background fetch", "async, background fetch, spe 50")
README_COLUMNS = ["model", "network", "row", "cand/peer", "to acc", "cand acc", "peer acc"]
COLUMNS = [
    "model",
    "network",
    "row",
    "candidate",
    "peer",
    "cand ex/s",
    "peer ex/s",
    "cand/peer",
    "same acc",
    "cand s to acc",
    "peer s to acc",
    "to acc",
    "cand acc",
    "peer acc",
    "examples trained",
    "cand CPU ms/64ex",
    "peer CPU ms/64ex",
]


def run(quick=False, seed=0):
    repeats = 1 if quick else 3
    failure = _keras3_mwms_error(seed)
    figures, rows, time_rows, plan = [], [], [], _plan(quick)
    for model, network, steps, warmup, epochs, systems in plan:
        runs = _measure_case(model, network, steps, warmup, epochs, systems, repeats, seed)
        figures += _figures(model, network, runs)
        rows += _rows(model, network, runs)
        time_rows += _time_rows(model, network, runs)
    return {
        "candidate": "DownpourStrategy and MultiWorkerMirroredStrategy on Keras 3",
        "peer": "tf_keras 2.21 with tf.distribute.ParameterServerStrategy and "
        "MultiWorkerMirroredStrategy",
        "figures": figures,
        "table": {"columns": COLUMNS, "rows": rows},
        "where_the_time_goes_table": {"columns": TIME_COLUMNS, "rows": time_rows},
        # The peer's Keras (the runner records the others' versions).
        "tf_keras_version": importlib.metadata.version("tf-keras"),
        "keras3_plain_mwms": failure,
        "plan": [list(p[:5]) for p in plan],
        "notes": _notes(quick, seed, repeats, plan, failure),
    }


def _notes(quick, seed, repeats, plan, failure):
    sizes = "; ".join(f"{m}/{n}: {w} warm-up + {e} x {s} timed steps" for m, n, s, w, e, _ in plan)
    return [
        f"{repeats} interleaved repeat(s) per case, medians, seed {seed} (data, "
        "shuffles and initial weights the same in every repeat). Measured on a 2-core "
        "machine: chief, ps and workers of a run share its 2 cores.",
        f"Steps of one 64-example batch (a synchronous step trains one on each of the 2 "
        f"workers, so the same examples take half the steps): {sizes}. Epochs span several "
        "passes over the data so that steps_per_execution=50 gives each worker several "
        "executions an epoch. examples/s: timed epochs only; accuracy: after all of "
        "them, the warm-up included, computed in numpy from get_weights(). Time to the "
        "same accuracy: seconds from the first fit call (tracing and warm-up included), "
        "without the seconds spent reading and scoring the weights at each epoch's end; "
        "the target is the highest held-out accuracy every run of both sides reached, "
        "and a run's time to it is interpolated linearly between its epoch marks.",
        "Optimizer Adam(0.003), sparse categorical cross-entropy; the synthetic set is "
        "datasets.synthetic(8192 + 2048, input_shape=(256,), noise=6.0, seed=seed) "
        "(logistic regression: about 0.7 held out).",
        "Threads: every ps and worker task one intra-op thread (the synchronous workers "
        "set the same, and 3 inter-op threads as the servers get); chiefs TensorFlow's "
        "defaults. 100mbit: LocalCluster(isolated=True, bandwidth='100mbit'), each task "
        "in its own network namespace behind a tc token bucket of 100 Mbit/s; the "
        "synchronous rows use the same namespaces through LocalCluster(command=...). "
        "loopback: 127.0.0.1, no limit.",
        "CPU ms/64ex: user + system CPU of every process of a run (chief, ps, workers) "
        "during the timed epochs, per 64 examples.",
        "Where the time goes: the cores each kind of process kept busy during the timed "
        "epochs (its CPU seconds per second; median of the repeats), out of the 2 the "
        "machine has. A system with cores idle waited: on its exchanges' round trips or, "
        "on 100 Mbit/s, on the links. One near 2 busy cores is bound by the machine: "
        "there, more examples/s than the peer needs less CPU per example, not less "
        "waiting. link MB/64ex (100 Mbit/s only): megabytes received and sent on the "
        "ps's link (asynchronous) or on one worker's (synchronous) per 64 examples "
        "trained, from /proc/<pid>/net/dev of its namespace; at 100 Mbit/s a link "
        "carries 12.5 MB/s each way.",
        "Keras 3 model.fit under plain tf.distribute.MultiWorkerMirroredStrategy (2 "
        f"workers, TF_CONFIG, exit codes {failure.get('exit_codes')}): "
        f"{failure.get('error')}",
    ]


def plotted(document):
    """``(labels, (examples/s ratios, to-accuracy ratios))`` of the table's rows
    but the "best of each" ones, which repeat others."""
    columns = document["table"]["columns"]
    at = {c: columns.index(c) for c in ("model", "network", "row", "cand/peer", "to acc")}
    rows = [r for r in document["table"]["rows"] if r[at["row"]] != "async, best of each"]
    labels = [f"{r[at['model']]}, {r[at['network']]}: {r[at['row']]}" for r in rows]
    return labels, ([r[at["cand/peer"]] for r in rows], [r[at["to acc"]] for r in rows])


def plot(document, path):
    """Draws :func:`plotted`'s two ratios per row, candidate over peer, to
    ``path`` (a PNG): examples/s and the speed to the same held-out accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels, ratios = plotted(document)
    y = np.arange(len(labels))
    fig, ax = plt.subplots(figsize=(8, 0.32 * len(labels) + 1.4))
    bars = ((-0.2, "examples/s"), (0.2, "speed to the same accuracy"))
    for (offset, name), values in zip(bars, ratios):
        values = np.array([v or 1.0 for v in values])  # none reached: no bar
        # From parity: a bar to the right is faster than the peer, to the left slower.
        ax.barh(y + offset, values - 1.0, left=1.0, height=0.4, label=name)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ticks = [0.5, 1, 2, 4, 8]
    ax.set_xticks(ticks, [f"{t:g}x" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("tfdist_ext (Keras 3) over tf_keras with TensorFlow's own strategy")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, 1.1), ncol=2)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
