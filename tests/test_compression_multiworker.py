"""CompressedMultiWorkerMirroredStrategy across real OS processes (one per worker).

Every worker runs the same Keras script with its own ``TF_CONFIG`` (ports on
127.0.0.1 from ``free_port``), as MultiWorkerMirroredStrategy programs do.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tfdist_ext.cluster import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = textwrap.dedent("""
    import json, os, sys
    import numpy as np, tensorflow as tf, keras
    from tfdist_ext import compression as C, datasets
    from tfdist_ext.callbacks._compression import CompressionLogger

    name, kwargs = sys.argv[1], json.loads(sys.argv[2])
    strategy = C.CompressedMultiWorkerMirroredStrategy(compression=C.get(name, **kwargs))
    keras.utils.set_random_seed(0)
    x, y = datasets.digits("train", flatten=True, as_numpy=True)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(64).take(8).with_options(options)
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(10)])
        model.compile(keras.optimizers.SGD(0.1),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    logger = CompressionLogger()
    history = model.fit(ds, epochs=3, verbose=0, callbacks=[logger])
    print("RESULT " + json.dumps({
        "weights": [w.ravel().tolist() for w in model.get_weights()],
        "loss": history.history["loss"],
        "ratio": history.history["compression_ratio"],
        "stats": strategy.compression_stats(),
    }), flush=True)
""")


def run_workers(tmp_path, name, kwargs, num_workers=2, timeout=180):
    return run_script(tmp_path, WORKER, [name, json.dumps(kwargs)], {}, num_workers, timeout)


def run_script(tmp_path, source, args, env, num_workers=2, timeout=180):
    """Runs ``source`` in ``num_workers`` processes of one cluster; their RESULT lines."""
    script = tmp_path / "worker.py"
    script.write_text(source)
    cluster = {"worker": [f"127.0.0.1:{free_port()}" for _ in range(num_workers)]}
    procs = []
    for index in range(num_workers):
        task_env = dict(
            os.environ,
            **env,
            PYTHONPATH=REPO,
            TF_CPP_MIN_LOG_LEVEL="2",
            TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *args],
                env=task_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                stdin=subprocess.DEVNULL,
            )
        )
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, f"worker exited {p.returncode}:\n{err[-4000:]}"
            line = [l for l in out.splitlines() if l.startswith("RESULT ")][-1]
            results.append(json.loads(line[len("RESULT ") :]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def check_workers(results, min_ratio):
    first = results[0]
    for other in results[1:]:  # replicas stayed in sync through the compressed exchange
        for a, b in zip(first["weights"], other["weights"]):
            assert a == pytest.approx(b, abs=1e-6)
    assert first["loss"][-1] < first["loss"][0]
    assert min(first["ratio"]) >= min_ratio
    assert first["stats"]["wire_bytes"] > 0


@pytest.mark.timeout(240)
def test_two_worker_processes_topk_error_feedback(tmp_path):
    results = run_workers(tmp_path, "ef_topk", {"ratio": 0.05})
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
def test_two_worker_processes_other_families(tmp_path, name, kwargs, min_ratio):
    check_workers(run_workers(tmp_path, name, kwargs), min_ratio)


SUM_WORKER = textwrap.dedent("""
    import json, os
    import tensorflow as tf
    from tfdist_ext import _integration, compression as C

    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    options = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=int(os.environ["PACK"]))
    strategy = C.CompressedMultiWorkerMirroredStrategy(communication_options=options)
    big = tf.fill([3_000_000], float(task + 1))       # 12 MB: a subdivided ring
    small = tf.range(6, dtype=tf.float16) * (task + 1)
    mid = tf.ones([1000, 300]) * (task + 1)

    @tf.function
    def total():
        return strategy.run(lambda: strategy._all_sum([big, small, mid]))

    out = total()
    reduces = [
        op.get_attr("max_subdivs_per_device")
        for op in total.get_concrete_function().graph.get_operations()
        if op.type == "CollectiveReduceV2"
    ]
    print("RESULT " + json.dumps({
        "big": [float(tf.reduce_min(out[0])), float(tf.reduce_max(out[0]))],
        "small": out[1].numpy().tolist(), "small_dtype": out[1].dtype.name,
        "mid": [float(tf.reduce_min(out[2])), float(tf.reduce_max(out[2]))],
        "mid_shape": out[2].shape.as_list(),
        "subdivs": reduces,
    }), flush=True)
""")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("pack", [0, 1_000_000])
def test_two_worker_sum_is_a_subdivided_ring(tmp_path, pack):
    """The summable exchange's all-reduce across processes: exact sums, a ring
    TensorFlow may subdivide, one collective per dtype and pack."""
    results = run_script(tmp_path, SUM_WORKER, [], {"PACK": str(pack)})
    for r in results:
        assert r["big"] == [3.0, 3.0]
        assert r["mid"] == [3.0, 3.0] and r["mid_shape"] == [1000, 300]
        assert r["small"] == [0.0, 3.0, 6.0, 9.0, 12.0, 15.0] and r["small_dtype"] == "float16"
        # float32: one pack of 13.2 MB, or (packs of >= 1 MB, last gradient
        # first) 1.2 then 12 MB; float16: one.
        assert len(r["subdivs"]) == (2 if pack == 0 else 3)
        assert set(r["subdivs"]) == {16}
