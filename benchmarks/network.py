"""``network``: gradient exchange over rate-limited links, 2 workers, one machine.

Every run is its own process (``benchmarks/_network_run.py``) on a fresh
``LocalCluster`` whose tasks each sit in their own network namespace behind a
``tc tbf`` link of 100 Mbit/s or 1 Gbit/s. Models: MLPs on MNIST-1D of about
1M and 10M parameters, batch 64 per worker.

* ``CompressedMultiWorkerMirroredStrategy`` (2 SPMD worker processes): dense,
  fp16, DGC 99.9% and PowerSGD rank 2: median step time and training seconds
  until the dense run's final held-out accuracy.
* ``DownpourStrategy`` (2 workers, n_fetch = n_push = n, 1 or 2 ps shards,
  ``background_fetch=True``: fetches hide behind compute): examples/s and
  training seconds to the same target, against the synchronous dense run.
* Per row, the ideal step: compute (measured on each worker, same step
  without communication, both workers at once) plus the bytes on the busiest
  link (the larger direction of the veth counters of every task's namespace;
  full duplex, so the two directions overlap) at the link rate; and
  achieved / ideal.
* Per configuration, the same run once more on links without a rate limit
  (same namespaces and veths): the step this machine's cores and software
  allow when the wire costs nothing. A row's machine ideal is the larger of
  that and its ideal, and achieved / machine ideal says how close the row is
  to what this machine could do at that link rate.

Per block (model x link) the dense run comes first (its final accuracy is the
target, its training time the budget of the others); the other systems follow
in an order rotated from block to block.
"""

import os
import statistics

from benchmarks import _harness

LINKS = {"100mbit": 100e6, "1gbit": 1e9}
MODELS = {"1M": 1000, "10M": 3150}  # hidden width of the 40-H-H-10 MLP
SYNC_METHODS = ("dense", "fp16", "dgc", "powersgd")
BATCH = 64  # per worker
LR, DOWNPOUR_LR = 0.05, 0.05
MIN_BUDGET = 15.0  # training seconds every system gets at least
DOWNPOUR_BUDGET = 40.0  # and Downpour at most (its runs are the slowest to start)
# Blocks of n steps per Downpour round: a block's push and fetch cross while
# the next block computes, so only a round's last push is not hidden (and
# its first fetch, when its worker did not prefetch). Before the prefetch
# ``round_length`` measured 0.55 of the ideal at 1 block, 0.68-0.80 at 4
# and 0.83-0.86 at 8 (10M, n = 5, 100 Mbit/s); with it, 0.84-0.94 (1
# shard) and 0.75-0.84 (2) at every b, 4 and 8 within the runs' scatter.
# ``DownpourStrategy``'s own default round is about 50 steps, 10 blocks at
# n = 5; results before 2026-11-26 afternoon used 4 blocks.
ROUND_BLOCKS = 8
UNLIMITED_BUDGET = 8.0  # training seconds of a run on links without a rate limit
# Passes over the configurations on links without a rate limit (median per
# configuration): their CPU-bound steps moved by up to 19% between two runs
# of the same code (benchmarks/NOTES.md, 2026-11-27).
UNLIMITED_PASSES = 3


def _plan(quick):
    """(blocks, dense steps per model, Downpour (n, ps) per block)."""
    if quick:
        return [("1M", "100mbit")], {"1M": 20}, {("1M", "100mbit"): [(5, 2)]}
    blocks = [(m, link) for m in MODELS for link in LINKS]
    full = [(n, ps) for n in (1, 5, 20) for ps in (1, 2)]
    downpour = {
        ("10M", "100mbit"): full,
        ("10M", "1gbit"): [(1, 2), (5, 1), (5, 2), (20, 2)],
        ("1M", "100mbit"): [(5, 1), (5, 2)],
        ("1M", "1gbit"): [(5, 2)],
    }
    return blocks, {"1M": 60, "10M": 20}, downpour


