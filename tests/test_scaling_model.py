"""The scaling model of benchmarks/scaling_model.py: formulas on hand-computed cases,
its fit recovering known parameters, its validation, and clear errors on bad input."""

import json
import math

import pytest

from benchmarks import _harness
from benchmarks import scaling_model as M

pytestmark = pytest.mark.timeout(60)


def test_ring_allreduce_by_hand():
    # c + m (o + 2(N-1) alpha_hop) + beta 2(N-1)/N 8 S / B, N = 4, m = 2:
    # 0.1 + 2 (1e-3 + 6 * 1e-5) + 1.5 * 8e6 / 1e9
    seconds = M.ring_allreduce_seconds(
        0.1, 1e6, 4, 1e9, o=1e-3, beta=1.0, messages=2, alpha_hop=1e-5
    )
    assert seconds == pytest.approx(0.1 + 2 * (1e-3 + 6e-5) + 0.012)
    # Two workers: the ring sends the payload once.
    assert M.ring_allreduce_seconds(0, 1e6, 2, 8e6, 0, 1.0, 1, 0.0) == pytest.approx(1.0)


def test_ring_chunks_follow_tensorflows_subdivision():
    mib = 2**20
    assert M.ring_chunk(4 * mib, 2) == 2 * mib  # small: one chunk per worker
    assert M.ring_chunk(40e6, 2) == pytest.approx(4e6)  # 5 subdivisions of <= 4 MiB
    assert M.ring_chunk(1e9, 2) == pytest.approx(1e9 / 32)  # at most 16 subdivisions
    assert M.ring_chunk(40e6, 16) == pytest.approx(2.5e6)


def test_subdivided_ring_overlaps_wire_and_cores():
    # 40 MB over 2 workers at 1 Gbit/s, gamma 3 ns/B: chunks of 4 MB pipeline, so
    # 40 MB at the wire's pace plus 2 steps x 4 MB at the cores' (not 40 MB of each).
    w, gamma = 8e-9, 3e-9
    seconds = M.ring_allreduce_seconds(0.03, 40e6, 2, 1e9, 0.0, 1.0, 1, 0.0, gamma=gamma)
    assert seconds == pytest.approx(0.03 + 40e6 * w + 2 * 4e6 * gamma)
    # Unlimited link: the cores set the pace alone.
    unlimited = M.ring_allreduce_seconds(0.03, 40e6, 2, math.inf, 0.0, 1.0, 1, 0.0, gamma=gamma)
    assert unlimited == pytest.approx(0.03 + 40e6 * gamma)
    # Below 2 x 4 MiB the ring is not subdivided: wire and cores add up.
    small = M.ring_allreduce_seconds(0.0, 4e6, 2, 1e9, 0.0, 1.0, 1, 0.0, gamma=gamma)
    assert small == pytest.approx(4e6 * (w + gamma))


