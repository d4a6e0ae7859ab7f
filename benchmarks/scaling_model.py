"""``scaling_model``: an analytic model of step time, fitted to the ``network`` results.

Reads ``benchmarks/results/network.json`` (``network.quick.json`` with
``--quick``); runs no cluster. For one worker step of a synchronous exchange
over N workers, each on a full-duplex link of B bits/s, sending m tensors
(messages) per step:

Every byte costs ``g = beta * 8 / B + gamma`` seconds: its time on the wire
and its time on the cores (serialisation, copies, the reduction), which
stays when the link is unlimited (``B`` infinite); a subdivided ring
overlaps the two.

* ring all-reduce of S bytes per worker (dense float32, fp16, PowerSGD's
  factors) in m collectives of S/m each. TensorFlow cuts each of a
  collective's 2(N-1) steps into the fewest of at most 16 chunks of at most
  4 MiB (``ring_chunk``: q bytes; below that, one chunk, q = S/(m N)). A
  step's chunks pipeline: the slower of the wire and the cores sets the
  pace, and each step waits for its last chunk's other stage. Unsubdivided
  the two add up, as they did before 2026-11-27, when no ring was
  subdivided::

      T = c + m o + 2(N-1) m alpha_hop
            + 2(N-1)/N * S max(w, gamma) + 2(N-1) m q min(w, gamma)

  with ``w = beta * 8 / B`` the wire's seconds per byte.

* all-gather of s sparse bytes per worker (DGC: values + indices, each worker
  receives everyone's), whose sparse aggregation grows with the senders::

      T = c + a(N) + m o + (N-1) m alpha_hop + (N-1) s g

* sharded parameter servers (Downpour, k shards, N workers, push and fetch of
  S bytes of float32 parameters every n steps), from the round's timeline.
  Each worker runs rounds of b blocks of n local steps
  (``steps_per_execution`` = b n); each block's gradient is pushed (all of
  it over the worker's own link, a 1/k share over each shard's, then each
  shard's update of its share, A for all the parameters) and the next
  block's parameters fetched while the next block computes, a push and a
  fetch crossing at once in opposite directions (the last block's fetch
  brings the next round's parameters). A round fills and drains: its first
  fetch, unless its worker prefetched during its previous round (a share p
  of the rounds did), and its last push have nothing to cross with
  (measured on every task's link counters at b = 4 before the prefetch;
  ``docs/architecture.md`` "On a slow link"), so alone it takes b + 2
  transfer times (b + 1 prefetched) when the wire sets the pace
  (``round_length`` measures other b). The N workers' rounds share each
  shard's links, which carry b transfers of w / k each way per round per
  worker. A round takes the longer of the two (operational analysis's
  asymptotic bounds: with transfers of fixed size at a fixed rate the
  bottleneck is reached, not approached). With w = S g::

      Z = n (c + m (o + alpha_hop))                   (one block)
      alone = (1 - p) w + max(Z, w) + (b - 1) max(Z, w + A) + w + A
      C = max(alone, N b (w + A) / k)
      T = C / (N b n)      (seconds per system step, one worker's batch)

  One prefetched worker with b = 1 pays max(Z, w) + w + A per round; many
  saturate the busiest shard (T tends to (w + A) / (k n)). On the measured
  points every task (2 workers, k shards, the chief) shares this machine's
  K cores, so a system step also takes at least the core-seconds they all
  spend on it over K (since 2026-11-27; ``ps_seconds``' ``cores``; the
  predictions for clusters, whose tasks have hosts of their own, leave it
  out)::

      T >= (c + m o + (2 S gamma + A) / n) / K

  Before
  2026-11-26 this was a
  closed queueing network solved by approximate mean value analysis with a
  round of b + 1 transfers; it fitted 33 of the 45 points of the night
  run within 15%, this form 39.

The measured links are token buckets (``tc tbf``, ``LocalCluster``'s
links), which let a transfer that finds the bucket full cross its first
``burst`` bytes (``tbf_burst_bytes``: 50 kB at 100 Mbit/s, 500 kB at
1 Gbit/s) at once instead of at the rate. The collective exchanges count it
(:func:`burst_saving`): a DGC or PowerSGD step's few tens of kB cross a
100 Mbit/s bucket almost free, and each 2 MB hop of the 1M model's
unsubdivided ring at 1 Gbit/s saves 4 ms (since 2026-11-27 evening; before,
those points were 13-19% off). The parameter servers' rounds keep a busy
link's bucket empty; its fill and drain could save at most two bursts a
round, under 2% of every measured Downpour point, and are left out. The
predictions are for real links: no burst.

``c`` is the measured compute time per step plus, for the gather exchange
(DGC), the compressor's own time as the strategy clocks it and the
measured aggregation of 2 senders' wires (``a(N)`` is that, measured at 2
and 8 senders and extrapolated linearly). Dense and fp16 gradients are
summed by one batched all-reduce, whose reduction is part of the ring;
fp16's casts to half precision and back are not (``cast_seconds``, timed on
one thread, added to ``c``; until 2026-11-27 fp16 was an all-gather of the
halves, modelled like DGC's; the ``network`` result of record is newer). PowerSGD's
clock spans its own all-reduce rounds, so its local work (error feedback, the
matrix products, the orthogonalisation: ``factorise_seconds``, timed on one
thread without the rounds) is measured apart and added to ``c``. Its
residual's update (the error feedback's new state: ``factorise_seconds``
less ``factorise_sums_seconds``, the work the sums need) waits for no sum,
so the worker's second inter-op thread runs it while the second round is
out; only what outlasts that round's fixed part stays on the step's path
(:func:`residual_hidden`; since 2026-11-27 afternoon: before, the model
put the 1M PowerSGD points 10-16% too slow in every run, the 10M ones 6-7%
too fast)::

    c = compute + factorise - min(residual, o + 2(N-1) alpha_hop)

Which parameters are what:

* measured (network run, or timed here on one thread when the result predates
  the field): ``c``, the compressor's time, ``a(2)``, ``a(8)``, ``A``,
  PowerSGD's local work and its residual's share, fp16's casts, S, m, b;
* set: each measured link's token bucket (``burst``);
* fitted per family (collective, parameter server), by least squares on the
  relative error of every measured point: ``o``, the fixed software overhead
  per message (collective launch, gRPC framing, Python; it does not grow with
  N; for the parameter servers, per push or fetch, whatever tensors it
  carries: ``network._messages``), ``beta``, the wire time over the payload time (protocol bytes and
  lost bandwidth; 1/beta is the effective share of the link), and
  ``gamma``, the software time per byte;
* assumed: ``alpha_hop``, the network latency per message per hop. Every
  measured point has N = 2, where it is indistinguishable from ``o``; the
  predictions take 20 us (a TCP message between hosts on one datacenter
  switch) and show 5 and 50 us beside it.

The model is validated against every measured point (each run, and each
configuration's run on unlimited links), in sample and leaving each point
out of its own fit. Predictions: 8-256 workers at 1, 10 and 100
Gbit/s, as scaling efficiency (throughput over N times one worker's
compute-only throughput) and relative to 8 workers, beside the reference
figure of Goyal et al. (~90% from 8 to 256 GPUs).
"""

