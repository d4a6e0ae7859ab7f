"""The scaling model of benchmarks/scaling_model.py: formulas on hand-computed cases,
its fit recovering known parameters, its validation, and clear errors on bad input."""

import json

import pytest

from benchmarks import _harness
from benchmarks import scaling_model as M


def test_ring_allreduce_by_hand():
    # 0.1 s compute + 2(N-1) m alpha = 2*3*2*1e-4 + 2(N-1)/N * 8 S / B = 1.5 * 8e6 / 1e9
    seconds = M.ring_allreduce_seconds(0.1, 1e6, 4, 1e9, alpha=1e-4, beta=1.0, messages=2)
    assert seconds == pytest.approx(0.1 + 0.0012 + 0.012)
    # Two workers: the ring sends the payload once.
    assert M.ring_allreduce_seconds(0, 1e6, 2, 8e6, 0, 1.0, 1) == pytest.approx(1.0)


def test_allgather_grows_with_workers():
    # DGC: each worker receives the (N-1) others' 1e5 sparse bytes.
    assert M.allgather_seconds(0.1, 1e5, 8, 1e8, 0.0, 1.0, 1) == pytest.approx(0.1 + 0.056)
    assert M.allgather_seconds(0, 1e5, 16, 1e8, 0, 1.0, 1) == pytest.approx(15 * 8e5 / 1e8)


def test_parameter_server_bottleneck():
    # 4e7 bytes of parameters, 4 workers, 100 Mbit/s, push and fetch every step.
    kw = dict(alpha=0.0, beta=1.0, messages=0)
    one_shard = M.ps_seconds(0.2, 4e7, 4, 1e8, **kw, shards=1, every=1)
    assert one_shard == pytest.approx(3.2)  # the ps link: 8 * 4e7 / 1e8
    eight = M.ps_seconds(0.2, 4e7, 4, 1e8, **kw, shards=8, every=1)
    assert eight == pytest.approx((0.2 + 3.2) / 4)  # the workers' own links
    every5 = M.ps_seconds(0.2, 4e7, 4, 1e8, **kw, shards=1, every=5)
    assert every5 == pytest.approx(3.2 / 5)


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
        "compress_seconds": 0.0,
        "messages": 6 if kind != "ps" else 12 * ps / n,
        "step_seconds": step,
        "examples_per_step": 64 if kind == "ps" else 128,
        "params": params,
        "logical_bytes": logical,
        "n": n,
        "ps": ps,
    }


def _synthetic(params):
    """A network result whose steps follow the model exactly with ``params``."""
    runs = []
    for bps in (1e8, 1e9):
        for kind, logical in (("dense", 4e6), ("fp16", 2e6), ("dgc", 1e4), ("powersgd", 4e4)):
            runs.append(_run_record(kind, bps, 1e6, logical, 1.0))
        for n in (1, 5, 20):
            for ps in (1, 2):
                runs.append(_run_record("ps", bps, 1e6, None, 1.0, n=n, ps=ps))
    for i, r in enumerate(runs):
        r["compute_seconds"] = 0.02 + 0.01 * (i % 3)
        p = M.points({"runs": [r]})[0]
        r["step_seconds"] = M.predict(p, 2, r["link_bps"], params)
    return {"runs": runs, "quick": True}


def test_fit_recovers_known_parameters():
    truth = {"collective": (2e-3, 1.3), "collective_ps": (5e-3, 2.0)}
    params = M.fit(M.points(_synthetic(truth)))
    for family, (alpha, beta) in truth.items():
        assert params[family][0] == pytest.approx(alpha, rel=1e-3)
        assert params[family][1] == pytest.approx(beta, rel=1e-3)


def test_run_validates_every_point_and_plots(tmp_path, monkeypatch):
    truth = {"collective": (1e-3, 1.2), "collective_ps": (4e-3, 1.8)}
    (tmp_path / "network.quick.json").write_text(json.dumps(_synthetic(truth)))
    monkeypatch.setattr(_harness, "RESULTS_DIR", str(tmp_path))
    result = M.run(quick=True)
    assert len(result["validation"]) == 20
    assert result["max_abs_error"] < 1e-3
    assert result["max_abs_left_out_error"] < 1e-3
    assert {p["workers"] for p in result["predictions"]} == set(M.WORKERS)
    assert all((tmp_path / p.split("/")[-1]).exists() for p in result["plots"])
    assert _harness.format_table(result["table"]).count("\n") == 21


@pytest.mark.timeout(30)
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
