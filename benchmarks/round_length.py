"""``round_length``: Downpour's step against the length of its rounds, on a slow link.

A Downpour worker runs rounds of b blocks of n steps (``steps_per_execution``
= b n). Within a round a block's push and the next block's fetch cross while
the next block computes, but a round's first fetch and its last push have
nothing to cross with, and the links' timeline of one worker at b = 4 showed
its first two fetches and last two pushes alone (``docs/architecture.md``,
"On a slow link"). So how long a round should be on a slow link is a
measured question. This benchmark measures it: 2 workers, the ``network``
benchmark's 10M-parameter MLP at 100 Mbit/s, n_fetch = n_push = 5, 1 and 2
``ps`` shards, rounds of b = 1, 2, 4, 8 and 16 blocks, each run as the
``network`` benchmark runs Downpour (``benchmarks/_network_run.py``, with
the background fetch: one ``fit`` a chunk of four rounds, two a worker,
after an untimed ``fit`` of two rounds). One run per point; runs
alternate between the shard counts, b ascending. Each point is set beside its ideal, as ``network`` computes it
(half the compute of a step, both workers computing at once, plus the
busiest link's bytes at the link rate), with the compute timed once in its
own process on one thread.
"""

from benchmarks import _harness
from benchmarks import network

MODEL, LINK, N = "10M", "100mbit", 5
BLOCKS = (1, 2, 4, 8, 16)
SHARDS = (1, 2)


def _cfg(seed, blocks, shards):
    """A ``network``-style Downpour run with rounds of ``blocks`` blocks: one timed chunk."""
    steps = blocks * N
    return dict(
        network.base_cfg(MODEL, LINK, seed),
        system="downpour",
        n=N,
        ps=shards,
        round=steps,
        chunk=4 * steps,
        max_steps=6 * steps,  # the untimed fit of two rounds, then one chunk of four
        downpour_lr=network.DOWNPOUR_LR,
    )


def run(quick=False, seed=0):
    blocks = (1, 4) if quick else BLOCKS
    compute = network._run(dict(_cfg(seed, 1, 1), system="compute"))["compute_seconds"]
    rows = []
    for b in blocks:
        for shards in SHARDS if b % 2 else SHARDS[::-1]:
            cfg = _cfg(seed, b, shards)
            out = network._run(cfg)
            row = network._row(LINK, MODEL, cfg, out, compute)
            row.update(blocks=b, steps_per_round=b * N)
            rows.append(row)
            print(
                f"b={b} ps={shards}: {row['step_seconds']:.3f}s/step "
                f"achieved/ideal {row['achieved_over_ideal']:.2f}",
                flush=True,
            )
    return {
        "candidate": f"DownpourStrategy, rounds of b blocks of n = {N} steps (b in {list(blocks)})",
        "peer": "the ideal step (compute plus the busiest link's bytes at the link rate)",
        "figures": [
            _harness.figure(
                f"{MODEL} {LINK} n={N} ps={r['ps']} b={r['blocks']}",
                "downpour",
                "step_seconds",
                "s",
                [r["step_seconds"]],
            )
            for r in rows
        ],
        "runs": rows,
        "table": table(rows),
        "notes": _notes(seed, compute),
    }


def table(rows):
    """The README table of a ``round_length`` result."""
    columns = [
        "ps",
        "b",
        "steps a round",
        "step s",
        "busiest link MB/step",
        "ideal s",
        "achieved/ideal",
    ]
    body = []
    for r in sorted(rows, key=lambda r: (r["ps"], r["blocks"])):
        body.append(
            [
                r["ps"],
                r["blocks"],
                r["steps_per_round"],
                round(r["step_seconds"], 3),
                round(r["busiest_link_bytes"] / 1e6, 2),
                round(r["ideal_seconds"], 3),
                round(r["achieved_over_ideal"], 2),
            ]
        )
    return {"columns": columns, "rows": body}


def _notes(seed, compute):
    return [
        f"Seed {seed}. 2 workers, {MODEL} parameters, {LINK} links, n_fetch = n_push = {N}, "
        f"batch {network.BATCH} per worker; compute {compute:.3f} s a step (one thread).",
        "Step = a chunk's seconds over its steps (one fit of four rounds, two a worker, after "
        "an untimed fit of two rounds), as in the network benchmark's Downpour rows.",
    ]