import functools
import json
import math
import os

from benchmarks import _harness
from tfdist_ext.cluster._netns import tbf_burst_bytes

WORKERS = (8, 16, 32, 64, 128, 256)
LINKS = {"1gbit": 1e9, "10gbit": 10e9, "100gbit": 100e9}
PARAMETERS = ("o", "beta", "gamma")  # fitted per family
ALPHA_HOP = 20e-6  # assumed per-hop latency (seconds)
ALPHA_HOP_SENSITIVITY = (5e-6, 20e-6, 50e-6)
FAMILY = {"dense": "collective", "fp16": "collective", "powersgd": "collective"}
FAMILY.update(dgc="collective", ps="parameter_server")
MESSAGE = {"collective": "collective", "parameter_server": "push or fetch"}  # what o is per
GATHER = ("dgc",)  # exchanges whose compressor clock excludes the exchange
HIDDEN = {"1M": 1000, "10M": 3150}
REFERENCES = [
    {
        "what": "Goyal et al. 2017: ~90% scaling efficiency from 8 to 256 GPUs "
        "(ResNet-50, Caffe2, commodity hardware)",
        "source": "/work/shared/references/000_68952833594823f8.txt (abstract, line 111: "
        "'achieves ~90% scaling efficiency when moving from 8 to 256 GPUs')",
        "from_workers": 8,
        "workers": 256,
        "relative_efficiency": 0.90,
    }
]
REFERENCES_MISSING = (
    "The DGC paper's reported speed-ups are not in /work/shared/references: grepping its "
    "four files for 'speedup', 'speed-up', '5.8', 'Gbps', 'scalability' and 'DGC' finds the "
    "paper only as a title in a list (file 003, line 98) and a citation (file 004, line 53); "
    "so no DGC speed-up is plotted, and none is invented."
)


# --- the model -------------------------------------------------------------------


def wire_seconds(bps, beta):
    """Seconds per payload byte on the wire: ``beta`` x 8 / link rate (0 unlimited)."""
    return beta * 8 / bps


def byte_seconds(bps, beta, gamma):
    """Seconds per payload byte: the wire's (``beta`` x 8 / link rate) and the software's.

    ``gamma`` is what each byte costs the tasks' cores (serialisation, copies,
    the reduction) when the wire costs nothing; ``bps`` is ``math.inf`` there.
    """
    return wire_seconds(bps, beta) + gamma


#: TensorFlow's largest ring chunk when it subdivides, and the subdivisions
#: the compressed multi-worker strategy allows (``_integration.MAX_SUBDIVS``).
RING_CHUNK_BYTES = 4 * 2**20
RING_MAX_SUBDIVS = 16