def _downpour_cfg(base, n, ps, chunk, steps):
    """A Downpour run: rounds of ``ROUND_BLOCKS`` blocks of ``n`` steps (at least ``chunk``).

    Rounds of several blocks, so that pushes and fetches overlap the next
    block (see ``_round.py``); each chunk is one fit (see
    ``_network_run.train_in_fits``) of four rounds, two a worker, so that
    both keep busy, and a run has room for two fits or more.
    """
    steps_per_round = max(ROUND_BLOCKS * n, chunk)
    return dict(
        base,
        system="downpour",
        n=n,
        ps=ps,
        round=steps_per_round,
        chunk=4 * steps_per_round,
        max_steps=max(8 * steps, 10 * steps_per_round),
        downpour_lr=DOWNPOUR_LR,
    )


def base_cfg(model, link, seed):
    """What every ``_network_run`` run of ``model`` on ``link`` shares (``round_length``, ``allocator`` too)."""
    return dict(hidden=MODELS[model], bandwidth=link, seed=seed, lr=LR, compute_repeats=10)


def _run(cfg):
    return _harness.run_in_process("benchmarks._network_run", cfg, timeout=1800)


def _messages(method, n=None):
    """Collectives or transfers per worker step (what the per-message overhead multiplies).

    Dense and fp16 gradients are summed by one batched all-reduce; DGC's
    gather exchange sends all its wire tensors packed in one buffer, after
    one small all-gather of its length; PowerSGD sums every P and the
    vectors in one all-reduce and every Q in a second. Downpour pushes and
    fetches every n steps. A push (or fetch) moves one tensor per ``ps``
    task and one per piece of a split variable (1 to 6 here), but its fixed
    cost does not grow with them: without a link limit the 1M model runs
    6.3 ms a step with 1 shard (1 tensor a transfer) and 6.7 ms with 2
    (4 tensors), so a transfer counts once, whatever it carries.
    """
    if method in ("dense", "fp16"):
        return 1
    if method in ("dgc", "powersgd"):
        return 2
    return 2 / n


def _step_seconds(cfg, out):
    """A run's step: Downpour's from its fits of whole chunks, a synchronous run's median."""
    return out["chunk_step_seconds"] if cfg["system"] == "downpour" else out["step_seconds"]


def _row(link, model, cfg, out, compute):
    rate = LINKS[link]
    downpour = cfg["system"] == "downpour"
    workers = 2
    examples = BATCH if downpour else BATCH * workers
    step = _step_seconds(cfg, out)
    busiest = max(max(v) for v in out["link_bytes_per_step"].values())
    if downpour:
        logical = out["push_bytes_per_step"] + out["fetch_bytes_per_step"]
        system = f"downpour n={cfg['n']} ps={cfg['ps']}"
    else:
        logical = out["compressor_bytes_per_step"]
        system = cfg["method"]
    row = {
        "link": link,
        "link_bps": rate,
        "model": model,
        "params": _params(MODELS[model]),
        "system": system,
        "kind": "ps" if downpour else cfg["method"],
        "n": cfg.get("n"),
        "ps": cfg.get("ps"),
        "workers": workers,
        "examples_per_step": examples,
        "step_seconds": step,
        "examples_per_second": examples / step,
        "compress_seconds": out.get("compress_seconds_per_step"),
        # Downpour: the share of rounds that began from prefetched parameters.
        "prefetched_fraction": out.get("prefetched_fraction"),
        "busiest_link_bytes": busiest,
        "logical_bytes": logical,
        "link_bytes_per_step": out["link_bytes_per_step"],
        "messages": _messages(cfg.get("method", "ps"), cfg.get("n")),
        "seconds_to_target": out["seconds_to_target"],
        "final_accuracy": out["curve"][-1][2],
        "steps": out["steps"],
        "curve": out["curve"],
        "config": {k: v for k, v in cfg.items() if k not in ("target", "budget_seconds")},
    }
    set_compute(row, compute)
    return row