def test_token_bucket_burst_crosses_at_once():
    w, gamma = 8e-9, 3e-9
    # 4 MB over 2 workers at 1 Gbit/s is not subdivided: each 2 MB hop finds a
    # full 500 kB bucket (the cores' 6 ms between the hops refill 750 kB).
    plain = M.ring_allreduce_seconds(0.0, 4e6, 2, 1e9, 0.0, 1.0, 1, 0.0, gamma=gamma)
    bucket = M.ring_allreduce_seconds(0.0, 4e6, 2, 1e9, 0.0, 1.0, 1, 0.0, gamma, burst=5e5)
    assert plain - bucket == pytest.approx(2 * 5e5 * w)
    # Hops smaller than a 50 kB bucket at 100 Mbit/s: the wire costs nothing.
    small = M.ring_allreduce_seconds(0.01, 4e4, 2, 1e8, 2e-3, 1.0, 1, 0.0, burst=5e4)
    assert small == pytest.approx(0.01 + 2e-3)
    # What a hop leaves in the bucket serves the next: 40 kB hops, then 10 kB left.
    rest = M.ring_allreduce_seconds(0.0, 8e4, 2, 1e8, 0.0, 1.0, 1, 0.0, burst=5e4)
    assert rest == pytest.approx((8e4 - 5e4) * 8e-8)
    # Each collective starts with the bucket full (o refills it).
    two = M.ring_allreduce_seconds(0.0, 8e4, 2, 1e8, 0.0, 1.0, 2, 0.0, burst=5e4)
    assert two == pytest.approx(0.0)
    # A subdivided ring streams: the burst's bytes go at the cores' pace.
    big = M.ring_allreduce_seconds(0.0, 40e6, 2, 1e9, 0.0, 1.0, 1, 0.0, gamma, burst=5e5)
    plain = M.ring_allreduce_seconds(0.0, 40e6, 2, 1e9, 0.0, 1.0, 1, 0.0, gamma=gamma)
    assert plain - big == pytest.approx(5e5 * (w - gamma))
    # An all-gather's step starts with the bucket full; an unlimited link saves nothing.
    assert M.allgather_seconds(0.0, 1e4, 2, 1e8, 0.0, 1.0, 2, 0.0, burst=5e4) == 0.0
    assert M.allgather_seconds(0.0, 6e4, 2, 1e8, 0.0, 1.0, 2, 0.0, burst=5e4) == pytest.approx(
        1e4 * 8e-8
    )
    assert M.ring_allreduce_seconds(0.0, 4e6, 2, math.inf, 0, 1, 1, 0, gamma, burst=5e5) == (
        pytest.approx(4e6 * gamma)
    )


def test_measured_links_have_localclusters_bucket_but_predictions_do_not():
    from tfdist_ext.cluster._netns import tbf_burst_bytes

    assert tbf_burst_bytes(100e6) == 50_000 and tbf_burst_bytes(1e9) == 500_000
    assert tbf_burst_bytes(1e6) == 32 * 1024
    network = {"runs": [dict(_run_record("dgc", 1e8, 1e6, 1e4, 1.0), unlimited_step_seconds=0.5)]}
    measured, unlimited = M.points(network)
    assert measured["burst"] == 50_000 and unlimited["burst"] == 0.0
    params = {"collective": (1e-3, 1.0, 1e-9)}
    row = M._prediction(measured, 8, "1gbit", 1e9, params, 2e-5)
    assert row["step_seconds"] == pytest.approx(M.predict(dict(measured, burst=0), 8, 1e9, params))
    assert row["step_seconds"] > M.predict(measured, 8, 1e9, params)


def test_overhead_o_does_not_grow_with_workers():
    # Growth from 2 to 64 workers is the same whatever o: only alpha_hop and bytes grow.
    def growth(o):
        at = [M.ring_allreduce_seconds(0.01, 1e6, n, 1e9, o, 1.2, 6, 2e-5) for n in (2, 64)]
        return at[1] - at[0]

    assert growth(0.0) == pytest.approx(growth(5e-3))
    assert growth(0.0) == pytest.approx(6 * 2 * 62 * 2e-5 + 1.2 * 8e6 / 1e9 * (126 / 64 - 1))
    # The per-hop latency does grow with the ring: 2(N-1) hops per message.
    assert M.ring_allreduce_seconds(0, 0, 8, 1e9, 0, 1, 1, 1e-5) == pytest.approx(14e-5)


def test_allgather_bytes_grow_with_workers():
    # DGC: each worker receives the (N-1) others' 1e5 sparse bytes.
    seconds = M.allgather_seconds(0.1, 1e5, 8, 1e8, 0.0, 1.0, 1, 0.0)
    assert seconds == pytest.approx(0.1 + 0.056)
    assert M.allgather_seconds(0, 1e5, 16, 1e8, 0, 1.0, 1, 0.0) == pytest.approx(15 * 8e5 / 1e8)
    assert M.allgather_seconds(0, 0, 16, 1e8, 1e-3, 1.0, 3, 1e-5) == pytest.approx(
        3 * (1e-3 + 15e-5)
    )