def ring_chunk(buffer, workers):
    """Bytes of one chunk of a ring all-reduce of ``buffer`` bytes over ``workers``.

    TensorFlow's rule (``ring_alg.cc``): the fewest subdivisions, at most
    :data:`RING_MAX_SUBDIVS`, that bring ``buffer / (workers * s)`` to
    :data:`RING_CHUNK_BYTES` or less.
    """
    subdivs = 1
    while buffer / (workers * subdivs) > RING_CHUNK_BYTES and subdivs < RING_MAX_SUBDIVS:
        subdivs += 1
    return buffer / (workers * subdivs)


def ring_allreduce_seconds(
    c, payload, workers, bps, o, beta, messages, alpha_hop=ALPHA_HOP, gamma=0.0, burst=0.0
):
    """Seconds per step of a ring all-reduce of ``payload`` bytes per worker.

    The ``messages`` collectives share the payload equally; within each, a
    step's chunks pipeline (see the module docstring). ``burst``: the bytes
    of the link's token bucket (0 for a real link), which a hop crosses at
    once when it finds the bucket full (:func:`burst_saving`).
    """
    n = workers
    hops = 2 * (n - 1)
    wire = wire_seconds(bps, beta)
    share = payload / messages if payload else 0.0
    chunk = ring_chunk(share, n)
    exposed = chunk * min(wire, gamma)  # a step's last chunk, in the other stage
    paced = hops / n * payload * max(wire, gamma) + messages * hops * exposed
    saved = messages * burst_saving(share / n, hops, chunk, wire, gamma, exposed, burst)
    return c + messages * (o + hops * alpha_hop) + paced - saved


def burst_saving(hop_bytes, hops, chunk, wire, gamma, gap, burst):
    """Wire seconds one collective saves on a token-bucket link (``burst`` bytes).

    A ``tc tbf`` bucket lets the bytes it holds through at once and refills
    at the link rate while the link idles: 4 ms for LocalCluster's bucket at
    either measured rate. Every collective follows the step's compute or
    the local work between two collectives, plus ``o`` (3-8 ms fitted), so
    its first hop finds the bucket full. In a
    subdivided ring the hops then pipeline with no idle link, and the
    burst's bytes take the cores' pace instead of the wire's. In an
    unsubdivided one each later hop finds what its predecessor left plus
    what refilled during ``gap`` (that hop's last stage on the cores).
    """
    if not burst or not wire:
        return 0.0
    if chunk < hop_bytes:  # subdivided: one pipelined stream
        return min(burst, hop_bytes) * max(0.0, wire - gamma)
    tokens, saved = burst, 0.0
    for _ in range(hops):
        used = min(tokens, hop_bytes)
        saved += used
        tokens = min(burst, tokens - used + gap / wire)
    return wire * saved


def allgather_seconds(
    c, payload, workers, bps, o, beta, messages, alpha_hop=ALPHA_HOP, gamma=0.0, burst=0.0
):
    """Seconds per step of an all-gather of ``payload`` (sparse) bytes per worker.

    ``burst``: as in :func:`ring_allreduce_seconds`; a step's gather starts
    with the bucket full, so its first ``burst`` bytes cross at once.
    """
    n = workers
    wire = (n - 1) * payload * byte_seconds(bps, beta, gamma)
    saved = min(burst, (n - 1) * payload) * wire_seconds(bps, beta)
    return c + messages * (o + (n - 1) * alpha_hop) + wire - saved


def ps_seconds(
    c,
    params_bytes,
    workers,
    bps,
    o,
    beta,
    messages,
    alpha_hop=ALPHA_HOP,
    gamma=0.0,
    *,
    shards,
    every,
    apply,
    blocks=1,
    prefetched=0.0,
    cores=None,
):
    """Seconds per system step (one worker's batch) of sharded parameter servers.

    Each of the N workers cycles through rounds of ``blocks`` blocks of
    ``every`` local steps (``c`` and the software overhead of its messages,
    on its own cores). A round's pushes and fetches move all the parameters
    over the worker's own link (w each) and its share over each shard's;
    the shard then applies its share of the update (``apply`` in all). A
    block's push and the next fetch cross at once, in opposite directions,
    while the next block computes (``docs/architecture.md`` "On a slow
    link"), but a round's first fetch, unless its worker prefetched its
    parameters during its previous round (``prefetched``: the share of
    rounds that did), and its last push have nothing to cross with
    (:func:`round_alone`). The round takes the longer of that, which is one
    worker's round, and the busiest shard link's time for the N workers'
    rounds (operational analysis's asymptotic bounds; for transfers of
    fixed size at a fixed rate the bottleneck is reached, not approached).

    ``cores``: when every task shares that many cores (the measured points:
    2 workers, the shards and the chief on this machine), a system step also
    takes at least the core-seconds all of them spend on it (compute, the
    messages' overhead, a push's and a fetch's software time, the update)
    over the cores. None for a cluster whose tasks have hosts of their own.
    """
    wire = params_bytes * byte_seconds(bps, beta, gamma)
    block = every * (c + messages * (o + alpha_hop))
    alone = round_alone(block, wire, wire + apply, blocks, prefetched)
    # Every round crosses each shard's inbound link `blocks` times (its share
    # of a push, then its update) and its outbound link as often.
    busiest_shard = workers * blocks * (wire + apply) / shards
    seconds = max(alone, busiest_shard) / (workers * blocks * every)
    if cores:
        core_seconds = c + messages * o + (2 * params_bytes * gamma + apply) / every
        seconds = max(seconds, core_seconds / cores)
    return seconds