def set_compute(row, compute):
    """Sets ``row``'s compute seconds and the ideal step and achieved / ideal they give.

    Ideal = compute + the busiest link's bytes at the link rate. Downpour:
    one step of one worker, and the two workers compute in parallel, so
    compute / 2 per system step.
    """
    per_step = compute / row["workers"] if row["kind"] == "ps" else compute
    row["compute_seconds"] = compute
    row["ideal_seconds"] = per_step + 8 * row["busiest_link_bytes"] / row["link_bps"]
    row["achieved_over_ideal"] = row["ideal_seconds"] / row["step_seconds"]


def block_compute(rows):
    """{(model, link): the median compute seconds of that block's synchronous rows}.

    Every synchronous run times the same local train step while it runs
    (dense, fp16, DGC and PowerSGD alike); a Downpour run times none. The
    block's median of those timings stands for its compute, rather than any
    one run's (on 2026-11-27 the dense run's timing was 0.058 s, the three
    others' 0.033-0.034 s).
    """
    samples = {}
    for row in rows:
        if isinstance(row, dict) and row.get("kind") in SYNC_METHODS:
            value = row.get("compute_seconds")
            if value is not None:
                samples.setdefault((row.get("model"), row.get("link")), []).append(float(value))
    return {key: statistics.median(values) for key, values in samples.items()}


def set_block_compute(rows):
    """Gives every Downpour row of ``rows`` its block's median compute (:func:`block_compute`)."""
    medians = block_compute(rows)
    for row in rows:
        key = (row["model"], row["link"])
        if row["kind"] == "ps" and key in medians:
            set_compute(row, medians[key])
            row["compute_from"] = "block median"


def _params(hidden):
    from benchmarks._network_run import parameters

    return parameters(hidden)


def run(quick=False, seed=0):
    blocks, dense_steps, downpour = _plan(quick)
    rows = []
    for b, (model, link) in enumerate(blocks):
        steps = dense_steps[model]
        chunk = 5 if quick or model == "10M" else 10
        base = base_cfg(model, link, seed)
        cfg = dict(base, system="sync", method="dense", chunk=chunk, max_steps=steps)
        out = _run(cfg)
        dense = _row(link, model, cfg, out, out["compute_seconds"])
        dense["seconds_to_target"] = out["curve"][-1][1]
        target, budget = dense["final_accuracy"], max(MIN_BUDGET, dense["seconds_to_target"])
        rows.append(dense)
        print(
            f"{model} {link} dense: {dense['step_seconds']:.3f}s/step acc {target:.3f}", flush=True
        )
        others = [
            dict(base, system="sync", method=m, chunk=chunk, max_steps=4 * steps)
            for m in SYNC_METHODS[1:]
        ] + [_downpour_cfg(base, n, ps, chunk, steps) for n, ps in downpour[(model, link)]]
        others = others[b % len(others) :] + others[: b % len(others)]
        for cfg in others:
            cap = DOWNPOUR_BUDGET if cfg["system"] == "downpour" else float("inf")
            cfg.update(target=target, budget_seconds=min(budget, cap))
            out = _run(cfg)
            # Synchronous runs time their own compute; Downpour's is their block's (below).
            row = _row(link, model, cfg, out, out.get("compute_seconds", dense["compute_seconds"]))
            rows.append(row)
            print(
                f"{model} {link} {row['system']}: {row['step_seconds']:.3f}s/step "
                f"achieved/ideal {row['achieved_over_ideal']:.2f} "
                f"to target {row['seconds_to_target']}",
                flush=True,
            )
    set_block_compute(rows)
    unlimited = _unlimited_passes(rows, 1 if quick else UNLIMITED_PASSES)
    for row in rows:
        add_machine_ideal(row, unlimited)
    for row in rows:
        dense = next(r for r in rows if r["link"] == row["link"] and r["model"] == row["model"])
        row["step_speedup_vs_dense"] = row["examples_per_second"] / dense["examples_per_second"]
        row["tta_speedup_vs_dense"] = (
            dense["seconds_to_target"] / row["seconds_to_target"]
            if row["seconds_to_target"]
            else None
        )
    plots = _plots(rows, quick)
    return {
        "candidate": "CompressedMultiWorkerMirroredStrategy (fp16, DGC 99.9%, PowerSGD) and "
        "DownpourStrategy, 2 workers on rate-limited links",
        "peer": "CompressedMultiWorkerMirroredStrategy without compression (dense synchronous "
        "all-reduce; plain MultiWorkerMirroredStrategy cannot fit under Keras 3)",
        "figures": _figures(rows),
        "runs": rows,
        "table": table(rows),
        "plots": plots,
        "notes": _notes(quick, seed, dense_steps),
    }