def test_dgc_aggregation_is_linear_in_senders():
    point = {"kind": "dgc", "aggregate": (1e-3, 4e-3)}
    assert M.aggregate_at(point, 2) == pytest.approx(1e-3)
    assert M.aggregate_at(point, 14) == pytest.approx(7e-3)
    assert M.aggregate_at(dict(point, kind="dense"), 14) == pytest.approx(1e-3)  # a ring
    # A timing at 8 senders below that at 2 (noise) does not make 256 cheaper.
    noisy = {"kind": "dgc", "aggregate": (37e-3, 33e-3)}
    assert M.aggregate_at(noisy, 256) == pytest.approx(37e-3)


def test_parameter_server_closed_queue():
    # 4e7 bytes of parameters, 100 Mbit/s: a push or a fetch is 3.2 s of link time.
    kw = dict(o=0.0, beta=1.0, messages=0, alpha_hop=0.0, prefetched=1.0)
    # One worker, rounds of one step, each from the parameters prefetched
    # in the last: its step while the next round's parameters cross, then
    # its push and the update.
    one = M.ps_seconds(0.2, 4e7, 1, 1e8, **kw, shards=1, every=1, apply=0.8)
    assert one == pytest.approx(3.2 + 3.2 + 0.8)
    # A round that fetches first pays that fetch too.
    fresh = M.ps_seconds(0.2, 4e7, 1, 1e8, **dict(kw, prefetched=0.0), shards=1, every=1, apply=0.8)
    assert fresh == pytest.approx(3.2 + 3.2 + 3.2 + 0.8)
    every5 = M.ps_seconds(0.2, 4e7, 1, 1e8, **kw, shards=1, every=5, apply=0.0)
    assert every5 == pytest.approx(2 * 3.2 / 5)
    # Two workers, one shard: each worker's round (6.4 s) and each of the
    # shard's links (6.4 s of both workers' transfers) set the pace; a third
    # worker saturates the shard (9.6 s of its links a round).
    two = M.ps_seconds(0.2, 4e7, 2, 1e8, **kw, shards=1, every=1, apply=0.0)
    assert two == pytest.approx(6.4 / 2)
    three = M.ps_seconds(0.2, 4e7, 3, 1e8, **kw, shards=1, every=1, apply=0.0)
    assert three == pytest.approx(9.6 / 3)
    # Many workers saturate the busiest shard: its inbound link and update.
    kw = dict(o=1e-3, beta=1.0, messages=12, alpha_hop=0.0)
    for workers in (128, 256):
        seconds = M.ps_seconds(0.2, 4e7, workers, 1e8, **kw, shards=2, every=1, apply=0.8)
        assert seconds == pytest.approx((3.2 + 0.8) / 2, rel=0.02)
    # More shards, shorter steps.
    steps = [M.ps_seconds(0.2, 4e7, 8, 1e8, **kw, shards=k, every=1, apply=0.8) for k in (1, 2, 4)]
    assert steps[0] > steps[1] > steps[2]


def test_parameter_server_tasks_sharing_cores():
    # Unlimited links, 2 workers, 2 shards on 2 shared cores: one system step
    # is at least all tasks' core-seconds over the cores, whatever the shards.
    kw = dict(o=1e-3, beta=1.0, messages=0.4, alpha_hop=0.0, gamma=4e-9, every=5, apply=0.01)
    kw.update(blocks=4, prefetched=1.0)
    core_seconds = 0.04 + 0.4 * 1e-3 + (2 * 4e7 * 4e-9 + 0.01) / 5
    for shards in (1, 2):
        alone = M.ps_seconds(0.04, 4e7, 2, math.inf, **kw, shards=shards)
        shared = M.ps_seconds(0.04, 4e7, 2, math.inf, **kw, shards=shards, cores=2)
        assert shared == pytest.approx(max(alone, core_seconds / 2))
    # Two shards halve the busiest shard's time; on shared cores they cannot.
    assert M.ps_seconds(0.04, 4e7, 2, math.inf, **kw, shards=2) < core_seconds / 2
    # A slow link: the wire sets the pace, the cores' bound does not bind.
    slow = M.ps_seconds(0.04, 4e7, 2, 1e8, **kw, shards=1)
    assert M.ps_seconds(0.04, 4e7, 2, 1e8, **kw, shards=1, cores=2) == slow