def round_alone(block, transfer, push, blocks, prefetched=0.0):
    """Seconds of one worker's round of ``blocks`` blocks on otherwise idle links.

    ``transfer`` is the time of one crossing alone (a fetch, or a push before
    its update), ``push`` that of a push with the shards' update. A round is
    its first fetch, unless it starts from parameters prefetched in its
    worker's previous round (the share ``prefetched`` of rounds); block 1,
    while the fetch for block 2 crosses; each later block, while the
    previous block's push and the next fetch (the last block's: the next
    round's parameters) cross at once; and its own push. When the wire sets
    the pace that is b + 2 transfer times for a round that fetches first
    and b + 1 for one that starts prefetched, not b (the first from one
    worker's link counters at b = 4; ``round_length`` measures other b).
    """
    carried = max(block, transfer) + (blocks - 1) * max(block, push, transfer) + push
    return carried + (1.0 - prefetched) * transfer


def residual_hidden(residual, workers, o, alpha_hop=ALPHA_HOP):
    """Seconds of PowerSGD's residual update that run while its second round is out.

    The update (``M - P Q^T`` with the worker's own ``Q``) needs no sum, so
    it runs beside the second all-reduce on the worker's other inter-op
    thread, for as long as that round's fixed part lasts (its overhead ``o``
    and ``2(N-1)`` hops' latency; its bytes, rank x columns floats, are left
    out). The rest of it is on the step's path.
    """
    return min(residual, o + 2 * (workers - 1) * alpha_hop)


def aggregate_at(point, workers):
    """The measured aggregation seconds at ``workers`` senders (DGC: linear in the senders).

    More senders never make it cheaper: a timing of 8 below that of 2 (noise;
    the dense scatter of 10M floats dominates both) counts as flat.
    """
    a2, a8 = point["aggregate"]
    if point["kind"] != "dgc":
        return a2
    return a2 + max(0.0, a8 - a2) * (workers - 2) / 6


def predict(point, workers, bps, params, alpha_hop=ALPHA_HOP):
    """Seconds per step of ``point`` (a dict as in :func:`points`) at ``workers`` and ``bps``."""
    o, beta, gamma = params[FAMILY[point["kind"]]]
    c = point["c"] + aggregate_at(point, workers)
    if point["kind"] == "powersgd":
        c -= residual_hidden(point["residual"], workers, o, alpha_hop)
    args = (c, point["payload"], workers, bps, o, beta, point["messages"], alpha_hop, gamma)
    if point["kind"] == "ps":  # no burst: see the module docstring
        return ps_seconds(
            *args,
            shards=point["shards"],
            every=point["every"],
            apply=point["apply"],
            blocks=point["blocks"],
            prefetched=point.get("prefetched", 0.0),
            cores=point.get("cores"),
        )
    burst = point.get("burst", 0.0)
    if point["kind"] == "dgc":
        return allgather_seconds(*args, burst=burst)
    return ring_allreduce_seconds(*args, burst=burst)


