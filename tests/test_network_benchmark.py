"""The ``network`` benchmark: its byte counters and table (fast), and a --quick smoke (slow)."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import _harness
from benchmarks import _network_run
from benchmarks import network

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_model_sizes_are_about_1m_and_10m():
    assert 0.9e6 < _network_run.parameters(network.MODELS["1M"]) < 1.1e6
    assert 9.5e6 < _network_run.parameters(network.MODELS["10M"]) < 10.5e6


NET_DEV = """\
Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo: 9000      10    0    0    0     0          0         0     9000      10    0    0    0     0       0          0
  eth0: 1200       5    0    0    0     0          0         0      700       4    0    0    0     0       0          0
 veth1:   34       1    0    0    0     0          0         0       56       1    0    0    0     0       0          0
"""


def test_net_bytes_sums_every_interface_but_loopback():
    assert _network_run.parse_net_dev(NET_DEV) == (1200 + 34, 700 + 56)


def test_messages_per_step():
    # Dense, fp16: one batched all-reduce.
    assert network._messages("dense") == network._messages("fp16") == 1
    # DGC: the packed buffer and its length; PowerSGD: its two rounds.
    for method in ("dgc", "powersgd"):
        assert network._messages(method) == 2
    # Downpour: a push and a fetch every n steps, each counted once whatever
    # tensors it carries (one per ps task and per split piece), so the model
    # and the number of shards do not enter.
    assert network._messages("ps", n=5) == pytest.approx(2 / 5)
    assert network._messages("ps", n=1) == pytest.approx(2)


def test_row_ideal_and_table():
    out = {
        "step_seconds": 0.5,
        "chunk_step_seconds": 0.6,
        "link_bytes_per_step": {"worker:0": [1e6, 2.5e6], "worker:1": [2.5e6, 1e6]},
        "compressor_bytes_per_step": 2.4e6,
        "compress_seconds_per_step": 0.01,
        "seconds_to_target": None,
        "curve": [[10, 5.0, 0.3]],
        "steps": 10,
    }
    cfg = {"system": "sync", "method": "fp16"}
    row = network._row("100mbit", "1M", cfg, out, 0.1)
    # compute 0.1 s + busiest link 2.5 MB at 100 Mbit/s = 0.2 s
    assert row["ideal_seconds"] == pytest.approx(0.3)
    assert row["achieved_over_ideal"] == pytest.approx(0.6)
    row["step_speedup_vs_dense"], row["tta_speedup_vs_dense"] = 1.0, None
    text = _harness.format_table(network.table([row]))
    assert "not reached" in text and "fp16" in text
    assert row["config"] == cfg
    # Machine ideal: the larger of the ideal and the step on unlimited links.
    network.add_machine_ideal(row, {("1M", "fp16"): [_unlimited(0.1, 0.09)]})
    assert row["machine_ideal_seconds"] == pytest.approx(0.3)
    # The no-limit step is the median of its passes, every pass kept, and so
    # are the no-limit runs' own compute and compressor timings.
    passes = [_unlimited(0.5, 0.12, 0.02), _unlimited(0.4, 0.11, 0.03), _unlimited(0.35, 0.13)]
    network.add_machine_ideal(row, {("1M", "fp16"): passes})
    assert row["unlimited_step_seconds"] == pytest.approx(0.4)
    assert row["unlimited_step_passes"] == [0.5, 0.4, 0.35]
    assert row["unlimited_compute_seconds"] == pytest.approx(0.12)
    assert row["unlimited_compress_seconds"] == pytest.approx(0.025)
    assert row["machine_ideal_seconds"] == pytest.approx(0.4)
    assert row["achieved_over_machine_ideal"] == pytest.approx(0.8)
    assert "0.8" in _harness.format_table(network.table([row]))
    # The rate-limited row's own compute is untouched.
    assert row["compute_seconds"] == pytest.approx(0.1)


def _unlimited(step, compute, compress=None):
    return {"step_seconds": step, "compute_seconds": compute, "compress_seconds": compress}


def _downpour_out(step):
    return {
        "step_seconds": step,
        "chunk_step_seconds": step,
        "link_bytes_per_step": {"worker:0": [1e6, 1e6], "ps:0": [2e6, 2e6]},
        "push_bytes_per_step": 1e6,
        "fetch_bytes_per_step": 1e6,
        "seconds_to_target": None,
        "curve": [[10, 5.0, 0.3]],
        "steps": 10,
    }


def test_downpour_rows_take_their_blocks_median_compute():
    sync = {
        "step_seconds": 0.5,
        "link_bytes_per_step": {"worker:0": [1e6, 1e6]},
        "compressor_bytes_per_step": 1e6,
        "seconds_to_target": None,
        "curve": [[10, 5.0, 0.3]],
        "steps": 10,
    }
    rows = [
        network._row("100mbit", "1M", {"system": "sync", "method": m}, sync, c)
        for m, c in (("dense", 0.058), ("fp16", 0.033), ("dgc", 0.034), ("powersgd", 0.035))
    ]
    cfg = {"system": "downpour", "n": 5, "ps": 1}
    # Downpour times no compute: the row starts with the dense run's.
    rows.append(network._row("100mbit", "1M", cfg, _downpour_out(0.4), 0.058))
    network.set_block_compute(rows)
    ps = rows[-1]
    assert ps["compute_seconds"] == pytest.approx(0.0345)
    assert ps["compute_from"] == "block median"
    # Ideal: one worker's step (the two compute in parallel) + 2 MB at 100 Mbit/s.
    assert ps["ideal_seconds"] == pytest.approx(0.0345 / 2 + 0.16)
    assert ps["achieved_over_ideal"] == pytest.approx(ps["ideal_seconds"] / 0.4)
    assert [r["compute_seconds"] for r in rows[:4]] == [0.058, 0.033, 0.034, 0.035]
    # Without a rate limit it takes the median of its model's synchronous timings.
    unlimited = {
        ("1M", r["system"]): [_unlimited(0.1, 0.03 + 0.001 * i)] for i, r in enumerate(rows)
    }
    unlimited[("1M", ps["system"])] = [_unlimited(0.01, None)]
    network.add_machine_ideal(ps, unlimited)
    assert ps["unlimited_compute_seconds"] == pytest.approx(0.0315)
    assert "unlimited_compress_seconds" not in ps


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_benchmark_end_to_end():
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "network", "--quick"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=560,
        env=dict(os.environ, PYTHONPATH=REPO),
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(REPO, "benchmarks", "results", "network.quick.json")) as f:
        result = json.load(f)
    systems = {r["system"] for r in result["runs"]}
    assert {"dense", "fp16", "dgc", "powersgd"} <= systems
    assert any(s.startswith("downpour") for s in systems)
    for r in result["runs"]:
        assert r["step_seconds"] > 0 and r["ideal_seconds"] > 0
        assert r["busiest_link_bytes"] > 0


def test_round_length_runs_the_network_benchmarks_downpour_with_b_blocks_a_round():
    from benchmarks import round_length

    cfg = round_length._cfg(0, 8, 2)
    # Rounds of 8 blocks of n = 5; one fit of four rounds timed after an untimed one of two.
    assert (cfg["round"], cfg["chunk"], cfg["max_steps"]) == (40, 160, 240)
    assert _network_run.round_steps(cfg) == 40
    assert (cfg["system"], cfg["ps"], cfg["n"]) == ("downpour", 2, 5)
    out = {
        "step_seconds": 0.7,
        "chunk_step_seconds": 0.6,
        "link_bytes_per_step": {"worker:0": [4.2e6, 4.2e6], "ps:0": [2.1e6, 2.1e6]},
        "push_bytes_per_step": 4e6,
        "fetch_bytes_per_step": 4e6,
        "seconds_to_target": None,
        "curve": [[120, 30.0, 0.2]],
        "steps": 240,
    }
    row = network._row("100mbit", "10M", cfg, out, 0.17)
    row.update(blocks=8, steps_per_round=40)
    text = _harness.format_table(round_length.table([row]))
    assert "0.6" in text and "40" in text