def test_measured_downpour_points_share_the_machines_cores_but_predictions_do_not():
    record = _run_record("ps", 1e8, 1e6, None, 1.0, n=5, ps=2)
    point = M.points({"runs": [record], "machine": {"cpu_count": 2}})[0]
    assert point["cores"] == 2
    assert M._on_cluster(dict(point, workers_per_shard=4), 64)["cores"] is None


def test_parameter_server_rounds_hide_pushes_behind_blocks():
    kw = dict(o=0.0, beta=1.0, messages=0, alpha_hop=0.0, shards=1, apply=0.0)
    # One worker, rounds of 3 blocks of 5 steps, 1.0 s of compute a block and
    # 3.2 s a transfer: the first fetch; block 1 while the second fetch
    # crosses; block 2 while push 1 and fetch 3 cross at once (one transfer
    # time, not two); block 3 while push 2 crosses; push 3. b + 2 transfers.
    three = M.ps_seconds(0.2, 4e7, 1, 1e8, **kw, every=5, blocks=3)
    assert three == pytest.approx(5 * 3.2 / 15)
    assert M.round_alone(1.0, 3.2, 3.2, 3) == pytest.approx(5 * 3.2)
    # Compute longer than a push: the pushes hide behind the blocks.
    slow = M.ps_seconds(2.0, 4e7, 1, 1e8, **kw, every=5, blocks=3)
    assert slow == pytest.approx((3.2 + 10.0 + 3.2 + 2 * 10.0) / 15)
    # A round that starts from parameters its worker prefetched during its
    # previous round has no first fetch: b + 1 transfers.
    assert M.round_alone(1.0, 3.2, 3.2, 3, prefetched=1.0) == pytest.approx(4 * 3.2)
    half = M.ps_seconds(0.2, 4e7, 1, 1e8, **kw, every=5, blocks=3, prefetched=0.5)
    assert half == pytest.approx(4.5 * 3.2 / 15)
    # One block a round: the first fetch, the block while the next round's
    # parameters cross, the push; longer rounds are never slower.
    assert M.ps_seconds(0.2, 4e7, 1, 1e8, **kw, every=5, blocks=1) == pytest.approx(9.6 / 5)
    one = M.ps_seconds(0.2, 4e7, 1, 1e8, **kw, every=5, blocks=1, prefetched=1.0)
    assert one == pytest.approx(6.4 / 5)
    for workers in (1, 2, 8):
        by_blocks = [
            M.ps_seconds(0.2, 4e7, workers, 1e8, **kw, every=5, blocks=b) for b in (1, 2, 4, 8)
        ]
        assert by_blocks == sorted(by_blocks, reverse=True)


def test_parameter_server_two_workers_one_or_two_shards():
    # The network benchmark's shape: 2 workers, rounds of 4 blocks of 5
    # steps, 3.2 s a transfer. One shard: its links carry both workers'
    # 8 transfers a round each way (25.6 s), more than one worker's round
    # of b + 2 = 6 transfers (19.2 s). Two shards: half each, and the
    # workers' own rounds set the pace.
    kw = dict(o=0.0, beta=1.0, messages=0, alpha_hop=0.0, apply=0.0, every=5, blocks=4)
    one = M.ps_seconds(0.1, 4e7, 2, 1e8, **kw, shards=1)
    assert one == pytest.approx(25.6 / 40)
    two = M.ps_seconds(0.1, 4e7, 2, 1e8, **kw, shards=2)
    assert two == pytest.approx(19.2 / 40)


def test_ps_messages_are_transfers_counted_from_the_configuration():
    # A run recorded with a count per variable and shard gets the transfers.
    record = _run_record("ps", 1e8, 1e6, None, 1.0, n=5, ps=2)
    record["messages"] = 12 * 2 / 5
    point = M.points({"runs": [record]})[0]
    assert point["messages"] == pytest.approx(2 / 5)
    # More shards: a push reaches them all at once, still one transfer.
    scaled = M._on_cluster(dict(point, workers_per_shard=4), 64)
    assert scaled["shards"] == 16
    assert scaled["messages"] == point["messages"]