def points(network, measure=None):
    """Measured points of a ``network`` result: the model's inputs and the measured step.

    ``measure(kind, model)`` supplies ``local_costs`` for runs recorded before
    the network benchmark stored them (default: :func:`measured_here`).
    """
    if not isinstance(network, dict) or not isinstance(network.get("runs"), list):
        raise ValueError("scaling_model: the network result has no 'runs' list")
    measure = measure or measured_here
    # A run's tasks (Downpour's workers, shards and chief) share this machine's cores.
    cores = (network.get("machine") or {}).get("cpu_count")
    block_compute = _block_compute(network["runs"])
    out, seen = [], set()
    for i, run in enumerate(network["runs"]):

        def local_cost(field, run=run):
            """The run's recorded local cost ``field``, or timed here if it predates it."""
            value = run.get(field)
            return measure(run["kind"], run["model"])[field] if value is None else value

        try:
            kind = run["kind"]
            if kind not in FAMILY:
                raise ValueError(f"scaling_model: run {i} has unknown kind {kind!r}")
            point = {
                "system": run["system"],
                "model": run["model"],
                "link": run["link"],
                "kind": kind,
                "workers": int(run["workers"]),
                "bps": float(run["link_bps"]),
                "c": float(run["compute_seconds"]),
                "compute": float(run["compute_seconds"]),
                "messages": float(run["messages"]),
                "measured": float(run["step_seconds"]),
                "examples_per_step": int(run["examples_per_step"]),
                "aggregate": (0.0, 0.0),
                # Its block's median timing of the train step (see _block_compute).
                "block_compute": block_compute.get(
                    (run["model"], run["link"]), float(run["compute_seconds"])
                ),
                # The emulated link's token bucket (LocalCluster's rule).
                "burst": float(tbf_burst_bytes(run["link_bps"])) if run["link_bps"] else 0.0,
            }
            if kind == "ps":
                # Its workers run the synchronous rows' train step; it timed none.
                point["c"] = point["compute"] = point["block_compute"]
                point["payload"] = 4.0 * run["params"]
                point["shards"] = int(run["ps"])
                point["every"] = int(run["n"])
                point["messages"] = _ps_messages(run)
                point["blocks"] = _blocks(run)
                # Runs before 2026-11-26 (no prefetch across rounds) lack it.
                point["prefetched"] = float(run.get("prefetched_fraction") or 0.0)
                point["cores"] = cores
                point["apply"] = float(local_cost("apply_seconds"))
            else:
                point["payload"] = float(run["logical_bytes"])
            if kind == "powersgd":
                factorise = float(local_cost("factorise_seconds"))
                point["c"] += factorise
                # The residual's update, which needs no sum (residual_hidden):
                # what of the local work in c is beyond the sums' share. The
                # timings before 2026-11-27 evening held the sums alone (their
                # residual was pruned), so those runs hide nothing.
                sums = float(local_cost("factorise_sums_seconds"))
                point["residual"] = max(0.0, factorise - sums)
            if kind == "fp16":
                point["c"] += float(local_cost("cast_seconds"))
            if kind in GATHER:
                point["compress"] = float(run.get("compress_seconds") or 0.0)
                point["c"] += point["compress"]
                agg = local_cost("aggregate_seconds")
                point["aggregate"] = (float(agg["2"]), float(agg["8"]))
        except (KeyError, TypeError, ValueError) as e:
            if str(e).startswith("scaling_model:"):
                raise
            raise ValueError(
                f"scaling_model: run {i} of the network result is invalid: {e!r}"
            ) from None
        out.append(point)
        unlimited = run.get("unlimited_step_seconds")
        key = (point["model"], point["system"])
        if unlimited is not None and key not in seen:
            # The configuration once more on links without a rate limit.
            seen.add(key)
            # Their own compute (and compressor) timings; runs before 2026-11-27 noon
            # recorded none, and their block's median compute stands in.
            compute = run.get("unlimited_compute_seconds")
            compress = run.get("unlimited_compress_seconds")
            none = dict(
                _at_compute(
                    point,
                    point["block_compute"] if compute is None else float(compute),
                    float(compress) if compress is not None and kind in GATHER else None,
                ),
                link="none",
                bps=math.inf,
                burst=0.0,
                measured=float(unlimited),
            )
            out.append(none)
    if not out:
        raise ValueError("scaling_model: the network result has no runs")
    return out


def _at_block_compute(point):
    """``point`` with its block's median compute in place of its own timing, local costs kept."""
    return _at_compute(point, point["block_compute"])


def _at_compute(point, compute, compress=None):
    """``point`` with ``compute`` (and the compressor's ``compress``, if given) in place of
    its own timings, its other local costs kept."""
    c = point["c"] - point["compute"] + compute
    if compress is not None:
        c += compress - point.get("compress", 0.0)
        point = dict(point, compress=compress)
    return dict(point, c=c, compute=compute)


def _block_compute(runs):
    """{(model, link): the median compute of that block's synchronous runs} (``network.block_compute``).

    ``network`` records it in Downpour rows since 2026-11-27 noon; rows
    before carry the dense run's one timing (in one run of 2026-11-27
    0.058 s, the three others' 0.033-0.034 s: the Downpour points took 70%
    too much compute), hence this fallback.
    """
    from benchmarks import network

    return network.block_compute(runs)


def _ps_messages(run):
    """Transfers a Downpour worker makes per step (``network._messages``).

    Counted from the run's configuration, not read from it: runs recorded
    before 2026-11-25 counted a message per variable and shard.
    """
    from benchmarks import network

    return float(network._messages("ps", int(run["n"])))


