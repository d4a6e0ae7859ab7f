"""CompressedMultiWorkerMirroredStrategy across real OS processes (one per worker).

Every worker runs the same program (``tests/programs/compressed_workers.py``)
with its own ``TF_CONFIG`` (ports on 127.0.0.1 from ``free_port``), as
MultiWorkerMirroredStrategy programs do.
"""

import json

import pytest

from tests.programs import run_workers


def train_workers(name, kwargs):
    """Every worker's RESULT of the ``train`` case with compressor ``name``."""
    return run_workers(
        "compressed_workers", "train", name, json.dumps(kwargs), timeout=180, every=True
    )


def check_workers(results, min_ratio):
    first = results[0]
    for other in results[1:]:  # replicas stayed in sync through the compressed exchange
        for a, b in zip(first["weights"], other["weights"]):
            assert a == pytest.approx(b, abs=1e-6)
        # Keras logs the workers' mean: every worker's history is the same.
        assert other["loss"] == first["loss"]
    assert first["loss"][-1] < first["loss"][0]
    assert min(first["ratio"]) >= min_ratio
    assert first["stats"]["wire_bytes"] > 0


@pytest.mark.timeout(240)
def test_two_worker_processes_topk_error_feedback():
    results = train_workers("ef_topk", {"ratio": 0.05})
    check_workers(results, min_ratio=9.0)
    # Same shapes and a fixed k: both workers put the same bytes on the wire.
    assert results[0]["stats"]["wire_bytes"] == results[1]["stats"]["wire_bytes"]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "name,kwargs,min_ratio",
    [
        ("dgc", {"sparsity": 0.99, "warmup_epochs": 1, "steps_per_epoch": 4}, 3.0),
        ("dgc", {"sparsity": 0.99}, 1.5),  # the defaults: the warm-up follows fit's epochs
        ("onebit", {}, 20.0),
        ("qsgd", {"levels": 4}, 5.0),
        ("powersgd", {"rank": 2}, 3.0),
        ("fp16", {}, 2.0),
    ],
)
def test_two_worker_processes_other_families(name, kwargs, min_ratio):
    check_workers(train_workers(name, kwargs), min_ratio)


@pytest.mark.timeout(240)
def test_two_workers_reduce_a_steps_scalar_logs_in_one_collective_per_dtype():
    """Keras 3 reduces each log of a step across the workers with a
    collective of its own, one after another; the strategy's reduction gives
    the same means with one per dtype of scalars (non-scalars as Keras)."""
    results = run_workers("compressed_workers", "log_reduction", timeout=180, every=True)
    for r in results:
        assert r["strategy"]["logs"] == r["keras"]["logs"]
        assert r["keras"]["logs"] == {
            "loss": 1.5,
            "accuracy": 0.125,
            "seen": 15.0,
            "per_class": 3.0,
        }
        # A vector's mean over axis 0 reduces its sum and its length: 2 each way.
        assert r["keras"]["collectives"] == 3 + 2
        assert r["strategy"]["collectives"] == 2 + 2  # float32, float64, the vector


@pytest.mark.timeout(240)
@pytest.mark.parametrize("pack", [0, 1_000_000])
@pytest.mark.slow
def test_two_worker_sum_is_a_subdivided_ring(pack):
    """The summable exchange's all-reduce across processes: exact sums, a ring
    TensorFlow may subdivide, one collective per dtype and pack."""
    results = run_workers("compressed_workers", "ring_sum", pack, timeout=180, every=True)
    for r in results:
        assert r["big"] == [3.0, 3.0]
        assert r["mid"] == [3.0, 3.0] and r["mid_shape"] == [1000, 300]
        assert r["small"] == [0.0, 3.0, 6.0, 9.0, 12.0, 15.0] and r["small_dtype"] == "float16"
        # float32: one pack of 13.2 MB, or (packs of >= 1 MB, last gradient
        # first) 1.2 then 12 MB; float16: one.
        assert len(r["subdivs"]) == (2 if pack == 0 else 3)
        assert set(r["subdivs"]) == {16}