def test_software_cost_per_byte_adds_to_the_wire():
    # gamma: seconds per byte on the cores; on an unlimited link it is all that is left.
    base = M.ring_allreduce_seconds(0.1, 1e6, 2, 1e8, 0.0, 1.0, 1, 0.0)
    assert M.ring_allreduce_seconds(0.1, 1e6, 2, 1e8, 0.0, 1.0, 1, 0.0, gamma=2e-9) == (
        pytest.approx(base + 2e-3)
    )
    assert M.allgather_seconds(0.1, 1e6, 3, math.inf, 0.0, 1.0, 1, 0.0, gamma=2e-9) == (
        pytest.approx(0.1 + 2 * 2e-3)
    )
    one = M.ps_seconds(
        0.0, 4e7, 1, math.inf, 0.0, 1.0, 0, 0.0, 5e-9, shards=1, every=1, apply=0, prefetched=1.0
    )
    assert one == pytest.approx(2 * 0.2)


def _run_record(kind, link_bps, params, logical, step, n=None, ps=None, compute=0.05):
    system = f"downpour n={n} ps={ps}" if kind == "ps" else kind
    return {
        "kind": kind,
        "system": system,
        "model": "1M",
        "link": f"{link_bps:.0e}",
        "link_bps": link_bps,
        "workers": 2,
        "compute_seconds": compute,
        "compress_seconds": 0.002,
        "aggregate_seconds": None if kind in ("ps", "powersgd") else {"2": 1e-3, "8": 3e-3},
        "apply_seconds": 0.01 if kind == "ps" else None,
        "factorise_seconds": 0.004 if kind == "powersgd" else None,
        "factorise_sums_seconds": 0.001 if kind == "powersgd" else None,
        "cast_seconds": 0.001 if kind == "fp16" else None,
        "messages": 6 if kind != "ps" else 2 / n,
        "step_seconds": step,
        "examples_per_step": 64 if kind == "ps" else 128,
        "params": params,
        "logical_bytes": logical,
        "n": n,
        "ps": ps,
        "config": {"round": 4 * n} if kind == "ps" else {},
    }


def _synthetic(params):
    """A network result whose steps follow the model exactly with ``params``, each
    configuration also measured on unlimited links."""
    runs = []
    for bps in (1e8, 1e9):
        for kind, logical in (("dense", 4e6), ("fp16", 2e6), ("dgc", 1e4), ("powersgd", 4e4)):
            runs.append(_run_record(kind, bps, 1e6, logical, 1.0))
        for n in (1, 5, 20):
            for ps in (1, 2):
                runs.append(_run_record("ps", bps, 1e6, None, 1.0, n=n, ps=ps))
    for i, r in enumerate(runs):
        r["compute_seconds"] = 0.02 + 0.01 * (i % 3)
    # Without unlimited steps yet, points() gives one point per run, in order.
    for r, p in zip(runs, M.points({"runs": runs})):
        r["step_seconds"] = M.predict(p, 2, r["link_bps"], params)
        # Runs without a rate limit take their block's median compute.
        none = M._at_block_compute(p)
        r["unlimited_step_seconds"] = M.predict(none, 2, math.inf, params)
    return {"runs": runs, "quick": True}