def _blocks(run):
    """Blocks of n steps per Downpour round (``steps_per_execution`` over n) of a run."""
    from benchmarks._network_run import round_steps

    n = int(run["n"])
    steps = round_steps({"n": n, "chunk": 4 * n, **(run.get("config") or {})})
    return max(1, int(steps) // n)


@functools.cache
def measured_here(kind, model):
    """``local_costs`` of ``benchmarks._network_run``, timed in this process on one thread."""
    import tensorflow as tf

    from benchmarks import _network_run

    tf.config.threading.set_intra_op_parallelism_threads(1)
    MEASURED_HERE.add((kind, model))
    return _network_run.local_costs(kind, HIDDEN[model])


MEASURED_HERE = set()


def fit(pts):
    """``{family: (o, beta, gamma)}`` minimising the squared relative error of each family."""
    import numpy as np
    from scipy.optimize import least_squares

    params = {}
    for family in sorted({FAMILY[p["kind"]] for p in pts}):
        sub = [p for p in pts if FAMILY[p["kind"]] == family]

        def residuals(x, sub=sub, family=family):
            trial = {family: tuple(x)}
            return [predict(p, p["workers"], p["bps"], trial) / p["measured"] - 1 for p in sub]

        result = least_squares(
            residuals,
            x0=[1e-3, 1.0, 1e-9],
            bounds=([0.0, 0.0, 0.0], [np.inf, np.inf, np.inf]),
            x_scale=[1e-3, 1.0, 1e-9],
        )
        params[family] = tuple(float(v) for v in result.x)
    return params


def validate(pts, params):
    """Relative error of the model at every measured point, in sample and left out."""
    rows = []
    for i, p in enumerate(pts):
        predicted = predict(p, p["workers"], p["bps"], params)
        rest = [q for j, q in enumerate(pts) if j != i]
        family = FAMILY[p["kind"]]
        left_out = None
        if sum(FAMILY[q["kind"]] == family for q in rest) >= len(PARAMETERS):
            left_out = predict(p, p["workers"], p["bps"], fit(rest)) / p["measured"] - 1
        rows.append(
            {
                "model": p["model"],
                "link": p["link"],
                "system": p["system"],
                "measured": p["measured"],
                "predicted": predicted,
                "error": predicted / p["measured"] - 1,
                "left_out_error": left_out,
            }
        )
    return rows


def load(path):
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"scaling_model: {path} does not exist; run `python -m benchmarks.run network` "
            "(or `... network --quick` for network.quick.json) first"
        )
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"scaling_model: {path} is not valid JSON: {e}") from None


# --- the benchmark ---------------------------------------------------------------


def _scenarios(pts):
    """The systems to scale, one point per (model, system), at its block's median compute;
    Downpour once per n with the first shard count measured, twice: shards fixed at it,
    and one shard per 4 workers."""
    out = {}
    for p in map(_at_block_compute, pts):
        if p["kind"] != "ps":
            out.setdefault((p["model"], p["system"]), p)
            continue
        for per in (None, 4):
            name = f"downpour n={p['every']} " + (f"ps={p['shards']}" if per is None else "ps=N/4")
            out.setdefault((p["model"], name), dict(p, system=name, workers_per_shard=per))
    return list(out.values())