def add_machine_ideal(row, unlimited):
    """Adds to ``row`` its configuration's runs on unlimited links and the machine ideal.

    ``unlimited``: {(model, system): [one dict per pass]} (``_unlimited_passes``).
    The median of the passes' steps is the row's no-limit step; machine ideal
    = max(that step, the row's ideal): the wire time of the link, or the
    cores and software's own time if larger. The median of their compute
    timings (a Downpour configuration's: of its model's synchronous ones; it
    times none) and of the compressor's clock are the no-limit runs' own, as
    the rate-limited row's are its own.
    """
    passes = unlimited[(row["model"], row["system"])]
    row["unlimited_step_passes"] = [p["step_seconds"] for p in passes]
    row["unlimited_step_seconds"] = statistics.median(row["unlimited_step_passes"])
    row["machine_ideal_seconds"] = max(row["unlimited_step_seconds"], row["ideal_seconds"])
    row["achieved_over_machine_ideal"] = row["machine_ideal_seconds"] / row["step_seconds"]
    timed = passes
    if row["kind"] == "ps":  # it times no compute: its model's synchronous passes do
        timed = [p for (model, _), runs in unlimited.items() if model == row["model"] for p in runs]
    for field, source in (("compute_seconds", timed), ("compress_seconds", passes)):
        values = [p[field] for p in source if p.get(field) is not None]
        if values:
            row[f"unlimited_{field}"] = statistics.median(values)


def _unlimited_passes(rows, passes):
    """{(model, system): [{step, compute and compressor seconds}]} of every configuration of
    ``rows``, once a pass, on unlimited links.

    The same run on the same namespaces and veths without a ``tbf`` (fixed
    steps, no accuracy target): what compute, the software and the cores cost
    when the wire time is zero. ``passes`` passes over all configurations,
    one after the other, so that a slow spell of the machine falls on one
    sample of several configurations rather than on every sample of one.
    """
    configs = {}
    for row in rows:
        configs.setdefault((row["model"], row["system"]), row["config"])
    out = {key: [] for key in configs}
    for p in range(passes):
        for key, config in configs.items():
            cfg = dict(config, bandwidth=None, target=2.0, budget_seconds=UNLIMITED_BUDGET)
            run = _run(cfg)
            out[key].append(
                {
                    "step_seconds": _step_seconds(cfg, run),
                    "compute_seconds": run.get("compute_seconds"),
                    "compress_seconds": run.get("compress_seconds_per_step"),
                }
            )
            print(
                f"{key[0]} unlimited {key[1]} pass {p}: {out[key][-1]['step_seconds']:.3f}s/step",
                flush=True,
            )
    return out


def _figures(rows):
    out = []
    for r in rows:
        case = f"{r['model']} params, {r['link']}"
        out.append(_harness.figure(case, r["system"], "step", "s", [r["step_seconds"]]))
        out.append(
            _harness.figure(case, r["system"], "achieved/ideal", "x", [r["achieved_over_ideal"]])
        )
        if "achieved_over_machine_ideal" in r:
            out.append(
                _harness.figure(
                    case,
                    r["system"],
                    "achieved/machine ideal",
                    "x",
                    [r["achieved_over_machine_ideal"]],
                )
            )
    return out