def test_downpour_and_no_limit_points_take_their_blocks_median_compute():
    runs = [
        _run_record("dense", 1e8, 1e6, 4e6, 1.0, compute=0.058),
        _run_record("fp16", 1e8, 1e6, 2e6, 1.0, compute=0.033),
        _run_record("dgc", 1e8, 1e6, 1e4, 1.0, compute=0.034),
        _run_record("ps", 1e8, 1e6, None, 1.0, n=5, ps=1, compute=0.058),
        # Another block (link): its own median.
        _run_record("dense", 1e9, 1e6, 4e6, 1.0, compute=0.020),
        _run_record("ps", 1e9, 1e6, None, 1.0, n=5, ps=1, compute=0.020),
    ]
    runs[3]["unlimited_step_seconds"] = 0.5
    runs[0]["unlimited_step_seconds"] = 0.4
    pts = M.points({"runs": runs})
    ps = [p for p in pts if p["kind"] == "ps"]
    assert [p["link"] for p in ps] == ["1e+08", "none", "1e+09"]
    assert [p["compute"] for p in ps] == pytest.approx([0.034, 0.034, 0.020])
    assert ps[0]["c"] == pytest.approx(0.034)
    # The synchronous points keep their own timing; a lone Downpour run its own.
    assert pts[0]["compute"] == pytest.approx(0.058)
    # A synchronous configuration's run without a rate limit (its timing not
    # recorded) takes its block's median, beside its local costs.
    none = [p for p in pts if p["link"] == "none" and p["kind"] == "dense"][0]
    assert none["compute"] == pytest.approx(0.034) and none["measured"] == 0.4
    assert none["c"] - none["compute"] == pytest.approx(pts[0]["c"] - pts[0]["compute"])
    # So does every system the predictions scale.
    scenarios = {p["system"]: p for p in M._scenarios(pts)}
    assert scenarios["dense"]["compute"] == pytest.approx(0.034)
    alone = M.points({"runs": [_run_record("ps", 1e8, 1e6, None, 1.0, n=5, ps=1, compute=0.07)]})
    assert alone[0]["compute"] == pytest.approx(0.07)


def test_no_limit_points_take_their_runs_own_compute_and_compressor_timings():
    dgc = dict(_run_record("dgc", 1e8, 1e6, 1e4, 1.0), unlimited_step_seconds=0.3)
    dgc.update(unlimited_compute_seconds=0.04, unlimited_compress_seconds=0.005)
    psgd = dict(_run_record("powersgd", 1e8, 1e6, 4e4, 1.0), unlimited_step_seconds=0.3)
    psgd.update(unlimited_compute_seconds=0.06, unlimited_compress_seconds=0.5)
    pts = M.points({"runs": [dgc, psgd]})
    limited, none = pts[0], pts[1]
    assert none["link"] == "none" and none["compute"] == pytest.approx(0.04)
    # DGC's compressor clock (excluding its exchange) is replaced too.
    assert none["compress"] == pytest.approx(0.005)
    assert none["c"] - limited["c"] == pytest.approx((0.04 - 0.05) + (0.005 - 0.002))
    # PowerSGD's clock includes its exchange: only the compute is replaced.
    limited, none = pts[2], pts[3]
    assert none["compute"] == pytest.approx(0.06)
    assert none["c"] - limited["c"] == pytest.approx(0.06 - limited["compute"])


def test_points_add_measured_compressor_and_aggregation_time():
    record = _run_record("dgc", 1e8, 1e6, 1e4, 1.0)
    point = M.points({"runs": [record]})[0]
    assert point["c"] == pytest.approx(0.05 + 0.002)  # compute + the compressor's clock
    assert point["compute"] == pytest.approx(0.05)
    assert point["aggregate"] == (1e-3, 3e-3)
    # PowerSGD's clock spans its exchange rounds: its compute and its local
    # work measured apart count, not the clock.
    psgd = M.points({"runs": [_run_record("powersgd", 1e8, 1e6, 1e4, 1.0)]})[0]
    assert psgd["c"] == pytest.approx(0.05 + 0.004)
    # fp16's casts to half precision and back are outside the ring's bytes.
    fp16 = M.points({"runs": [_run_record("fp16", 1e8, 1e6, 2e6, 1.0)]})[0]
    assert fp16["c"] == pytest.approx(0.05 + 0.001)