def _on_cluster(p, workers):
    """The measured scenario ``p`` on a cluster of ``workers``: every task on a host of
    its own (no shared-cores bound) and real links (no token bucket's burst). Downpour
    gets its shards (one per ``workers_per_shard`` workers, at least the measured
    ones); a push or fetch reaches every shard at once, so its fixed cost stays one
    transfer's (see ``network._messages``)."""
    out = dict(p, cores=None, burst=0.0)
    if p["kind"] == "ps":
        per = p.get("workers_per_shard")
        out["shards"] = max(p["shards"], workers // per) if per else p["shards"]
    return out


def predictions(pts, params, alpha_hops=ALPHA_HOP_SENSITIVITY):
    rows = []
    for p in _scenarios(pts):
        for alpha_hop in alpha_hops:
            for link, bps in LINKS.items():
                for n in WORKERS:
                    rows.append(_prediction(p, n, link, bps, params, alpha_hop))
    return rows


def _prediction(p, n, link, bps, params, alpha_hop):
    def at(workers):
        seconds = predict(_on_cluster(p, workers), workers, bps, params, alpha_hop)
        # Ideal: compute only (PS: the workers compute in parallel, c/N per system step).
        ideal = p["compute"] / workers if p["kind"] == "ps" else p["compute"]
        return seconds, ideal / seconds

    seconds, efficiency = at(n)
    per_step = (
        p["examples_per_step"] if p["kind"] == "ps" else p["examples_per_step"] / p["workers"] * n
    )
    return {
        "model": p["model"],
        "system": p["system"],
        "link": link,
        "workers": n,
        "alpha_hop_us": round(1e6 * alpha_hop, 3),
        "step_seconds": seconds,
        "examples_per_second": per_step / seconds,
        "efficiency": efficiency,
        "relative_to_8": efficiency / at(8)[1],
    }


def run(quick=False, seed=0):
    del seed  # nothing random: the model is fitted to measured points
    name = "network.quick.json" if quick else "network.json"
    network = load(os.path.join(_harness.RESULTS_DIR, name))
    pts = points(network)
    params = fit(pts)
    checks = validate(pts, params)
    preds = predictions(pts, params)
    worst = max(abs(c["error"]) for c in checks)
    loo = [abs(c["left_out_error"]) for c in checks if c["left_out_error"] is not None]
    default = [p for p in preds if p["alpha_hop_us"] == round(1e6 * ALPHA_HOP, 3)]
    plots = _plots(default, checks, quick)
    return {
        "candidate": "analytic model (compute + measured compressor/aggregation/update time + "
        "per-message overhead o + per-hop latency alpha_hop + beta x bytes / link rate, per "
        "topology; sharded PS from its round's timeline and the busiest shard), fitted to the network benchmark",
        "peer": "the measured points of benchmarks/results/" + name,
        "source": name,
        "source_quick": bool(network.get("quick")),
        "parameters": {
            **{
                f: {"o_seconds_per_message": o, "beta": b, "gamma_seconds_per_byte": g}
                for f, (o, b, g) in params.items()
            },
            "alpha_hop_seconds_assumed": ALPHA_HOP,
            "alpha_hop_sensitivity_seconds": list(ALPHA_HOP_SENSITIVITY),
        },
        "measured_here": sorted(f"{k} {m}" for k, m in MEASURED_HERE),
        "validation": checks,
        "within_15_percent": all(abs(c["error"]) <= 0.15 for c in checks),
        "max_abs_error": worst,
        "max_abs_left_out_error": max(loo) if loo else None,
        "predictions": preds,
        "references": REFERENCES,
        "figures": [
            _harness.figure("validation", "model", "max |error|", "fraction", [worst]),
        ],
        "table": validation_table(checks),
        "prediction_table": prediction_table(default),
        "sensitivity_table": sensitivity_table(preds),
        "plots": plots,
        "notes": _notes(params, worst, loo)
        + [
            f"Only {k} measured point(s) of the {f} family: its three parameters are not "
            "identified, so its predictions rest on the full run's points."
            for f, k in _family_counts(pts).items()
            if k <= len(PARAMETERS)
        ],
    }


def _family_counts(pts):
    counts = {}
    for p in pts:
        counts[FAMILY[p["kind"]]] = counts.get(FAMILY[p["kind"]], 0) + 1
    return counts


def validation_table(checks):
    return {
        "columns": [
            "model",
            "link",
            "system",
            "measured s",
            "predicted s",
            "error %",
            "left out %",
        ],
        "rows": [
            [
                c["model"],
                c["link"],
                c["system"],
                round(c["measured"], 4),
                round(c["predicted"], 4),
                round(100 * c["error"], 1),
                "-" if c["left_out_error"] is None else round(100 * c["left_out_error"], 1),
            ]
            for c in checks
        ],
    }


def prediction_table(preds, workers=(8, 64, 256)):
    """Predicted examples/s and efficiency: one row per (model, system, link)."""
    keys = list(dict.fromkeys((p["model"], p["system"], p["link"]) for p in preds))
    rows = []
    for key in keys:
        row = list(key)
        for n in workers:
            p = next(
                q
                for q in preds
                if (q["model"], q["system"], q["link"]) == key and q["workers"] == n
            )
            row += [round(p["examples_per_second"], 0), round(100 * p["efficiency"], 1)]
        rows.append(row)
    columns = ["model", "system", "link"]
    for n in workers:
        columns += [f"{n} w. ex/s", f"{n} w. eff %"]
    return {"columns": columns, "rows": rows}


def sensitivity_table(preds, workers=256):
    """Efficiency relative to 8 workers at ``workers``, per assumed alpha_hop."""
    alphas = sorted({p["alpha_hop_us"] for p in preds})
    keys = list(dict.fromkeys((p["model"], p["system"], p["link"]) for p in preds))
    rows = []
    for key in keys:
        row = list(key)
        for a in alphas:
            p = next(
                q
                for q in preds
                if (q["model"], q["system"], q["link"]) == key
                and q["workers"] == workers
                and q["alpha_hop_us"] == a
            )
            row.append(round(100 * p["relative_to_8"], 1))
        rows.append(row)
    columns = ["model", "system", "link"] + [f"{workers}/8 % at {a:g} us" for a in alphas]
    return {"columns": columns, "rows": rows}


def _plots(preds, checks, quick):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suffix = ".quick" if quick else ""
    models = sorted({p["model"] for p in preds})
    fig, axes = plt.subplots(
        len(models), len(LINKS), figsize=(5 * len(LINKS), 4 * len(models)), squeeze=False
    )
    for row, model in zip(axes, models):
        for ax, link in zip(row, LINKS):
            for system in dict.fromkeys(p["system"] for p in preds if p["model"] == model):
                sub = [
                    p
                    for p in preds
                    if p["model"] == model and p["system"] == system and p["link"] == link
                ]
                ax.plot(
                    [p["workers"] for p in sub],
                    [100 * p["relative_to_8"] for p in sub],
                    marker=".",
                    label=system,
                )
            for ref in REFERENCES:
                ax.plot(
                    [ref["workers"]],
                    [100 * ref["relative_efficiency"]],
                    "k*",
                    markersize=12,
                    label="Goyal et al. (8->256 GPUs)",
                )
            ax.set_xscale("log", base=2)
            ax.set_ylim(0, 110)
            ax.set_xlabel("workers")
            ax.set_ylabel("efficiency relative to 8 workers, %")
            ax.set_title(f"{model} params, {link} (predicted)")
            ax.legend(fontsize=6)
    fig.tight_layout()
    paths = [_save(fig, f"scaling_model{suffix}.png")]
    fig, ax = plt.subplots(figsize=(6, 5))
    ax.loglog([c["measured"] for c in checks], [c["predicted"] for c in checks], "o")
    lo = min(min(c["measured"], c["predicted"]) for c in checks) * 0.8
    hi = max(max(c["measured"], c["predicted"]) for c in checks) * 1.2
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.5)
    ax.plot([lo, hi], [1.15 * lo, 1.15 * hi], "k:", lw=0.5)
    ax.plot([lo, hi], [lo / 1.15, hi / 1.15], "k:", lw=0.5)
    ax.set_xlabel("measured seconds per step")
    ax.set_ylabel("predicted seconds per step")
    ax.set_title("scaling model vs every measured point (dotted: +-15%)")
    fig.tight_layout()
    paths.append(_save(fig, f"scaling_model_validation{suffix}.png"))
    plt.close("all")
    return paths