def table(rows):
    """The README table from the rows of a ``network`` result."""
    columns = [
        "link",
        "model",
        "system",
        "step s",
        "examples/s",
        "x dense (step)",
        "compute s",
        "busiest link MB/step",
        "ideal s",
        "achieved/ideal",
        "no-limit step s",
        "achieved/machine ideal",
        "acc. target",
        "s to target",
        "x dense (to target)",
    ]
    body = []
    for r in rows:
        body.append(
            [
                r["link"],
                r["model"],
                r["system"],
                round(r["step_seconds"], 3),
                round(r["examples_per_second"], 1),
                round(r["step_speedup_vs_dense"], 2),
                round(r["compute_seconds"], 3),
                round(r["busiest_link_bytes"] / 1e6, 3),
                round(r["ideal_seconds"], 3),
                round(r["achieved_over_ideal"], 2),
                round(r["unlimited_step_seconds"], 3) if "unlimited_step_seconds" in r else "-",
                round(r["achieved_over_machine_ideal"], 2)
                if "achieved_over_machine_ideal" in r
                else "-",
                round(r["final_accuracy"], 3) if r["system"] == "dense" else "",
                round(r["seconds_to_target"], 1) if r["seconds_to_target"] else "not reached",
                round(r["tta_speedup_vs_dense"], 2) if r.get("tta_speedup_vs_dense") else "-",
            ]
        )
    return {"columns": columns, "rows": body}


def _plots(rows, quick):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suffix = ".quick" if quick else ""
    paths = []
    blocks = sorted({(r["model"], r["link"]) for r in rows})
    fig, axes = plt.subplots(1, len(blocks), figsize=(5 * len(blocks), 4.5), squeeze=False)
    for ax, (model, link) in zip(axes[0], blocks):
        sub = [r for r in rows if r["model"] == model and r["link"] == link]
        names = [r["system"] for r in sub]
        ax.barh(names, [r["step_seconds"] for r in sub], label="achieved")
        ax.barh(names, [r["ideal_seconds"] for r in sub], alpha=0.5, label="ideal")
        ax.set_xscale("log")
        ax.set_xlabel("seconds per step")
        ax.set_title(f"{model} params, {link}")
        ax.legend()
    fig.tight_layout()
    paths.append(_save(fig, f"network_step{suffix}.png"))
    fig, axes = plt.subplots(1, len(blocks), figsize=(5 * len(blocks), 4.5), squeeze=False)
    for ax, (model, link) in zip(axes[0], blocks):
        for r in (r for r in rows if r["model"] == model and r["link"] == link):
            curve = r["curve"]
            ax.plot([c[1] for c in curve], [c[2] for c in curve], marker=".", label=r["system"])
        ax.set_xscale("log")
        ax.set_xlabel("training seconds")
        ax.set_ylabel("held-out accuracy")
        ax.set_title(f"{model} params, {link}")
        ax.legend(fontsize=6)
    fig.tight_layout()
    paths.append(_save(fig, f"network_accuracy{suffix}.png"))
    plt.close("all")
    return paths


def _save(fig, name):
    path = os.path.join(_harness.RESULTS_DIR, name)
    os.makedirs(_harness.RESULTS_DIR, exist_ok=True)
    fig.savefig(path, dpi=100)
    return os.path.relpath(path, os.path.dirname(_harness.RESULTS_DIR))