def test_powersgd_residual_runs_beside_its_second_round():
    # The residual's update (local work less what the sums need) hides behind
    # the second round's fixed part, o plus 2(N-1) hops: 3 ms of it here.
    assert M.residual_hidden(0.004, 2, 0.003, alpha_hop=0.0) == pytest.approx(0.003)
    assert M.residual_hidden(0.001, 2, 0.003, alpha_hop=0.0) == pytest.approx(0.001)
    assert M.residual_hidden(0.004, 3, 0.003, alpha_hop=1e-4) == pytest.approx(0.0034)
    psgd = M.points({"runs": [_run_record("powersgd", 1e8, 1e6, 4e4, 1.0)]})[0]
    assert psgd["residual"] == pytest.approx(0.004 - 0.001)
    params = {"collective": (0.002, 1.0, 0.0)}
    dense = dict(psgd, kind="dense")  # the same exchange, nothing hidden
    hidden = M.predict(dense, 2, 1e8, params, 0.0) - M.predict(psgd, 2, 1e8, params, 0.0)
    assert hidden == pytest.approx(0.002)  # min(3 ms residual, o = 2 ms)


def test_missing_local_costs_are_measured(monkeypatch):
    calls = []

    def measure(kind, model):
        calls.append((kind, model))
        if kind == "ps":
            return {"apply_seconds": 0.5}
        if kind == "powersgd":
            return {
                "aggregate_seconds": None,
                "factorise_seconds": 0.03,
                "factorise_sums_seconds": 0.01,
            }
        if kind == "fp16":
            return {"aggregate_seconds": None, "cast_seconds": 0.02}
        return {"aggregate_seconds": {"2": 0.1, "8": 0.2}}

    dgc = _run_record("dgc", 1e8, 1e6, 2e4, 1.0)
    ps = _run_record("ps", 1e8, 1e6, None, 1.0, n=5, ps=2)
    psgd = _run_record("powersgd", 1e8, 1e6, 4e4, 1.0)
    dense = _run_record("dense", 1e8, 1e6, 4e6, 1.0)
    fp16 = _run_record("fp16", 1e8, 1e6, 2e6, 1.0)
    for r, field in ((dgc, "aggregate_seconds"), (ps, "apply_seconds")):
        r.pop(field)
    psgd.pop("factorise_seconds")
    psgd.pop("factorise_sums_seconds")
    dense.pop("aggregate_seconds")
    fp16.pop("cast_seconds")
    pts = M.points({"runs": [dgc, ps, psgd, dense, fp16]}, measure=measure)
    # Dense gradients are summed inside the all-reduce: no local cost to measure.
    # (Each field asks; measured_here times a kind and model once.)
    assert list(dict.fromkeys(calls)) == [
        ("dgc", "1M"),
        ("ps", "1M"),
        ("powersgd", "1M"),
        ("fp16", "1M"),
    ]
    assert pts[0]["aggregate"] == (0.1, 0.2) and pts[1]["apply"] == 0.5
    assert pts[2]["c"] == pytest.approx(0.05 + 0.03) and pts[2]["residual"] == pytest.approx(0.02)
    assert pts[3]["c"] == pts[3]["compute"] and pts[3]["aggregate"] == (0.0, 0.0)
    assert pts[4]["c"] == pytest.approx(0.05 + 0.02)
    # A run that recorded its local work but not the sums' share: the
    # residual is what of the recorded work exceeds the sums timed here, and
    # nothing when the recorded timing held the sums alone (before the
    # evening of 2026-11-27 it pruned the residual).
    older = _run_record("powersgd", 1e8, 1e6, 4e4, 1.0)
    older.update(factorise_seconds=0.025)
    older.pop("factorise_sums_seconds")
    point = M.points({"runs": [older]}, measure=measure)[0]
    assert point["c"] == pytest.approx(0.05 + 0.025)
    assert point["residual"] == pytest.approx(0.025 - 0.01)
    older.update(factorise_seconds=0.008)
    assert M.points({"runs": [older]}, measure=measure)[0]["residual"] == 0.0


def test_fit_recovers_known_parameters():
    truth = {"collective": (2e-3, 1.3, 3e-9), "parameter_server": (5e-3, 2.0, 1e-9)}
    params = M.fit(M.points(_synthetic(truth)))
    for family, values in truth.items():
        assert params[family] == pytest.approx(values, rel=1e-3)