def _save(fig, name):
    os.makedirs(_harness.RESULTS_DIR, exist_ok=True)
    path = os.path.join(_harness.RESULTS_DIR, name)
    fig.savefig(path, dpi=100)
    return os.path.relpath(path, os.path.dirname(_harness.RESULTS_DIR))


def _notes(params, worst, loo):
    fitted = "; ".join(
        f"{f}: o = {1e3 * o:.2f} ms per {MESSAGE[f]}, beta = {b:.2f} (effective link share "
        f"{100 / b if b else float('inf'):.0f}%), gamma = {1e9 * g:.2f} ns per byte "
        f"({1e-6 / g if g else float('inf'):.0f} MB/s of software)"
        for f, (o, b, g) in params.items()
    )
    here = sorted(f"{k} {m}" for k, m in MEASURED_HERE)
    return [
        f"Fitted (every measured point, least squares on the relative error): {fitted}.",
        f"Largest |error| over every measured point: {100 * worst:.1f}% in sample"
        + (f", {100 * max(loo):.1f}% with the point left out of its fit." if loo else ".")
        + " Leave-one-out needs three other points of the same family (three parameters).",
        "Measured points: every run of the network benchmark, and each configuration once more "
        "on links without a rate limit (link 'none', its no-limit step), where only compute, "
        "o and gamma remain.",
        "Measured: compute per step; the compressor's own time (strategy clock, gather "
        "exchanges); the aggregation of 2 and 8 senders' wires, PowerSGD's local work, fp16's "
        "casts and one Adagrad update of all parameters (benchmarks._network_run.local_costs, "
        "one thread); bytes and messages per step; Downpour's blocks per round "
        "(steps_per_execution / n). Set: each measured link's token-bucket burst (LocalCluster's "
        "tbf: 50 kB at 100 Mbit/s, 500 kB at 1 Gbit/s), which a collective's transfer that "
        "finds the bucket full crosses at once; predictions are for real links, without it. "
        "Fitted per family: o (software overhead per message, fixed in N), beta (wire time "
        "over payload time) and gamma (software time per payload byte, which the cores spend "
        "whatever the link: at 1 Gbit/s it is a large part of a dense step). "
        f"Assumed: alpha_hop = {1e6 * ALPHA_HOP:g} us per message per hop (typical for TCP "
        "between hosts on one switch; not identifiable at N = 2, where it merges with o; "
        "the sensitivity table shows 5, 20 and 50 us).",
        "Local costs timed in this process because the network result predates them: "
        + (", ".join(here) if here else "none")
        + ".",
        "Measured points all have N = 2 workers, where ring all-reduce and all-gather move "
        "the same bytes; the N-dependence of each formula is the model's, not measured.",
        "Predictions keep each point's compute time per step (2-core machine, batch 64 per "
        "worker), payload and fitted o; PS scenarios use one shard per 4 workers (at least the "
        "measured number) and the measured n_fetch = n_push. o is TensorFlow's gRPC "
        "collectives on this box; a cluster with a faster collective library has a smaller o "
        "and scales better.",
        "Downpour on this box runs 2 workers, the ps shards and the chief on 2 cores: on the "
        "measured points a system step takes at least the core-seconds of all tasks over the "
        "machine's cores (compute, message overhead, a push's and a fetch's software time, the "
        "update). The predictions leave that bound out (a cluster's tasks have hosts of their "
        "own) and divide a shard's gamma among the shards, as such a cluster would.",
        "Efficiency = compute-only step / predicted step (synchronous), or c/N over the system "
        "step (PS); 'relative to 8' divides by the same at 8 workers, as Goyal et al.'s 8 -> "
        "256 figure does. Goyal's figure is ResNet-50 on GPUs, where compute per step is "
        "far larger relative to the gradient bytes than for these MLPs.",
        REFERENCES_MISSING,
    ]


def readme(path=None):
    """The README's scaling-model tables, regenerated from a result file."""
    path = path or os.path.join(_harness.RESULTS_DIR, "scaling_model.json")
    with open(path) as f:
        result = json.load(f)
    label = "quick run, to be replaced" if result.get("source_quick") else "full run"
    return (
        f"({label}: fitted to `{result['source']}`)\n\n"
        + _harness.format_table(result["table"])
        + "\n\n"
        + _harness.format_table(result["prediction_table"])
        + "\n\n"
        + _harness.format_table(result["sensitivity_table"])
    )


if __name__ == "__main__":
    import sys

    print(readme(*sys.argv[1:]))