def _notes(quick, seed, dense_steps):
    return [
        f"seed {seed}; MNIST-1D (4000 train, first 1000 test examples for accuracy); MLP "
        f"40-H-H-10 with H = {MODELS} ({ {m: _params(h) for m, h in MODELS.items()} } "
        f"parameters); batch {BATCH} per worker, 2 workers.",
        f"Synchronous rows: SGD lr {LR} momentum 0.9 (DGC: momentum 0.9 in the compressor with "
        "momentum correction, optimizer momentum 0, clip_norm 5, no warm-up on this short "
        "schedule, tensors < 1024 entries dense); PowerSGD rank 2. Downpour: Adagrad "
        f"{DOWNPOUR_LR}, each step one worker's batch of {BATCH}.",
        f"Time to accuracy: the dense run trains {dense_steps} steps; its final held-out "
        f"accuracy is the target and its training seconds (at least {MIN_BUDGET:.0f}; at most "
        f"{DOWNPOUR_BUDGET:.0f} for Downpour) the budget of every other row of the block, which "
        "evaluates every chunk and stops at the target (resolution one chunk). Evaluation "
        "time and a first untimed warm-up fit (1 step synchronous, half a chunk Downpour; it "
        "traces, and its steps count) are excluded.",
        "step s: synchronous rows, the median over timed steps of the slower worker, from a "
        "callback; Downpour rows, training seconds / steps, each chunk one fit of four rounds "
        f"(two a worker) of {ROUND_BLOCKS} blocks of n steps that returns "
        "when they have finished, drain included. (Results before "
        "2026-11-25 timed Downpour in one fit with a callback, whose clock and counters missed "
        "the rounds that kept training during each evaluation: optimistic, most at n = 20.)",
        "Bytes: veth counters (/proc/PID/net/dev) of every task's namespace over the timed "
        "training (read at each evaluation), so TCP/IP, gRPC and protocol overhead count; the busiest link's "
        "larger direction per step. Ideal step = compute + busiest-link bytes x 8 / link rate "
        "(no overlap of compute and communication assumed; a 2-worker ring all-reduce's "
        "2(N-1)/N factor is 1, which the all-gather exchange also sends). Downpour: compute / 2 "
        "per system step (the two workers compute in parallel).",
        "Downpour's veth bytes run about twice the push+fetch bytes DownpourStrategy counts "
        "(logical_bytes in the runs); the ideal uses the veth bytes.",
        "compute s: median of the same train step on a local copy of the model, no "
        "communication, both workers at once (1 intra-op thread each), measured in every "
        "synchronous run; Downpour rows take the median of their block's synchronous rows "
        "(results before 2026-11-27 noon: the dense run's). The runs on links without a rate "
        "limit record theirs too (unlimited_compute_seconds, the median of the passes; "
        "Downpour: of its model's synchronous ones).",
        "Plain tf.distribute.MultiWorkerMirroredStrategy fails in model.fit under Keras 3 here "
        "(verified: 'Attempt to convert a value (PerReplica...) with an unsupported type' "
        "when Keras reduces the first batch), so the synchronous peer is "
        "CompressedMultiWorkerMirroredStrategy without compression, which sums the float32 "
        "gradients in one batched all-reduce, as MultiWorkerMirroredStrategy does (results "
        "before 2026-11-25 all-gathered them, one collective per tensor; fp16 and DGC then "
        "also sent one collective per wire tensor, PowerSGD one all-reduce per tensor and "
        "round, now one buffer or one batch each).",
        "no-limit step s: the same configuration again on links without a rate limit (same "
        f"namespaces and veths, {UNLIMITED_BUDGET:.0f} training seconds, no target), the median "
        f"of {1 if quick else UNLIMITED_PASSES} passes over all configurations "
        "(unlimited_step_passes in the runs): compute, "
        "software and this machine's 2 cores when the wire costs nothing. Machine ideal = "
        "max(no-limit step, ideal): what this machine could reach at the link rate if all wire "
        "time hid behind that work; achieved/machine ideal says how close a row comes to it.",
        f"The machine ({os.cpu_count()} cores) is shared; one run per configuration on "
        "rate-limited links, medians over steps within a run.",
    ] + (["QUICK RUN: 1M model at 100 Mbit/s only, one Downpour configuration."] if quick else [])


def readme(path=None):
    """The README's ``network`` table, regenerated from a result file (default: network.json)."""
    import json

    path = path or os.path.join(_harness.RESULTS_DIR, "network.json")
    with open(path) as f:
        result = json.load(f)
    label = "quick run, to be replaced" if result.get("quick") else "full run"
    head = f"({label}: `{result['command']}`, seed {result['seed']}, {result['elapsed_seconds']:.0f} s)"
    return head + "\n\n" + _harness.format_table(table(result["runs"]))


if __name__ == "__main__":
    import sys

    print(readme(*sys.argv[1:]))