def test_run_validates_every_point_and_plots(tmp_path, monkeypatch):
    truth = {"collective": (1e-3, 1.2, 2e-9), "parameter_server": (4e-3, 1.8, 1e-9)}
    (tmp_path / "network.quick.json").write_text(json.dumps(_synthetic(truth)))
    monkeypatch.setattr(_harness, "RESULTS_DIR", str(tmp_path))
    result = M.run(quick=True)
    # 20 runs, and each of their 10 configurations once on unlimited links.
    assert len(result["validation"]) == 30
    assert sum(c["link"] == "none" for c in result["validation"]) == 10
    assert result["max_abs_error"] < 1e-3 and result["within_15_percent"]
    assert result["max_abs_left_out_error"] < 1e-3
    assert {p["workers"] for p in result["predictions"]} == set(M.WORKERS)
    assert {p["alpha_hop_us"] for p in result["predictions"]} == {5, 20, 50}
    assert all((tmp_path / p.split("/")[-1]).exists() for p in result["plots"])
    assert _harness.format_table(result["table"]).count("\n") == 31
    # Downpour both with the measured shards and with one shard per 4 workers.
    systems = {row[1] for row in result["prediction_table"]["rows"]}
    assert {"downpour n=5 ps=2", "downpour n=5 ps=N/4"} <= systems
    (tmp_path / "scaling_model.json").write_text(json.dumps(result))
    text = M.readme(str(tmp_path / "scaling_model.json"))
    assert "256/8 % at 50 us" in text and "left out %" in text


def test_missing_results_file_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(_harness, "RESULTS_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"network.json does not exist; run `python -m"):
        M.run(quick=False)


def test_invalid_results_are_clear_errors(tmp_path):
    bad = tmp_path / "network.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        M.load(str(bad))
    with pytest.raises(ValueError, match="no 'runs' list"):
        M.points({"table": {}})
    with pytest.raises(ValueError, match="no runs"):
        M.points({"runs": []})
    with pytest.raises(ValueError, match="run 0 of the network result is invalid"):
        M.points({"runs": [{"kind": "dense"}]})
    record = _run_record("ring", 1e9, 1e6, 4e6, 1.0)
    with pytest.raises(ValueError, match="run 0 has unknown kind 'ring'"):
        M.points({"runs": [record]})


@pytest.mark.timeout(120)
def test_local_costs_are_measured_for_each_kind():
    from benchmarks import _network_run

    dgc = _network_run.local_costs("dgc", 32)["aggregate_seconds"]
    assert set(dgc) == {"2", "8"} and all(v > 0 for v in dgc.values())
    psgd = _network_run.local_costs("powersgd", 32)
    assert psgd["aggregate_seconds"] is None and psgd["factorise_seconds"] > 0
    fp16 = _network_run.local_costs("fp16", 32)
    assert fp16["aggregate_seconds"] is None and fp16["cast_seconds"] > 0
    assert _network_run.local_costs("ps", 32)["apply_seconds"] > 0


@pytest.mark.timeout(120)
def test_local_exchange_times_the_states_work_too():
    import numpy as np

    from benchmarks import _network_run

    # PowerSGD at hidden 32: 6 sums, 6 residuals and the Q of its 3 matrices;
    # the residual of the (32, 32) gradient is really computed (not pruned).
    outputs = _network_run.local_exchange("powersgd", 32)()
    assert len(outputs) == 15
    gradients = [tuple(s) for s in _network_run.shapes(32)]
    assert [tuple(t.shape) for t in outputs[:6]] == gradients
    residuals = [t for t in outputs[6:] if tuple(t.shape) in gradients]
    assert sorted(tuple(t.shape) for t in residuals) == sorted(gradients)
    square = next(t for t in residuals if tuple(t.shape) == (32, 32))
    assert np.abs(square.numpy()).max() > 0
    # fp16: the sums cast there and back, no state.
    assert len(_network_run.local_exchange("fp16", 32)()) == 6
