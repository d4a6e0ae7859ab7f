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


def test_net_bytes_reads_this_namespace():
    rx, tx = _network_run.net_bytes()
    assert rx >= 0 and tx >= 0


def test_messages_per_step():
    assert network._messages("dense") == 1  # one batched all-reduce
    # fp16, DGC: the packed buffer and its length; PowerSGD: its two rounds.
    for method in ("fp16", "dgc", "powersgd"):
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
    network.add_machine_ideal(row, 0.1)
    assert row["machine_ideal_seconds"] == pytest.approx(0.3)
    network.add_machine_ideal(row, 0.4)
    assert row["machine_ideal_seconds"] == pytest.approx(0.4)
    assert row["achieved_over_machine_ideal"] == pytest.approx(0.8)
    assert "0.8" in _harness.format_table(network.table([row]))


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
